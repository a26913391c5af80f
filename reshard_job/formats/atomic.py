"""Atomic file creation: write under a temporary name, fsync, rename into place.

A reader (or a crash) never sees a half-written file under its final name: either the old state or
the complete new file. The temporary name starts with a dot and ends in ``.tmp`` in the same
directory (a rename is only atomic within one file system), so a resumed job can recognise and
remove leftovers of a killed run. The file's sha256 is computed from the bytes as they are written,
so hashing an output costs no second read.
"""

from __future__ import annotations

import errno
import hashlib
import os
import uuid

from ..errors import OutputError

TMP_SUFFIX = ".tmp"


def temp_name_for(path: str) -> str:
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.{uuid.uuid4().hex[:12]}{TMP_SUFFIX}")


def is_temp_name(filename: str) -> bool:
    return filename.startswith(".") and filename.endswith(TMP_SUFFIX)


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class AtomicFile:
    """A binary file that appears under `path` only on ``commit``; hashes what is written."""

    def __init__(self, path: str | os.PathLike, *, mode: int = 0o444, overwrite: bool = True,
                 hash_name: str = "sha256", fsync: bool = True):
        self.path = os.path.abspath(os.fspath(path))
        self.mode = mode
        self.overwrite = overwrite
        self.fsync = fsync
        self.size = 0
        self._hash = hashlib.new(hash_name)
        parent = os.path.dirname(self.path)
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as e:
            raise OutputError(f"{parent}: cannot create output directory ({e.strerror})") from None
        if not overwrite and os.path.exists(self.path):
            raise OutputError(f"{self.path}: already exists and overwriting is off")
        self.tmp_path = temp_name_for(self.path)
        try:
            fd = os.open(self.tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
        except OSError as e:
            raise OutputError(f"{parent}: cannot write here ({e.strerror})") from None
        self._f = os.fdopen(fd, "wb", buffering=1024 * 1024)
        self._done = False

    def write(self, data) -> None:
        try:
            self._f.write(data)
        except OSError as e:
            self.abort()
            raise _write_error(self.path, e) from None
        self._hash.update(data)
        self.size += memoryview(data).nbytes

    def commit(self) -> tuple[int, str]:
        """Flush, fsync, rename into place; return (size, hex digest)."""
        if self._done:
            raise RuntimeError(f"{self.path}: already committed or aborted")
        try:
            self._f.flush()
            if self.fsync:
                os.fsync(self._f.fileno())
            self._f.close()
            os.chmod(self.tmp_path, self.mode)
            if os.path.isdir(self.path):
                raise IsADirectoryError(errno.EISDIR, "a directory is in the way", self.path)
            os.replace(self.tmp_path, self.path)
        except OSError as e:
            self.abort()
            raise _write_error(self.path, e) from None
        self._done = True
        if self.fsync:
            fsync_dir(os.path.dirname(self.path))
        return self.size, self._hash.hexdigest()

    def abort(self) -> None:
        """Drop the temporary file; the final name is left as it was."""
        if self._done:
            return
        self._done = True
        try:
            self._f.close()
        except OSError:
            pass
        try:
            os.unlink(self.tmp_path)
        except FileNotFoundError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.result = self.commit()
        else:
            self.abort()
        return False


def _write_error(path: str, e: OSError) -> OutputError:
    if e.errno == errno.ENOSPC:
        return OutputError(f"{path}: no space left on device while writing; the partial file was removed")
    if e.errno == errno.EDQUOT:
        return OutputError(f"{path}: disk quota exceeded while writing; the partial file was removed")
    return OutputError(f"{path}: write failed ({e.strerror or e}); the partial file was removed")


def write_bytes_atomic(path: str | os.PathLike, data: bytes, *, mode: int = 0o444) -> tuple[int, str]:
    with AtomicFile(path, mode=mode) as f:
        f.write(data)
    return f.result
