"""Small local files and folders the job keeps beside its outputs: how each is made to appear.

Checkpoints go through ``AtomicFile`` (``atomic``: fsync, then rename). What is here serves the
job's own bookkeeping on the local file system, each with the strategy that fits it:

- **Rename of a hidden temporary file, no fsync** (``replace_file``): the bytes go to
  ``.<name>.<12 hex digits>.tmp`` in the file's folder (the form ``AtomicFile`` uses, which an
  output folder's clean-up recognises), which is renamed over the file. A reader sees
  the old or the new file, never a half-written one. Without ``fsync`` a crash may lose the new
  content; these files (a lineage graph, say) are made again on demand, and a device flush per
  file would cost more than they are worth. The folder must exist: a mistyped folder is reported,
  not created.
- **Rename of a staged folder** (``publish_folder``): a set of files that is used only whole
  (the demo checkpoints) is built under ``<folder>.<pid>.tmp`` and renamed into place once
  complete. A folder cannot be renamed over a non-empty one, so an older folder is removed just
  before; a reader that does not hold the builder's lock (``exclusive_lock``) may find no folder
  for that moment, but never a partial set under the final name. A build that fails removes its
  staged folder.
- **Lock files** (``exclusive_lock``): an ``fcntl`` lock on a file created for it, which the
  kernel drops when its holder dies, so a killed holder never blocks the next job.
- **Folders** (``make_folder``): created with their parents; an existing one is fine.

Failures are ``OSError``s, left to the caller to word: each knows what the file was for.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import Callable, Iterator

from reshard_job.storage.atomic import file_mode, temp_name_for


def make_folder(path: str) -> None:
    """Create the folder `path` and its parents ('' is the current folder, which exists)."""
    os.makedirs(path or ".", exist_ok=True)


def discard_writes_to(path: str) -> None:
    """Make `path` a link to ``os.devnull``: what someone else's code writes there goes nowhere
    (Hydra's sweeper saving an unmasked configuration); ``replace_file`` puts a file in its place."""
    if os.path.lexists(path):
        os.unlink(path)
    os.symlink(os.devnull, path)


def replace_file(path: str, data: bytes, *, mode: int = 0o644) -> None:
    """Replace (or create) the file `path` with `data`, atomically, in its existing folder."""
    tmp = temp_name_for(os.path.abspath(path))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, file_mode(mode))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def publish_folder(path: str, build: Callable[[str], None]) -> None:
    """Have `build` fill a staged folder (the path it is given), then rename it to `path`, replacing
    what was there. Callers that may race hold an ``exclusive_lock`` around it."""
    staging = f"{path}.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)  # a leftover of a killed process with our id
    try:
        build(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(path, ignore_errors=True)  # an incomplete or older set
    os.rename(staging, path)


@contextlib.contextmanager
def exclusive_lock(path: str) -> Iterator[None]:
    """Hold an exclusive ``fcntl`` lock on the file `path` (created if missing; its folder must
    exist), waiting for it as long as another process holds it. Where ``fcntl`` does not exist
    (not POSIX) nothing is locked: callers must then tolerate races."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
