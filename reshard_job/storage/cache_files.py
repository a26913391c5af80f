"""Files of the user's private cache folder: replaced whole, marked when used, the oldest removed.

A cache (the source digests, the source index documents) only ever saves time, so its files are
written with the cheapest strategy that still never shows a torn file, and no failure to write,
mark or remove one is ever the job's failure:

- **Rename of a per-process temporary file** (``write_cache_file``): the bytes go to
  ``<name>.<pid>.tmp`` beside the file, which is then renamed over it. A concurrent job reads the
  old or the new file, never a mix; two jobs replacing one file both succeed, the last rename
  wins. There is no ``fsync``: a crash may lose the new content (or leave an empty file, which
  readers refuse like any damaged one), which costs a re-hash, against a flush of the device on
  every save. A process killed between write and rename leaves its ``.tmp`` file behind; the next
  save by a process of the same id replaces it.
- **Private**: the folder is created ``0700`` and the files ``0600`` (before the umask), since
  the names of a user's checkpoints are nobody else's business.
- **Least recently used first** (``remove_least_recently_used``): a file read is marked used
  (``mark_used``: its modification time), and the files beyond a count or byte budget are removed
  oldest first. Two jobs trimming at once may remove a little more than needed.
"""

from __future__ import annotations

import os


def write_cache_file(path: str, data: bytes) -> bool:
    """Replace a file of the user's cache folder (created private) with `data`, atomically, so a
    concurrent job reads the old or the new file; False where it cannot be written, which only
    costs time (a cache never fails a job)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        return True
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False


def mark_used(path: str) -> None:
    """Note that a cache file was just used (its modification time): it is removed after older ones.

    Raises OSError where the file is gone or cannot be touched."""
    os.utime(path)


def remove_least_recently_used(folder: str, suffix: str, *, max_files: int, max_bytes: int) -> None:
    """Remove the files of `folder` whose names end in `suffix`, least recently used first, until at
    most `max_files` of them are left holding at most `max_bytes`."""
    try:
        with os.scandir(folder) as it:
            docs = sorted((st.st_mtime_ns, st.st_size, e.path) for e in it if e.name.endswith(suffix)
                          for st in (e.stat(),))
    except OSError:  # another job trimming at the same time: it will do
        return
    total = sum(size for _, size, _ in docs)
    for _, size, path in docs:  # the least recently used first
        if len(docs) <= max_files and total <= max_bytes:
            return
        try:
            os.unlink(path)
        except OSError:
            pass
        docs = docs[1:]
        total -= size
