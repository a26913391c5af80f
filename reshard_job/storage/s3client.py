"""The s3fs client of one process: how it is configured, shared, and kept safe across ``fork``.

botocore retries throttling, 5xx answers and dropped connections with exponential back-off
(``standard`` mode, 5 attempts in all; ``storage.options.config_kwargs.retries`` changes either),
and a request that still fails becomes one ``StorageError`` line (``s3errors``).

Every request is bounded in time three ways (``storage.options.config_kwargs`` sets each):
``connect_timeout`` (10 s) to connect, ``read_timeout`` (30 s) of silence while waiting for an
answer or between its bytes, and ``operation_timeout`` (60 s; ours, not botocore's) for the whole
operation with its retries and back-off, plus one second per MiB it sends or fetches. An endpoint
that accepts connections and never answers therefore ends the job after ``operation_timeout``, not
after attempts × read timeouts; and once one operation went unanswered, the store's next ones
within that time fail at once (``Watchdog``) instead of waiting again one after the other.

s3fs objects are not fork-safe (their event loop thread does not survive ``fork``), and the job
forks its workers; each process therefore builds its own client on first use. The parent's
client must not even be closed in a child: its sockets and its event loop's epoll instance are
shared with the parent, and closing them there unregisters the parent's connections from the
parent's epoll, which then waits for answers it is never told about until the read timeout. A
child therefore keeps the client it inherited untouched for its whole life (``_after_fork``).

One ``S3Storage`` serves every URL of a scheme and set of options (``shared_store``): its client,
connection pool and event loop are built once per process, not once per file.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import threading
import time
import weakref
from typing import Any, Callable

from reshard_job.storage.base import StorageError
from reshard_job.storage.s3errors import StoreTimeout

DEFAULT_RETRIES = {"total_max_attempts": 5, "mode": "standard"}  # botocore's max_attempts counts retries only
CONNECT_TIMEOUT_SECONDS = 10
READ_TIMEOUT_SECONDS = 30
OPERATION_TIMEOUT_KEY = "operation_timeout"  # in storage.options.config_kwargs, taken out before botocore sees it
OPERATION_TIMEOUT_SECONDS = 60.0
SECONDS_PER_BYTE = 1 / (1 << 20)  # what an operation moving data gets beyond operation_timeout: 1 s per MiB


def make_s3fs(scheme: str, endpoint_url: str | None, options: dict[str, Any]):
    """A new s3fs file system for `options` (``storage.options``), with our retries, timeouts and checksums."""
    try:
        import s3fs
    except ImportError:
        raise StorageError(f"{scheme}:// paths need the s3 extra: pip install 'reshard_job[s3]'") from None
    kwargs = dict(options)
    if endpoint_url:
        kwargs["endpoint_url"] = endpoint_url
    config = dict(kwargs.pop("config_kwargs", None) or {})
    config.pop(OPERATION_TIMEOUT_KEY, None)
    config["retries"] = _retries(config.get("retries"))
    config.setdefault("connect_timeout", CONNECT_TIMEOUT_SECONDS)
    config.setdefault("read_timeout", READ_TIMEOUT_SECONDS)
    # Keep botocore's optional CRC32 request checksums off where not required: several
    # S3-compatible stores reject the trailing-checksum encoding they imply.
    config.setdefault("request_checksum_calculation", "when_required")
    config.setdefault("response_checksum_validation", "when_required")
    kwargs.update(config_kwargs=config, skip_instance_cache=True, use_listings_cache=False)
    _quiet_client_logs()
    try:
        return s3fs.S3FileSystem(**kwargs)
    except TypeError as e:
        raise StorageError(f"storage.options: not accepted by s3fs ({e})") from None


def operation_timeout(options: dict[str, Any]) -> float:
    """``storage.options.config_kwargs.operation_timeout`` (seconds), checked; the default without it."""
    given = (options.get("config_kwargs") or {}).get(OPERATION_TIMEOUT_KEY, OPERATION_TIMEOUT_SECONDS)
    try:
        seconds = float(given)
    except (TypeError, ValueError):
        seconds = math.nan
    if not (0 < seconds < math.inf) or isinstance(given, bool):
        raise StorageError(f"storage.options.config_kwargs.{OPERATION_TIMEOUT_KEY} must be a positive number of "
                           f"seconds; got {given!r}")
    return seconds


class Watchdog:
    """The time limit of one store's operations, and what an unanswered one means for the next.

    ``limit(nbytes)`` is how long an operation moving `nbytes` may take, retries included. After one
    went unanswered (``missed``), every operation started within that limit is refused at once
    (``check``): the job is failing on the first, and the calls that clean up or report after it
    must not each wait as long again."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self._missed_at: float | None = None

    def limit(self, nbytes: int = 0) -> float:
        return self.seconds + max(0, nbytes) * SECONDS_PER_BYTE

    def check(self) -> None:
        missed = self._missed_at
        if missed is not None and time.monotonic() - missed < self.seconds:
            raise StoreTimeout(self.seconds, earlier=True)

    def missed(self, seconds: float) -> StoreTimeout:
        self._missed_at = time.monotonic()
        return StoreTimeout(seconds)


