"""One job per output prefix on an object store: a lease object taken with a conditional put.

The lock is the object ``<prefix>/.reshard_job/lock``, holding JSON: who holds it (the job's
holder text, host, pid), a random token, and the lease length. Taking it is one
``PUT If-None-Match: *``: the store creates the object only if no one else has, so of two jobs
starting at once exactly one wins. The holder rewrites the object every third of the lease from a
daemon thread (``PUT If-Match: <its ETag>``), and deletes it on release.

A holder that dies without releasing (kill -9, lost node) leaves its object behind. It is stale,
and is taken over with ``PUT If-Match: <stale ETag>`` (again only one contender wins), when

- its lease ran out: the store's clock (the ``Date`` of our GET) is past the object's
  ``Last-Modified`` plus the lease. Both times come from the store, so clocks of the machines
  running jobs need not agree; or
- it was written on this host by a process that no longer exists: a job rerun on the machine
  where the last one was killed need not wait for the lease.

Stores without conditional writes (older MinIO, some gateways) ignore the headers and would let a
second put silently replace the first. The first lock on a bucket therefore probes: it puts a
scratch object twice with ``If-None-Match: *`` and sees whether the second is refused. Where it is
not, the lock falls back to a plain lease: read the lock object; if there is none or it is stale,
write ours, wait ``settle_seconds``, and read it back; whoever's token is there holds the lock.
Limits of that fallback: two jobs that both read "no lock" before either write lands within the
settle time can both believe they hold it (the window is the gap between one job's read and its
write, a few milliseconds), and a holder that cannot renew for a whole lease (a stalled machine)
may be taken over while it still writes. Deleting the lock object by hand breaks the lock too.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING

from reshard_job.storage.base import LockedError
from reshard_job.storage.s3errors import error_code, is_absent, is_precondition_failed, shorten, storage_error

if TYPE_CHECKING:
    from reshard_job.storage.s3calls import S3Calls

log = logging.getLogger(__name__)

LOCK_NAME = ".reshard_job/lock"
PROBE_PREFIX = ".reshard_job/probe-"
DEFAULT_LEASE_SECONDS = 60.0
DEFAULT_SETTLE_SECONDS = 2.0
EXPIRY_GRACE_SECONDS = 1.0  # Last-Modified has whole seconds
ACQUIRE_ATTEMPTS = 5
UNSUPPORTED_CONDITION_CODES = frozenset({"NotImplemented", "501", "InvalidArgument", "InvalidRequest"})


@dataclass(frozen=True)
class LeaseRecord:
    holder: str
    host: str
    pid: int
    token: str
    lease_seconds: float

    def to_bytes(self) -> bytes:
        return json.dumps({"holder": self.holder, "host": self.host, "pid": self.pid, "token": self.token,
                           "lease_seconds": self.lease_seconds}).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "LeaseRecord | None":
        try:
            doc = json.loads(data.decode("utf-8"))
            return cls(str(doc["holder"]), str(doc["host"]), int(doc["pid"]), str(doc["token"]),
                       float(doc["lease_seconds"]))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            return None


@dataclass(frozen=True)
class CurrentLock:
    """The lock object as found: its record (None when unreadable), ETag and age by the store's clock."""

    record: LeaseRecord | None
    etag: str
    age_seconds: float

    def describe(self) -> str:
        if self.record is None:
            return "unreadable lock object"
        return shorten(self.record.holder or f"pid {self.record.pid} on {self.record.host}", 80)

    def is_stale(self) -> bool:
        lease = self.record.lease_seconds if self.record else DEFAULT_LEASE_SECONDS
        if self.age_seconds > lease + EXPIRY_GRACE_SECONDS:
            return True
        return self.record is not None and self.record.host == socket.gethostname() \
            and not _process_exists(self.record.pid)


def _process_exists(pid: int) -> bool:
    if pid <= 0:
        return True  # cannot tell: treat as alive
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _age(answer: dict) -> float:
    """Seconds since the object was last written, both times by the store's clock."""
    try:
        server_now = parsedate_to_datetime(answer["ResponseMetadata"]["HTTPHeaders"]["date"])
        return max(0.0, (server_now - answer["LastModified"]).total_seconds())
    except (KeyError, TypeError, ValueError):
        return 0.0  # no usable dates: never stale by age, only by a dead local pid


