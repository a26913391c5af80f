"""The storage interface: the only way the job touches files or objects.

Everything the job reads or writes goes through a ``Storage``: listing a folder, asking what a
path is, positioned reads of a source file, small whole-file reads (strategy files, manifests,
journal entries), atomic "write then publish" of outputs, removal, and the output-directory
lock. The local file system (``storage.local``) is one back end; object stores reached through
fsspec (``s3://`` for OBS, MinIO, S3, SeaweedFS) are another. ``formats/`` and ``execute.py``
never open a path themselves, so a new back end plugs in here without touching them.

Paths are plain strings: an absolute local path, or a URL (``s3://bucket/key``) for remote
back ends. A back end accepts only its own kind; ``storage.storage_for`` picks the back end
for a path. Folders of an object store are key prefixes: ``s3://b/run7/ckpt`` "is a folder"
when keys exist below it, and ``makedirs`` does nothing there.

Errors a back end raises: ``StorageError`` (a ``ReshardError``: one line naming the path and
what went wrong, e.g. permission denied, bucket missing, endpoint unreachable), or
``FileNotFoundError`` where the interface says "absent" is an ordinary answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol, runtime_checkable

from reshard_job.errors import ReshardError

KIND_FILE = "file"
KIND_DIR = "dir"
KIND_OTHER = "other"  # FIFOs, sockets, devices: never read, never written


class StorageError(ReshardError):
    """A path cannot be used: permission denied, not a regular file, bucket missing, unreachable."""


class LockedError(StorageError):
    """Another job holds the output folder's lock."""

    def __init__(self, folder: str, holder: str):
        self.folder = folder
        self.holder = holder
        super().__init__(f"{folder} is locked by another job ({holder})")


class SourceChangedError(StorageError):
    """A source file or object changed while the job was using it (identity differs)."""


@dataclass(frozen=True)
class FileInfo:
    """What a path is, as far as the job cares.

    `identity` changes whenever the content may have changed: locally (device, inode, size,
    modification and change time in ns), remotely (size, ETag, version id or last-modified).
    Equal identities mean the bytes are the ones seen before; that is what digest caches and
    "changed while the job ran" checks rely on.
    """

    path: str
    name: str  # last path component
    kind: str  # KIND_FILE | KIND_DIR | KIND_OTHER
    size: int = 0
    identity: tuple = ()

    @property
    def is_file(self) -> bool:
        return self.kind == KIND_FILE

    @property
    def is_dir(self) -> bool:
        return self.kind == KIND_DIR


@runtime_checkable
class RandomAccess(Protocol):
    """A source file opened read-only for positioned reads.

    Opening refuses anything but a regular file (a FIFO would block forever, a device never
    ends). `size` and `identity` are those seen at open time.

    A back end may set ``index_window``: how many bytes a format reader walking record headers
    should ask for at once. Readers default to a few MiB, right for local files (extra bytes come
    from the page cache); an object store sets it small, since every byte asked for crosses the
    network, and record data skipped by length should never be fetched.
    """

    path: str
    size: int
    identity: tuple

    def pread_into(self, offset: int, view: memoryview) -> int:
        """Fill as much of `view` as the file holds from `offset`; return the bytes read.

        Fewer than ``len(view)`` only at the end of the file: callers decide whether a short
        read is a truncated file.
        """

    def read_ranges(self, ranges: list[tuple[int, int]]) -> list[bytes]:
        """Several (offset, length) ranges at once. Remote back ends coalesce neighbouring ranges
        into few large requests and keep several in flight; locally this is a loop of preads."""

    def close(self) -> None: ...


@runtime_checkable
class AtomicWriter(Protocol):
    """An output that becomes visible under its final path only on ``commit``.

    Bytes are hashed (sha256) as they are written, so committing returns the file's digest
    without reading it back. ``abort`` (or a crash) leaves nothing under the final path; what a
    crash leaves elsewhere (a temporary file, an unfinished multipart upload) is recognisable
    and removed by ``Storage.remove_incomplete``.
    """

    path: str
    size: int  # bytes written so far

    def write(self, data) -> None: ...

    def commit(self) -> tuple[int, str]:
        """Make the file durable and visible under `path`; return (size, sha256 hex)."""

    def abort(self) -> None: ...

    @property
    def can_rewrite(self) -> bool:
        """Whether ``rewrite_at`` works (local buffered files: yes; multipart uploads: no)."""

    def rewrite_at(self, offset: int, data: bytes) -> None:
        """Overwrite bytes already written (the running hash does not cover the change)."""


