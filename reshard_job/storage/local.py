"""The local (and mounted) file system as a ``Storage``.

Sources are opened ``O_RDONLY | O_NONBLOCK`` and checked to be regular files before anything is
read: a FIFO would otherwise block the job forever on ``open`` and a character device never
ends. Outputs go through ``AtomicFile`` (temporary name, fsync, rename). The output lock is an
``fcntl`` lock on ``<folder>/.reshard_job/lock``, which the kernel drops when the holder dies.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import os
import re
import stat
from typing import Iterable

from reshard_job.storage.atomic import DIR_MODE, TMP_SUFFIX, AtomicFile, write_bytes_atomic
from reshard_job.storage.base import KIND_DIR, KIND_FILE, KIND_OTHER, FileInfo, LockedError, StorageError

STATE_DIR = ".reshard_job"
LOCK_FILE = "lock"
# AtomicFile's temporary names: ".<final name>.<12 hex digits>.tmp"
TEMP_NAME = re.compile(r"^\..+\.[0-9a-f]{12}" + re.escape(TMP_SUFFIX) + "$", re.S)


def identity_of(st: os.stat_result) -> tuple:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return KIND_FILE
    if stat.S_ISDIR(mode):
        return KIND_DIR
    return KIND_OTHER


def describe_other(mode: int) -> str:
    """What a file system entry that is not a regular file (nor a folder) is, for messages."""
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _os_error(path: str, e: OSError, doing: str) -> StorageError:
    if isinstance(e, PermissionError):
        return StorageError(f"{path}: permission denied ({doing})")
    return StorageError(f"{path}: cannot {doing} ({e.strerror or e})")


def _regular_lock(fd: int, path: str) -> None:
    """A lock file that is a FIFO or a device (opened without waiting) is refused: StorageError."""
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        raise StorageError(f"{path}: is not a regular file (a FIFO or device named like the job's lock); remove it")


class LocalFile:
    """A regular file opened read-only for positioned reads (``RandomAccess``)."""

    def __init__(self, path: str):
        self.path = path
        flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
        try:
            # O_RDONLY: sources are never opened for writing. O_NONBLOCK: a FIFO does not block open.
            fd = os.open(path, flags)
        except FileNotFoundError:
            raise
        except IsADirectoryError:
            raise StorageError(f"{path}: is a directory, expected a file") from None
        except OSError as e:
            raise _os_error(path, e, "open for reading") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            what = "a directory" if stat.S_ISDIR(st.st_mode) else describe_other(st.st_mode)
            raise StorageError(f"{path}: is {what}, expected a regular file")
        self._fd: int | None = fd
        self.size = st.st_size
        self.identity = identity_of(st)

    def fileno(self) -> int:
        if self._fd is None:
            raise ValueError(f"{self.path}: file is closed")
        return self._fd

    def pread_into(self, offset: int, view: memoryview) -> int:
        fd = self.fileno()
        done, total = 0, len(view)
        while done < total:
            try:
                n = os.preadv(fd, [view[done:]], offset + done)
            except OSError as e:
                raise _os_error(self.path, e, "read") from None
            if n <= 0:
                break
            done += n
        return done

    def read_ranges(self, ranges: list[tuple[int, int]]) -> list[bytes]:
        out = []
        for offset, length in ranges:
            buf = bytearray(length)
            n = self.pread_into(offset, memoryview(buf))
            out.append(bytes(buf[:n]))
        return out

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class FcntlLock:
    """``OutputLock`` held through an open descriptor; the kernel releases it when the process dies."""

    def __init__(self, fd: int):
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            finally:
                os.close(self._fd)
                self._fd = None


class LocalStorage:
    """``Storage`` over the local file system; paths are absolute local paths."""

    scheme = "file"

    # -- naming ------------------------------------------------------------------------------
    def join(self, base: str, *parts: str) -> str:
        return os.path.join(base, *parts)

    def parent(self, path: str) -> str:
        return os.path.dirname(path.rstrip(os.sep)) or os.sep

    def basename(self, path: str) -> str:
        return os.path.basename(path.rstrip(os.sep))

    def display(self, path: str) -> str:
        return path

    # -- looking -----------------------------------------------------------------------------
    def info(self, path: str) -> FileInfo | None:
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            raise _os_error(path, e, "look at it") from None
        return FileInfo(path, self.basename(path), _kind(st.st_mode), st.st_size, identity_of(st))

    def listdir(self, path: str) -> list[FileInfo]:
        out = []
        try:
            with os.scandir(path) as it:
                for entry in it:
                    try:
                        st = entry.stat()  # follows symbolic links, as the job reads through them
                    except OSError:
                        out.append(FileInfo(entry.path, entry.name, KIND_OTHER))
                        continue
                    out.append(FileInfo(entry.path, entry.name, _kind(st.st_mode), st.st_size, identity_of(st)))
        except NotADirectoryError:
            raise StorageError(f"{path}: is not a directory") from None
        except FileNotFoundError:
            raise
        except OSError as e:
            raise _os_error(path, e, "list it") from None
        return sorted(out, key=lambda i: i.name)

    # -- reading -----------------------------------------------------------------------------
    def open_read(self, path: str) -> LocalFile:
        return LocalFile(path)

    def read_bytes(self, path: str, limit: int) -> bytes:
        with LocalFile(path) as f:
            if f.size > limit:
                raise StorageError(f"{path}: {f.size} bytes, more than the {limit} bytes such a file may have")
            parts, at = [], 0
            while at < f.size:  # straight into bytes objects: a file the size of the limit is held once
                try:
                    part = os.pread(f.fileno(), f.size - at, at)
                except OSError as e:
                    raise _os_error(path, e, "read") from None
                if not part:
                    break
                parts.append(part)
                at += len(part)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    # -- writing -----------------------------------------------------------------------------
    def create(self, path: str, *, mode: int = 0o444, large: bool = False) -> AtomicFile:
        return AtomicFile(path, mode=mode, direct=large)

    def write_bytes(self, path: str, data: bytes, *, mode: int = 0o444) -> tuple[int, str]:
        return write_bytes_atomic(path, data, mode=mode)

    def append(self, path: str, data: bytes) -> None:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
        try:
            fd = os.open(path, flags, 0o644)
        except OSError as e:
            raise _os_error(path, e, "open for appending") from None
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except OSError as e:
            raise _os_error(path, e, "append to it") from None
        finally:
            os.close(fd)

    def remove(self, path: str) -> bool:
        try:
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False

    def remove_empty_folder(self, path: str) -> bool:
        try:
            os.rmdir(path)  # (refuses a folder that holds anything, and a link)
            return True
        except OSError:
            return False

    def makedirs(self, path: str) -> None:
        try:
            os.makedirs(path, mode=DIR_MODE, exist_ok=True)
        except OSError as e:
            raise _os_error(path, e, "create it") from None

    def remove_incomplete(self, folder: str, recursive_into: Iterable[str] = ()) -> int:
        """Delete temporary files of killed writers: only names of the exact form ``AtomicFile``
        creates, never a user's own ``.notes.tmp``, and never through a symbolic link."""
        removed = 0
        dirs = [folder]
        for d in recursive_into:
            if glob.has_magic(d):  # matching folders, not links to folders elsewhere
                dirs += [p for p in sorted(glob.glob(os.path.join(glob.escape(folder), d)))
                         if os.path.isdir(p) and not os.path.islink(p)]
            else:
                dirs.append(os.path.join(folder, d))
        base = os.path.realpath(folder)
        for d in dirs:
            if os.path.realpath(d) != os.path.normpath(os.path.join(base, os.path.relpath(d, folder))):
                continue  # a symbolic link on the way: what it points to is not this folder's to clean
            try:
                names = os.listdir(d)
            except OSError:
                continue
            for name in names:
                full = os.path.join(d, name)
                if TEMP_NAME.match(name) and os.path.isfile(full) and not os.path.islink(full):
                    try:
                        os.unlink(full)
                        removed += 1
                    except OSError:
                        pass
        return removed

    def held_by(self, folder: str) -> str | None:
        path = os.path.join(folder, STATE_DIR, LOCK_FILE)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            return None  # no lock file: never locked
        try:
            _regular_lock(fd, path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    return os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "unknown process"
                return None
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        except OSError:
            return None
        finally:
            os.close(fd)

    def lock(self, folder: str, holder: str) -> FcntlLock:
        state = os.path.join(folder, STATE_DIR)
        self.makedirs(state)
        path = os.path.join(state, LOCK_FILE)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
                         | getattr(os, "O_NOFOLLOW", 0), 0o644)
        except OSError as e:
            raise _os_error(path, e, "create the lock file") from None
        try:
            _regular_lock(fd, path)
        except StorageError:
            os.close(fd)
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            current = ""
            try:
                current = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
            except OSError:
                pass
            os.close(fd)
            if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise LockedError(folder, current or "unknown process") from None
            raise _os_error(folder, e, "lock it") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, (holder + "\n").encode(), 0)
        return FcntlLock(fd)

