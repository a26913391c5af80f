"""Where checkpoints live: the storage interface and the back end for a path.

``storage_for(path)`` returns the back end that serves `path`: the local file system for plain
paths, an fsspec-based one for URLs such as ``s3://bucket/prefix`` (installed with the ``[s3]``
extra). Everything above this package (formats, execution, the job) reads and writes through
the returned ``Storage`` only; the job's own local bookkeeping (caches, lock files, the lineage
database's folder, a graph or plan file) goes through ``cache_files``, ``local_files`` and
``atomic``. No file is written outside this package.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from reshard_job.storage.base import (KIND_DIR, KIND_FILE, KIND_OTHER, AtomicWriter, FileInfo, LockedError,
                                      OutputLock, RandomAccess, SourceChangedError, Storage, StorageError)
from reshard_job.storage.local import LocalStorage

__all__ = [
    "AtomicWriter", "FileInfo", "KIND_DIR", "KIND_FILE", "KIND_OTHER", "LocalStorage", "LockedError", "OutputLock",
    "RandomAccess", "SourceChangedError", "Storage", "StorageError", "StorageOptions", "absolute", "is_url", "storage_for",
    "LOCAL",
]

LOCAL = LocalStorage()


@dataclass(frozen=True)
class StorageOptions:
    """How to reach remote stores (``storage.*`` in the job's config).

    Credentials normally come from the standard chain (environment, ``~/.aws``); whatever is
    given here is used to connect and is never written down (see ``job.secrets``).
    """

    endpoint_url: str | None = None
    options: dict[str, Any] = field(default_factory=dict, repr=False)  # may hold keys: never printed

    def __repr__(self) -> str:
        from reshard_job.secrets import mask_url

        shown = None if self.endpoint_url is None else mask_url(self.endpoint_url)
        return f"StorageOptions(endpoint_url={shown!r}, options=<{len(self.options)} key(s)>)"


def is_url(path: str | os.PathLike) -> bool:
    """Whether `path` names a remote location (``scheme://...``) rather than a local path."""
    text = os.fspath(path)
    head, sep, _ = text.partition("://")
    return bool(sep) and head.isascii() and head.replace("+", "").replace("-", "").isalnum() and head != "file"


def absolute(path: str | os.PathLike, base: str | None = None) -> str:
    """A URL without a trailing slash (``s3://b/run7/`` and ``s3://b/run7`` name one prefix); a local
    path with ``~`` expanded, made absolute (against `base` if given)."""
    text = os.fspath(path)
    if is_url(text):
        head, sep, rest = text.partition("://")
        return f"{head}{sep}{rest.rstrip('/')}" if rest.strip("/") else text
    if text.startswith("file://"):
        text = text[len("file://"):]
    text = os.path.expanduser(text)
    if not os.path.isabs(text):
        text = os.path.join(base or os.getcwd(), text)
    return os.path.normpath(text)


def storage_for(path: str | os.PathLike, options: StorageOptions | None = None) -> Storage:
    """The back end that serves `path` (a local path, ``file://...`` or a URL)."""
    if not is_url(path):
        return LOCAL
    from reshard_job.storage.remote import remote_storage  # fsspec is imported only when a URL is used

    return remote_storage(os.fspath(path), options or StorageOptions())