def write_hashed(writer: AtomicWriter, data, hasher) -> None:
    """Write `data` and feed it to `hasher` too (a tensor's own digest beside the file's).

    A writer with a ``write_hashed`` of its own may feed `hasher` later, from the thread that hashes
    the file, but always in write order and before its ``commit`` returns: read the hasher only
    after committing. Elsewhere the bytes are hashed here, at once.
    """
    own = getattr(writer, "write_hashed", None)
    if own is not None:
        own(data, hasher)
        return
    hasher.update(data)
    writer.write(data)


class TeeHasher:
    """A hasher that feeds a second consumer too (anything with ``update``: a tensor's fingerprint
    beside its sha256), so that both see the same bytes in the same thread and order."""

    __slots__ = ("hasher", "also")

    def __init__(self, hasher, also):
        self.hasher, self.also = hasher, also

    def update(self, data) -> None:
        self.hasher.update(data)
        self.also.update(data)

    def digest(self) -> bytes:
        return self.hasher.digest()

    def hexdigest(self) -> str:
        return self.hasher.hexdigest()


@runtime_checkable
class OutputLock(Protocol):
    """Held while a job writes an output directory; released by ``release`` or by the holder's death."""

    def release(self) -> None: ...


class Storage(Protocol):
    """One place where checkpoints live (see the module docstring)."""

    #: "file" for the local back end, else the URL scheme ("s3", ...)
    scheme: str

    # -- naming ------------------------------------------------------------------------------
    def join(self, base: str, *parts: str) -> str: ...

    def parent(self, path: str) -> str: ...

    def basename(self, path: str) -> str: ...

    def display(self, path: str) -> str:
        """The path as it may appear in messages, manifests and lineage (never a credential)."""

    # -- looking -----------------------------------------------------------------------------
    def info(self, path: str) -> FileInfo | None:
        """What `path` is, or None when nothing is there."""

    def listdir(self, path: str) -> list[FileInfo]:
        """The entries directly inside a folder, sorted by name; StorageError if it is not one."""

    # -- reading -----------------------------------------------------------------------------
    def open_read(self, path: str) -> RandomAccess:
        """Open a regular file for positioned reads (FileNotFoundError when absent)."""

    def read_bytes(self, path: str, limit: int) -> bytes:
        """A small whole file (strategy, manifest, journal entry); StorageError when larger than
        `limit` bytes or not a regular file, FileNotFoundError when absent."""

    # -- writing -----------------------------------------------------------------------------
    def create(self, path: str, *, mode: int = 0o444, large: bool = False) -> AtomicWriter:
        """Start writing `path` atomically. `large` hints at a checkpoint-sized file (the local
        back end then writes with O_DIRECT; remote ones use multipart uploads)."""

    def write_bytes(self, path: str, data: bytes, *, mode: int = 0o444) -> tuple[int, str]:
        """Atomically replace `path` with `data`; return (size, sha256 hex)."""

    def append(self, path: str, data: bytes) -> None:
        """Durably add `data` at the end of a small log file, creating it if needed (the resume
        journal). Locally an O_APPEND write and fsync; object stores rewrite the object."""

    def remove(self, path: str) -> bool:
        """Delete one file; False if it was not there."""

    def makedirs(self, path: str) -> None: ...

    def remove_empty_folder(self, path: str) -> bool:
        """Delete a folder if it is empty (a rank folder whose file an overwrite removed); False
        if it holds anything or is not there. Object stores have no empty folders: False."""

    def remove_incomplete(self, folder: str, recursive_into: Iterable[str] = ()) -> int:
        """Remove what interrupted writers left directly in `folder` and in its sub-folders named
        in `recursive_into` (temporary files; unfinished multipart uploads); return how many.

        A name may be a glob pattern (``rank_*``): on an object store, a folder whose only
        content is an unfinished upload does not exist in listings, so it cannot be named."""

    def lock(self, folder: str, holder: str) -> OutputLock:
        """Take the one-writer lock of an output folder; StorageError naming the current holder
        when another job has it. `holder` (host and pid) is stored for that message."""

    def held_by(self, folder: str) -> str | None:
        """Who holds the output folder's lock now (as ``LockedError`` names them), without taking it
        or writing anything; None when nobody does or it cannot be told. A hint only: a job asks
        before its long reads, and still takes the lock before it writes."""
