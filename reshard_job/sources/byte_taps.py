"""Work fed by a source file's bytes as the hash pass reads them: the tap protocol, reading only
what a tap needs where the file is not read whole, and a cache of what taps computed.

The hash pass reads every source file the plan needs front to back (``file_digests``). Whatever
else needs those bytes (the fingerprints of the parameters a file holds) rides on that read
instead of reading them again: it is a *tap*, handed each chunk with its file offset. A file the
hash pass does not read (its digest came from the digest cache, or was taken while a remote
object was indexed) feeds its tap from reads of the tap's own byte ranges (``feed_ranges``), and
what a tap computed is kept in the user's cache folder under the file's identity and the tap's
key (``TapCache``), as the digests are: a rerun over unchanged sources reads nothing for it.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Callable, Protocol, Sequence

from reshard_job.storage import SourceChangedError, StorageOptions, storage_for
from reshard_job.storage.cache_files import mark_used, remove_least_recently_used, write_cache_file

READ_BLOCK = 8 << 20  # bytes read at a time by ``feed_ranges``
GAP = 1 << 20  # ranges closer than this are read as one (a gap costs less than another request)
MAX_FILES = 20_000  # tap states kept in the cache, the least recently used removed first
MAX_BYTES = 2 << 30
SUFFIX = ".tap"


class ByteTap(Protocol):
    """What a tap offers the readers of one file."""

    key: str  # what the tap computes from the file (its cache key with the file's identity)

    def update(self, pos: int, chunk: memoryview) -> None:
        """Bytes ``[pos, pos + len(chunk))`` of the file; calls come in increasing `pos`."""

    def ranges(self) -> Sequence[tuple[int, int]]:
        """The (offset, length) ranges it needs, in increasing offset."""

    def ready(self) -> bool:
        """Whether it has everything it needs (fed, or restored)."""

    def state(self) -> bytes | None:
        """What it computed, to be kept (None: nothing to keep)."""

    def restore(self, blob: bytes) -> bool:
        """Take a kept state back; False where it does not parse (then it is fed again)."""


def coalesced(ranges: Sequence[tuple[int, int]], gap: int = GAP) -> list[tuple[int, int]]:
    """`ranges` (in increasing offset) merged where they are less than `gap` bytes apart."""
    out: list[list[int]] = []
    for offset, length in ranges:
        if out and offset - (out[-1][0] + out[-1][1]) < gap:
            out[-1][1] = max(out[-1][1], offset + length - out[-1][0])
        else:
            out.append([offset, length])
    return [(a, n) for a, n in out if n > 0]


def feed_ranges(tap: ByteTap, path: str, identity: tuple, *, storage_options: StorageOptions | None = None,
                progress: Callable[[int], None] | None = None, block: int = READ_BLOCK) -> None:
    """Feed `tap` from positioned reads of its ranges of the file `path`, which must still have
    `identity` (else SourceChangedError: its bytes are no longer the ones named by its digest)."""
    storage = storage_for(path, storage_options)
    f = storage.open_read(path)
    try:
        if identity and tuple(f.identity) != tuple(identity):
            raise SourceChangedError(f"{path}: changed since the job hashed it; rerun once it is stable")
        buf = bytearray(max(1, block))
        mv = memoryview(buf)
        for offset, length in coalesced(tap.ranges()):
            end = min(offset + length, f.size)
            while offset < end:
                n = f.pread_into(offset, mv[:min(len(buf), end - offset)])
                if n <= 0:
                    raise SourceChangedError(f"{path}: ended before byte {end}; rerun once it is stable")
                tap.update(offset, mv[:n])
                offset += n
                if progress:
                    progress(n)
    finally:
        f.close()


class TapCache:
    """Tap states by file path, identity and tap key, one small file each in `folder`.

    The name of a state's file is a digest of all three, so a state is only ever found for the
    file as it was when the state was computed (any write changes the identity: see
    ``file_digests``) and for the same question (the key). A cache never fails a job: a state
    that cannot be read or written is computed again."""

    def __init__(self, folder: str):
        self.folder = folder
        self._written = 0

    def _file(self, path: str, identity: tuple, key: str) -> str:
        name = json.dumps([path, [str(x) for x in identity], key]).encode("utf-8", "surrogateescape")
        return os.path.join(self.folder, hashlib.sha256(name).hexdigest()[:32] + SUFFIX)

    def restore(self, tap: ByteTap, path: str, identity: tuple) -> bool:
        """Whether `tap` took back a state kept for this file as it is now."""
        if not identity:
            return False
        file = self._file(path, identity, tap.key)
        try:
            with open(file, "rb") as f:
                blob = f.read()
        except OSError:
            return False
        if not tap.restore(blob):
            return False
        try:
            mark_used(file)
        except OSError:
            pass
        return True

    def keep(self, tap: ByteTap, path: str, identity: tuple) -> None:
        blob = tap.state() if identity else None
        if blob is not None and write_cache_file(self._file(path, identity, tap.key), blob):
            self._written += 1

    def trim(self) -> None:
        if self._written:
            remove_least_recently_used(self.folder, SUFFIX, max_files=MAX_FILES, max_bytes=MAX_BYTES)
