"""Object stores (``s3://`` URLs: AWS S3, Huawei OBS, MinIO, SeaweedFS, ...) as a ``Storage``.

s3fs (through fsspec) provides what is tedious to get right: the credential chain (environment,
``~/.aws``, ``AWS_ENDPOINT_URL``, instance roles), endpoint and client configuration, and an
event loop thread running aiobotocore. On top of it this back end talks the S3 API directly,
because the job needs guarantees that a file-like ``open()`` does not give: ranged GETs pinned
to one object version (``If-Match``), multipart uploads it can abort and later find again, and
conditional puts for its lock. The pieces live in their own modules: ``s3file`` (reads),
``s3upload`` (writes), ``s3lock`` (the output lock), ``s3errors`` (one-line errors).

Layout mirrors the local one: ``<prefix>/rank_<r>/<file>``, ``<prefix>/manifest.json``. A
"folder" is a key prefix that has keys below it; ``makedirs`` does nothing, and a folder with
nothing in it does not exist. Paths may be given with or without a trailing slash. An object
cannot grow, so ``append`` (the resume journal) rewrites the small log object whole.

Credentials (``storage.options`` keys such as ``key``/``secret``/``token``, or the environment)
only ever reach s3fs: URLs are shown without any ``user:password@`` part, the storage's repr
shows neither options nor keys, and no message includes them. How the client is configured
(retries, timeouts), shared and kept safe across ``fork`` is ``s3client``'s.
"""

from __future__ import annotations

import concurrent.futures
import fnmatch
import hashlib
import os
import posixpath
import threading
from typing import Any, Iterable

from reshard_job.storage.base import KIND_DIR, KIND_FILE, FileInfo, SourceChangedError, StorageError
from reshard_job.storage.s3client import (Watchdog, make_s3fs, operation_timeout, options_key, shared_store,
                                          track_store)
from reshard_job.storage.s3errors import (StoreTimeout, error_code, is_absent, is_precondition_failed, shorten,
                                          storage_error, strip_userinfo)

S3_SCHEMES = ("s3", "s3a")
LIST_PAGE = 1000
APPEND_MAX_BYTES = 64 * 1024 * 1024  # a log rewritten on every append must stay small
APPEND_ATTEMPTS = 3


def split_url(url: str) -> tuple[str, str, str]:
    """``s3://bucket/a/b/`` -> ('s3', 'bucket', 'a/b'); credentials in the URL are dropped."""
    scheme, sep, rest = strip_userinfo(url).partition("://")
    if not sep:
        raise StorageError(f"{shorten(url)}: not a URL (expected {scheme or 's3'}://bucket/key)")
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise StorageError(f"{shorten(strip_userinfo(url))}: no bucket in the URL (expected {scheme}://bucket/key)")
    return scheme.lower(), bucket, key.strip("/")


def _identity(size: int, etag: str, modified) -> tuple:
    # Whole seconds: listings and HEAD report Last-Modified with different precision.
    stamp = int(modified.timestamp()) if modified is not None else 0
    return (int(size), etag or "", stamp)


