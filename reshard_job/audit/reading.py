"""How lineage reads the files it is asked about: a content digest, a size, a small text file.

``audit trace`` and ``audit verify`` must look at the bytes as they are now, never at a cache,
so they read through these few functions and nothing else. A reference may be a local path or an
object-store URL (``s3://bucket/run7/ckpt_4cards/rank_0/checkpoint_0.ckpt``): both are read
through ``reshard_job.storage``, objects with ranged GETs, and a store is reached through the
standard chain (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``~/.aws``); where the environment
names no endpoint, the one the run recorded (``reaching``): a run's config keeps its endpoint,
never its credentials. The digest is the job's own
(``reshard_job.sources.file_digests``), so the audit and the job cannot disagree about what a file's sha256 is.

The audit's callers speak ``OSError``, as ``open`` does, so a store's failures reach them as
such: a missing key is ``FileNotFoundError``, a key prefix read as a file ``IsADirectoryError``,
anything else (no permission, unreachable endpoint) an ``OSError`` carrying the store's one-line
message. Paths are made comparable with what the job recorded by ``absolute`` (local paths made
absolute; URLs without credentials or a trailing slash, as the job records them).
"""

from __future__ import annotations

import errno
import json
import os
import posixpath
import stat
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator, TypeVar

from reshard_job.sources.file_digests import digest_file
from reshard_job.storage import StorageError, StorageOptions, is_url
from reshard_job.storage import storage_for as _storage_for

# How URLs are reached while the audit answers one question (``reaching``); None: the standard chain.
_REACH: ContextVar[StorageOptions | None] = ContextVar("audit_reach", default=None)
ENDPOINT_VARIABLES = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")


def environment_names_an_endpoint() -> bool:
    return any(os.environ.get(name) for name in ENDPOINT_VARIABLES)


@contextmanager
def reaching(endpoint_url: str | None) -> Iterator[None]:
    """Within the block, reach object stores at `endpoint_url` (the one a run recorded), unless the
    environment names an endpoint itself; credentials always come from the environment."""
    if not endpoint_url or environment_names_an_endpoint():
        yield
        return
    token = _REACH.set(StorageOptions(endpoint_url=endpoint_url))
    try:
        yield
    finally:
        _REACH.reset(token)


def storage_for(path: str):
    return _storage_for(path, _REACH.get())

# A manifest lists every output with its digest: tens of kilobytes for thousands of ranks.
MAX_SMALL_FILE = 64 * 1024 * 1024

T = TypeVar("T")


def absolute(path: str) -> str:
    """`path` as the job records it: an absolute local path, or a URL without credentials or trailing '/'."""
    if is_url(path):
        from reshard_job.storage.s3errors import strip_userinfo

        url = strip_userinfo(path)
        head, sep, rest = url.partition("://")
        return f"{head.lower()}{sep}{rest.rstrip('/')}"
    return os.path.abspath(path)


def path_forms(path: str) -> set[str]:
    """Every form under which the job may have recorded `path` (a local path also through its links)."""
    if is_url(path):
        return {absolute(path)}
    return {os.path.abspath(path), os.path.realpath(path)}


def join(directory: str, *names: str) -> str:
    if is_url(directory):
        return "/".join([absolute(directory), *(n.strip("/") for n in names if n.strip("/"))])
    return os.path.join(directory, *names)


def dirname(path: str) -> str:
    return posixpath.dirname(absolute(path)) if is_url(path) else os.path.dirname(path)


def relative_to(path: str, start: str) -> str | None:
    """`path` relative to the folder `start`, or None when it does not lie below it."""
    if is_url(path) or is_url(start):
        path, start = absolute(path), absolute(start)
        return path[len(start) + 1:] if path.startswith(start + "/") else None
    relative = os.path.relpath(path, start)
    return None if relative.startswith(os.pardir + os.sep) or os.path.isabs(relative) else relative


def _as_os_error(path: str, action: Callable[[], T]) -> T:
    """Run a storage call, turning the store's one-line errors into ``OSError`` for the callers."""
    try:
        return action()
    except (FileNotFoundError, IsADirectoryError):
        raise
    except StorageError as exc:
        text = str(exc)
        if "is a folder" in text:
            raise IsADirectoryError(errno.EISDIR, "is a directory (key prefix)", path) from None
        prefix = f"{absolute(path)}: "
        raise OSError(errno.EIO, text[len(prefix):] if text.startswith(prefix) else text, path) from None


def content_digest(path: str) -> tuple[str, int]:
    """``(sha256 hex, size in bytes)`` of the file or object at `path`, read in full now.

    Raises ``OSError`` (``FileNotFoundError``, ``IsADirectoryError``, ...) as ``open`` does.
    """
    digest = _as_os_error(path, lambda: digest_file(absolute(path), storage_options=_REACH.get()))
    return digest.sha256, digest.size


def file_size(path: str) -> int:
    """The size of the file at `path`; ``OSError`` if it cannot be seen."""
    if not is_url(path):
        st = os.stat(path)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "is a directory", path)
        return st.st_size
    info = _as_os_error(path, lambda: storage_for(path).info(absolute(path)))
    if info is None:
        raise FileNotFoundError(errno.ENOENT, "no such object", path)
    if info.is_dir:
        raise IsADirectoryError(errno.EISDIR, "is a directory (key prefix)", path)
    return info.size


def exists(path: str) -> bool:
    if not is_url(path):
        return os.path.exists(path)
    return _remote_info(path) is not None


def is_directory(path: str) -> bool:
    if not is_url(path):
        return os.path.isdir(path)
    info = _remote_info(path)
    return info is not None and info.is_dir


def _remote_info(path: str):
    """What a URL names, or None when nothing is there or the store cannot say (the caller then
    goes on to what the database recorded at that URL)."""
    try:
        return storage_for(path).info(absolute(path))
    except (StorageError, OSError):
        return None


def json_document(data: bytes):
    """``json.loads`` of a manifest's bytes: one nested deeper than the interpreter can follow is a
    ``ValueError`` like any other malformed document (not a ``RecursionError`` traceback)."""
    try:
        return json.loads(data.decode("utf-8"))
    except RecursionError:
        raise ValueError("nested too deeply to be a manifest") from None


def read_small_file(path: str) -> bytes:
    """The whole content of a small file (a manifest); ``OSError`` if unreadable, too large, or
    not a regular file (a FIFO in a manifest's place would block its read for ever)."""
    return _as_os_error(path, lambda: storage_for(path).read_bytes(absolute(path), MAX_SMALL_FILE))