def _retries(given) -> dict:
    """botocore's retry settings: the user's, completed with ours (a count given as botocore's
    ``max_attempts``, retries after the first, replaces our total)."""
    given = dict(given or {})
    defaults = dict(DEFAULT_RETRIES)
    if "max_attempts" in given:
        defaults.pop("total_max_attempts")
    return {**defaults, **given}


# botocore says at INFO where it found credentials and the endpoint, once per process: in a job
# with many workers that is noise on every run, so only their warnings are shown.
CHATTY_LOGGERS = ("aiobotocore.credentials", "botocore.credentials", "botocore.configprovider")


def _quiet_client_logs() -> None:
    for name in CHATTY_LOGGERS:
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.WARNING)


_STORES: dict[tuple, Any] = {}
_STORES_LOCK = threading.Lock()
_ALL_STORES: "weakref.WeakSet[Any]" = weakref.WeakSet()
_INHERITED_CLIENTS: list = []  # a forked child's copies of its parent's clients, never closed


def track_store(store) -> None:
    """Have a forked child set `store`'s client aside (see ``_after_fork``)."""
    _ALL_STORES.add(store)


def _after_fork() -> None:
    """In a forked child: set the parent's clients aside, alive and with their finalizers detached.

    Collecting one would run s3fs's finaliser, which closes its connections through the parent's
    event loop, unregistering the parent's sockets from the epoll instance both processes share
    (see the module docstring). Locks held by the parent's threads at the fork are replaced.
    """
    global _STORES_LOCK
    _STORES_LOCK = threading.Lock()
    inherited = []
    for store in list(_ALL_STORES):
        store._fs_lock = threading.Lock()
        if store._fs is not None and store._fs_pid != os.getpid():
            inherited.append(store._fs)
            store._fs = None
    if not inherited:
        return
    _INHERITED_CLIENTS.extend(inherited)
    ids = {id(fs) for fs in inherited}
    for finalizer, info in list(getattr(weakref.finalize, "_registry", {}).items()):
        if id(info.weakref()) in ids:
            finalizer.detach()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def options_key(scheme: str, options) -> tuple:
    """The cache key of a scheme and ``StorageOptions``."""
    # A digest, not the options themselves: the cache key must not keep credentials readable.
    text = repr((scheme, options.endpoint_url, sorted((str(k), repr(v)) for k, v in (options.options or {}).items())))
    return (scheme, hashlib.sha256(text.encode()).hexdigest())


def shared_store(key: tuple, build: Callable[[], Any]):
    """The store kept under `key` (``options_key``), built by `build` the first time."""
    with _STORES_LOCK:
        store = _STORES.get(key)
        if store is None:
            store = _STORES[key] = build()
        return store