class S3Storage:
    """``Storage`` over an S3-compatible object store (see the module docstring)."""

    def __init__(self, scheme: str = "s3", *, endpoint_url: str | None = None, options: dict[str, Any] | None = None,
                 lease_seconds: float | None = None, settle_seconds: float | None = None,
                 conditional_writes: bool | None = None, part_size: int | None = None, read_concurrency: int = 8):
        from reshard_job.storage import s3lock, s3upload

        self.scheme = scheme
        self._endpoint_url = endpoint_url
        self._options = dict(options or {})
        self.lease_seconds = lease_seconds if lease_seconds is not None else s3lock.DEFAULT_LEASE_SECONDS
        self.settle_seconds = settle_seconds if settle_seconds is not None else s3lock.DEFAULT_SETTLE_SECONDS
        self.conditional_writes = conditional_writes  # None: probe the store
        self.part_size = part_size or s3upload.PART_SIZE
        self.read_concurrency = read_concurrency
        self._fs = None
        self._fs_pid = -1
        self._fs_lock = threading.Lock()
        track_store(self)
        self._conditional_by_bucket: dict[str, bool] = {}
        self._appended: dict[str, tuple[str, bytes]] = {}  # log URL -> (ETag, content) after our last append
        self.watchdog = Watchdog(operation_timeout(self._options))

    def __repr__(self) -> str:  # never the options: they may hold credentials
        return f"S3Storage({self.scheme}://, endpoint={self.endpoint or 'default'})"

    # -- connection ----------------------------------------------------------------------------
    @property
    def endpoint(self) -> str | None:
        """Where requests go, for messages (None: the client's default from the environment)."""
        url = self._endpoint_url or self._options.get("endpoint_url") \
            or (self._options.get("client_kwargs") or {}).get("endpoint_url") \
            or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        return strip_userinfo(url) if url else None

    @property
    def fs(self):
        """This process's s3fs file system (rebuilt after a fork)."""
        with self._fs_lock:
            if self._fs is None or self._fs_pid != os.getpid():
                self._fs = self._make_fs()
                self._fs_pid = os.getpid()
            return self._fs

    def _make_fs(self):
        return make_s3fs(self.scheme, self._endpoint_url, self._options)

    async def client(self):
        """The aiobotocore client (call from coroutines run by ``run``/``submit``)."""
        return await self.fs.set_session()

    def run(self, coroutine_function, *args, transfer: int = 0):
        """Run a coroutine function on this process's event loop and wait for its result, for at most
        the time an operation moving `transfer` bytes may take (``s3client.Watchdog``): then it is
        cancelled and ``StoreTimeout`` raised, which ``s3errors`` words."""
        from fsspec.asyn import FSTimeoutError, sync

        fs = self.fs
        self.watchdog.check()
        limit = self.watchdog.limit(transfer)
        try:
            return sync(fs.loop, coroutine_function, *args, timeout=limit)
        except FSTimeoutError:
            raise self.watchdog.missed(limit) from None

    def submit(self, coroutine_function, *args, transfer: int = 0) -> concurrent.futures.Future:
        """Start a coroutine function on the event loop without waiting for it (bounded like ``run``)."""
        import asyncio

        self.watchdog.check()
        limit = self.watchdog.limit(transfer)

        async def bounded():
            try:
                return await asyncio.wait_for(coroutine_function(*args), limit)
            except asyncio.TimeoutError:
                raise self.watchdog.missed(limit) from None

        return asyncio.run_coroutine_threadsafe(bounded(), self.fs.loop)

    def call_raw(self, operation: str, *, transfer: int | None = None, **params) -> dict:
        """One S3 API call; botocore's exceptions pass through (and ``StoreTimeout``). Its time limit
        grows with `transfer` bytes (default: its ``Body``'s)."""
        async def go():
            client = await self.client()
            return await getattr(client, operation)(**params)

        body = params.get("Body")
        if transfer is None:
            transfer = len(body) if isinstance(body, (bytes, bytearray, memoryview)) else 0
        return self.run(go, transfer=transfer)

    def call(self, operation: str, url: str, doing: str, *, transfer: int | None = None, **params) -> dict:
        """One S3 API call; failures become one-line errors naming `url`."""
        try:
            return self.call_raw(operation, transfer=transfer, **params)
        except Exception as e:  # noqa: BLE001 - every store failure becomes one line
            raise storage_error(e, url, doing, endpoint=self.endpoint, bucket=params.get("Bucket", "")) from None

    # -- naming --------------------------------------------------------------------------------
    def join(self, base: str, *parts: str) -> str:
        out = base.rstrip("/")
        for part in parts:
            part = part.strip("/")
            if part:
                out = f"{out}/{part}"
        return out

    def parent(self, path: str) -> str:
        scheme, bucket, key = split_url(path)
        head = posixpath.dirname(key)
        return f"{scheme}://{bucket}/{head}" if head else f"{scheme}://{bucket}"

    def basename(self, path: str) -> str:
        scheme, bucket, key = split_url(path)
        return posixpath.basename(key) if key else bucket

    def display(self, path: str) -> str:
        return strip_userinfo(path).rstrip("/") if "://" in path else path

    def _url(self, bucket: str, key: str) -> str:
        return f"{self.scheme}://{bucket}/{key}" if key else f"{self.scheme}://{bucket}"

    # -- looking -------------------------------------------------------------------------------
    def info(self, path: str) -> FileInfo | None:
        _, bucket, key = split_url(path)
        url = self._url(bucket, key)
        if key:
            try:
                head = self.call_raw("head_object", Bucket=bucket, Key=key)
                return FileInfo(url, posixpath.basename(key), KIND_FILE, int(head["ContentLength"]),
                                _identity(head["ContentLength"], head.get("ETag", ""), head.get("LastModified")))
            except Exception as e:  # noqa: BLE001
                if not is_absent(e):
                    # A HEAD answer has no body, so a bare 403 does not say whether the key or
                    # the credentials are at fault; the listing below does (no answer at all is clear).
                    if not isinstance(e, StoreTimeout):
                        self._list_page(url, bucket, key + "/", "looking at it", max_keys=1)
                    raise storage_error(e, url, "looking at it", endpoint=self.endpoint, bucket=bucket) from None
        page = self._list_page(url, bucket, key + "/" if key else "", "looking at it", max_keys=1)
        if page.get("KeyCount", 0) or page.get("Contents") or page.get("CommonPrefixes") or not key:
            return FileInfo(url, posixpath.basename(key) or bucket, KIND_DIR)
        return None

    def _list_page(self, url: str, bucket: str, prefix: str, doing: str, *, max_keys: int = LIST_PAGE,
                   delimiter: str = "", token: str | None = None) -> dict:
        params: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix, "MaxKeys": max_keys}
        if delimiter:
            params["Delimiter"] = delimiter
        if token:
            params["ContinuationToken"] = token
        try:
            return self.call_raw("list_objects_v2", **params)
        except Exception as e:  # noqa: BLE001
            if is_absent(e):  # a bare 404 from a listing: the bucket is not there
                raise StorageError(f"{shorten(url)}: bucket '{bucket}' does not exist"
                                   f"{' at ' + self.endpoint if self.endpoint else ''}") from None
            raise storage_error(e, url, doing, endpoint=self.endpoint, bucket=bucket) from None

    def listdir(self, path: str) -> list[FileInfo]:
        _, bucket, key = split_url(path)
        url = self._url(bucket, key)
        prefix = key + "/" if key else ""
        out: list[FileInfo] = []
        token = None
        while True:
            page = self._list_page(url, bucket, prefix, "listing it", delimiter="/", token=token)
            for common in page.get("CommonPrefixes") or ():
                name = common["Prefix"][len(prefix):].rstrip("/")
                if name:
                    out.append(FileInfo(self._url(bucket, prefix + name), name, KIND_DIR))
            for obj in page.get("Contents") or ():
                name = obj["Key"][len(prefix):]
                if not name or "/" in name:
                    continue  # the folder's own marker object ("prefix/")
                out.append(FileInfo(self._url(bucket, obj["Key"]), name, KIND_FILE, int(obj["Size"]),
                                    _identity(obj["Size"], obj.get("ETag", ""), obj.get("LastModified"))))
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                break
        if not out and key:
            found = self.info(path)
            if found is None:
                raise FileNotFoundError(f"{shorten(url)}: no such folder (no keys under this prefix)")
            if found.is_file:
                raise StorageError(f"{shorten(url)}: is an object, not a folder")
        return sorted(out, key=lambda i: i.name)

    # -- reading -------------------------------------------------------------------------------
    def _head_file(self, path: str, doing: str):
        _, bucket, key = split_url(path)
        url = self._url(bucket, key)
        found = None
        try:
            found = self.info(path) if key else FileInfo(url, bucket, KIND_DIR)
        except FileNotFoundError:
            pass
        if found is None:
            raise FileNotFoundError(f"{shorten(url)}: no such object")
        if not found.is_file:
            raise StorageError(f"{shorten(url)}: is a folder (key prefix), expected an object")
        return url, bucket, key, found

    def open_read(self, path: str):
        from reshard_job.storage.s3file import ObjectReader

        url, bucket, key, found = self._head_file(path, "opening it")
        return ObjectReader(self, url, bucket, key, found.size, found.identity[1], found.identity,
                            concurrency=self.read_concurrency)

    def read_bytes(self, path: str, limit: int) -> bytes:
        with self.open_read(path) as reader:
            if reader.size > limit:
                raise StorageError(f"{shorten(reader.path)}: {reader.size} bytes, more than the {limit} bytes such a "
                                   f"file may have")
            (data,) = reader.read_ranges([(0, reader.size)])
        return data

    # -- writing -------------------------------------------------------------------------------
    def create(self, path: str, *, mode: int = 0o444, large: bool = False):
        from reshard_job.storage.s3upload import MultipartUpload

        _, bucket, key = split_url(path)
        if not key:
            raise StorageError(f"{shorten(path)}: cannot write a bucket; give a key")
        return MultipartUpload(self, self._url(bucket, key), bucket, key, part_size=self.part_size)

    def write_bytes(self, path: str, data: bytes, *, mode: int = 0o444) -> tuple[int, str]:
        _, bucket, key = split_url(path)
        if not key:
            raise StorageError(f"{shorten(path)}: cannot write a bucket; give a key")
        body = bytes(data)
        self._appended.pop(self._url(bucket, key), None)
        self.call("put_object", self._url(bucket, key), "writing it", Bucket=bucket, Key=key, Body=body)
        return len(body), hashlib.sha256(body).hexdigest()

    def append(self, path: str, data: bytes) -> None:
        """Add `data` at the end of a small log object by writing the whole object again.

        An object cannot grow in place, and the journal's reader wants one object it can read in
        a single GET, so each append is one PUT of the old content plus `data`: atomic (a reader
        sees the object before or after, never a torn line) and durable once it returns. The
        content and ETag of our last append are remembered, so the next one needs no GET: it is a
        PUT conditional on that ETag where the store honours ``If-Match`` (else a HEAD compares
        it first), and the object is read again only when someone else wrote it since. Each
        append uploads the whole log: a line of about 250 bytes per target file, so 1000 target
        ranks upload about 125 MB in all, next to terabytes of checkpoints.
        """
        _, bucket, key = split_url(path)
        url = self._url(bucket, key)
        if not key:
            raise StorageError(f"{shorten(path)}: cannot write a bucket; give a key")
        conditional = self.conditional_put(bucket, posixpath.dirname(key), url)
        for _ in range(APPEND_ATTEMPTS):
            etag, known = self._appended.pop(url, (None, None))
            if known is not None and not conditional and self._etag_now(url) != etag:
                known = None  # written by someone else since our last append
            if known is None:
                etag, known = self._read_log(url)
            body = known + bytes(data)
            if len(body) > APPEND_MAX_BYTES:
                raise StorageError(f"{shorten(url)}: a log object may hold {APPEND_MAX_BYTES} bytes; appending "
                                   f"would make it {len(body)}")
            condition = ({"IfMatch": etag} if etag else {"IfNoneMatch": "*"}) if conditional else {}
            try:
                answer = self.call_raw("put_object", Bucket=bucket, Key=key, Body=body, **condition)
            except Exception as e:  # noqa: BLE001
                if conditional and (is_precondition_failed(e) or error_code(e) == "ConditionalRequestConflict"):
                    continue  # written by someone else between our read and our write: read it again
                raise storage_error(e, url, "appending to it", endpoint=self.endpoint, bucket=bucket) from None
            self._appended[url] = (answer.get("ETag", ""), body)
            return
        raise SourceChangedError(f"{shorten(url)}: kept changing while this job appended to it; is another job "
                                 "writing this output prefix?")

    def _read_log(self, url: str) -> tuple[str | None, bytes]:
        """(ETag, content) of a log object; (None, b"") when there is none yet."""
        try:
            with self.open_read(url) as reader:
                if reader.size > APPEND_MAX_BYTES:
                    raise StorageError(f"{shorten(url)}: {reader.size} bytes, more than a log object may hold "
                                       f"({APPEND_MAX_BYTES})")
                (data,) = reader.read_ranges([(0, reader.size)])
                return reader.etag, data
        except FileNotFoundError:
            return None, b""

    def _etag_now(self, url: str) -> str | None:
        found = self.info(url)
        return found.identity[1] if found is not None and found.is_file else None

    def remove(self, path: str) -> bool:
        _, bucket, key = split_url(path)
        url = self._url(bucket, key)
        self._appended.pop(url, None)
        found = self.info(path) if key else None
        if found is None or not found.is_file:
            return False
        self.call("delete_object", url, "deleting it", Bucket=bucket, Key=key)
        return True

    def makedirs(self, path: str) -> None:
        """Nothing to create: a folder exists as soon as a key below it does."""
        split_url(path)

    def remove_empty_folder(self, path: str) -> bool:
        """Nothing to remove: a folder is gone with the last key below it."""
        return False

    def remove_incomplete(self, folder: str, recursive_into: Iterable[str] = ()) -> int:
        """Abort the unfinished multipart uploads of killed writers directly in `folder` and in the
        named sub-folders, or those matching a glob pattern (uploads elsewhere under the prefix
        belong to no output of this job)."""
        _, bucket, key = split_url(folder)
        url = self._url(bucket, key)
        prefix = key + "/" if key else ""
        patterns = [d.strip("/") for d in recursive_into]
        removed = 0
        params: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
        while True:
            page = self.call("list_multipart_uploads", url, "listing its unfinished uploads", **params)
            for upload in page.get("Uploads") or ():
                upload_key = upload["Key"]
                if not _in_folders(posixpath.dirname(upload_key[len(prefix):]), patterns):
                    continue
                try:
                    self.call_raw("abort_multipart_upload", Bucket=bucket, Key=upload_key,
                                  UploadId=upload["UploadId"])
                    removed += 1
                except Exception as e:  # noqa: BLE001
                    if not (is_absent(e) or "NoSuchUpload" in str(e)):
                        raise storage_error(e, self._url(bucket, upload_key), "aborting an unfinished upload",
                                            endpoint=self.endpoint, bucket=bucket) from None
            if not page.get("IsTruncated"):
                break
            params["KeyMarker"] = page.get("NextKeyMarker", "")
            params["UploadIdMarker"] = page.get("NextUploadIdMarker", "")
        return removed

    # -- the output lock -----------------------------------------------------------------------
    def conditional_put(self, bucket: str, folder_key: str, folder_url: str) -> bool:
        """Whether this store honours ``If-None-Match: *`` (forced by `conditional_writes`, else probed)."""
        from reshard_job.storage.s3lock import supports_conditional_put

        if self.conditional_writes is not None:
            return self.conditional_writes
        if bucket not in self._conditional_by_bucket:
            self._conditional_by_bucket[bucket] = supports_conditional_put(self, bucket, folder_key, folder_url)
        return self._conditional_by_bucket[bucket]

    def held_by(self, folder: str) -> str | None:
        from reshard_job.storage.s3lock import holder_of

        _, bucket, key = split_url(folder)
        try:
            return holder_of(self, self._url(bucket, key), bucket, key)
        except Exception:  # noqa: BLE001 - a hint: the lock itself reports what is wrong
            return None

    def lock(self, folder: str, holder: str, *, lease_seconds: float | None = None):
        from reshard_job.storage.s3lock import acquire

        _, bucket, key = split_url(folder)
        return acquire(self, self._url(bucket, key), bucket, key, holder,
                       lease_seconds=lease_seconds if lease_seconds is not None else self.lease_seconds,
                       settle_seconds=self.settle_seconds)


def _in_folders(folder: str, patterns: list[str]) -> bool:
    """Whether a sub-folder ('' for the folder itself) is one of `patterns` (names or globs; a
    pattern's '*' does not cross a '/')."""
    if not folder:
        return True
    return any(folder.count("/") == p.count("/") and fnmatch.fnmatchcase(folder, p) for p in patterns)


def remote_storage(url: str, options) -> S3Storage:
    """The back end for `url` with `options` (``StorageOptions``); one per scheme and options, reused."""
    scheme = url.split("://", 1)[0].lower()
    if strip_userinfo(url) != url:
        # Credentials in a URL would end up in logs, manifests and lineage with the URL itself.
        raise StorageError(f"{shorten(strip_userinfo(url))}: the URL holds credentials (user:secret@); give them "
                           "in the environment, ~/.aws or storage.options instead")
    if scheme not in S3_SCHEMES:
        raise StorageError(f"{shorten(strip_userinfo(url))}: {scheme}:// is not supported "
                           f"(object stores are reached as s3://bucket/prefix)")
    return shared_store(options_key(scheme, options),
                        lambda: S3Storage(scheme, endpoint_url=options.endpoint_url, options=dict(options.options or {})))