class ObjectLock:
    """``OutputLock`` held as a lease object (see the module docstring)."""

    def __init__(self, store: "S3Calls", folder_url: str, bucket: str, key: str, record: LeaseRecord,
                 etag: str, conditional: bool):
        self.folder = folder_url
        self.record = record
        self.lost = False  # set when a renewal found the lock taken over
        self._store = store
        self._bucket = bucket
        self._key = key
        self._etag = etag
        self._conditional = conditional
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_until_released, name="reshard-lock-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        if self._stop.is_set():
            return
        self._stop_renewing()
        if self.lost:
            return
        current = _read(self._store, self._bucket, self._key, self.folder)
        if current is None or current.record is None or current.record.token != self.record.token:
            return  # taken over after our lease ran out: the object is someone else's now
        params = {"IfMatch": current.etag} if self._conditional else {}
        try:
            self._store.call_raw("delete_object", Bucket=self._bucket, Key=self._key, **params)
        except Exception as e:  # noqa: BLE001
            if not (is_precondition_failed(e) or is_absent(e)):
                raise storage_error(e, self.folder, "releasing its lock", endpoint=self._store.endpoint,
                                    bucket=self._bucket) from None

    def _stop_renewing(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _renew_until_released(self) -> None:
        interval = max(0.2, self.record.lease_seconds / 3)
        while not self._stop.wait(interval):
            try:
                self._renew()
            except Exception as e:  # noqa: BLE001 - a failed renewal is retried; the lease has slack
                if is_precondition_failed(e):
                    self.lost = True
                    log.warning("%s: the output lock was taken over by another job while this one held it",
                                self.folder)
                    return
                log.warning("%s: could not renew the output lock (%s)", self.folder, type(e).__name__)

    def _renew(self) -> None:
        if self._conditional:
            answer = self._store.call_raw("put_object", Bucket=self._bucket, Key=self._key,
                                          Body=self.record.to_bytes(), IfMatch=self._etag)
            self._etag = answer["ETag"]
            return
        current = _read(self._store, self._bucket, self._key, self.folder)
        if current is None or current.record is None or current.record.token != self.record.token:
            self.lost = True
            log.warning("%s: the output lock was taken over by another job while this one held it", self.folder)
            self._stop.set()
            return
        answer = self._store.call_raw("put_object", Bucket=self._bucket, Key=self._key, Body=self.record.to_bytes())
        self._etag = answer["ETag"]


def _read(store: "S3Calls", bucket: str, key: str, folder_url: str) -> CurrentLock | None:
    try:
        answer = store.call_raw("get_object", Bucket=bucket, Key=key)
        body = store.run(_read_body, answer["Body"])
    except Exception as e:  # noqa: BLE001
        if is_absent(e):
            return None
        raise storage_error(e, folder_url, "reading its lock", endpoint=store.endpoint, bucket=bucket) from None
    record = LeaseRecord.from_bytes(body) if len(body) <= MAX_LOCK_BYTES else None
    return CurrentLock(record, answer.get("ETag", ""), _age(answer))


MAX_LOCK_BYTES = 64 << 10  # a lease record is a few hundred bytes: a larger object is no lock of ours


async def _read_body(body) -> bytes:
    """The lock object's bytes, at most MAX_LOCK_BYTES + 1 of them (more: unreadable, never read whole)."""
    data = b""
    try:
        while len(data) <= MAX_LOCK_BYTES:
            chunk = await body.read(MAX_LOCK_BYTES + 1 - len(data))
            if not chunk:
                break
            data += chunk
        return data
    finally:
        body.close()


def supports_conditional_put(store: "S3Calls", bucket: str, folder_key: str, folder_url: str) -> bool:
    """Whether the store refuses a second ``PUT If-None-Match: *`` of one key (probed once)."""
    probe = f"{folder_key}/{PROBE_PREFIX}{uuid.uuid4().hex}" if folder_key else f"{PROBE_PREFIX}{uuid.uuid4().hex}"
    try:
        try:
            store.call_raw("put_object", Bucket=bucket, Key=probe, Body=b"", IfNoneMatch="*")
        except Exception as e:  # noqa: BLE001
            if error_code(e) in UNSUPPORTED_CONDITION_CODES:
                return False
            raise
        try:
            store.call_raw("put_object", Bucket=bucket, Key=probe, Body=b"", IfNoneMatch="*")
        except Exception as e:  # noqa: BLE001
            if is_precondition_failed(e) or error_code(e) == "ConditionalRequestConflict":
                return True
            if error_code(e) in UNSUPPORTED_CONDITION_CODES:
                return False
            raise
        return False
    except Exception as e:  # noqa: BLE001
        raise storage_error(e, folder_url, "taking its lock", endpoint=store.endpoint, bucket=bucket) from None
    finally:
        try:
            store.call_raw("delete_object", Bucket=bucket, Key=probe)
        except Exception:  # noqa: BLE001 - a stray probe object is harmless
            pass


def _lock_key(folder_key: str) -> str:
    return f"{folder_key}/{LOCK_NAME}" if folder_key else LOCK_NAME


def holder_of(store: "S3Calls", folder_url: str, bucket: str, folder_key: str) -> str | None:
    """Who holds the lock of the output prefix `folder_key` now (None: nobody, or a stale lease)."""
    current = _read(store, bucket, _lock_key(folder_key), folder_url)
    return None if current is None or current.is_stale() else current.describe()


def acquire(store: "S3Calls", folder_url: str, bucket: str, folder_key: str, holder: str, *,
            lease_seconds: float = DEFAULT_LEASE_SECONDS, settle_seconds: float = DEFAULT_SETTLE_SECONDS,
            conditional: bool | None = None) -> ObjectLock:
    """Take the lock of the output prefix `folder_key`, or raise ``LockedError`` naming the holder."""
    key = _lock_key(folder_key)
    if conditional is None:
        conditional = store.conditional_put(bucket, folder_key, folder_url)
    record = LeaseRecord(holder, socket.gethostname(), os.getpid(), uuid.uuid4().hex, float(lease_seconds))

    def put(**condition) -> str | None:
        """Our record's ETag, or None when the condition did not hold."""
        try:
            return store.call_raw("put_object", Bucket=bucket, Key=key, Body=record.to_bytes(), **condition)["ETag"]
        except Exception as e:  # noqa: BLE001
            if is_precondition_failed(e) or error_code(e) == "ConditionalRequestConflict":
                return None
            raise storage_error(e, folder_url, "taking its lock", endpoint=store.endpoint, bucket=bucket) from None

    def settled() -> ObjectLock | None:
        time.sleep(settle_seconds)
        current = _read(store, bucket, key, folder_url)
        if current is not None and current.record is not None and current.record.token == record.token:
            return ObjectLock(store, folder_url, bucket, key, record, current.etag, conditional=False)
        if current is not None:
            raise LockedError(folder_url, current.describe())
        return None

    current = None
    for _ in range(ACQUIRE_ATTEMPTS):
        if conditional:
            etag = put(IfNoneMatch="*")
            if etag is not None:
                return ObjectLock(store, folder_url, bucket, key, record, etag, conditional=True)
        current = _read(store, bucket, key, folder_url)
        if current is None:
            if conditional:
                continue  # released between our put and our read: try again
            put()
            lock = settled()
            if lock is not None:
                return lock
            continue
        if not current.is_stale():
            raise LockedError(folder_url, current.describe())
        log.warning("%s: taking over a stale output lock (%s, last renewed %.0f s ago)", folder_url,
                    current.describe(), current.age_seconds)
        if conditional:
            etag = put(IfMatch=current.etag)
            if etag is not None:
                return ObjectLock(store, folder_url, bucket, key, record, etag, conditional=True)
            continue
        put()
        lock = settled()
        if lock is not None:
            return lock
    raise LockedError(folder_url, current.describe() if current is not None else "contended by other jobs")
