"""CRC32 of many byte ranges of one file, taken as the file's chunks pass in order.

The hash pass (``file_digests.digest_file``) needs, besides the file's sha256, the CRC32 of every
range a format records a checksum for and of every tensor compared across ranks: for a checkpoint
of 300,000 tiny parameters, 300,000 ranges per file. Ranges may overlap (a `.ckpt` CRC trailer
covers every tensor, which may also be checked on its own). They are taken up in order of their
start as the chunks reach them and dropped once passed, so a file of a hundred thousand tensors
costs no more per chunk than one of ten; the short ranges that lie within one chunk are taken all
at once (``crc32_rows``, one table step per byte column) rather than one ``zlib`` call each.
"""

from __future__ import annotations

import zlib
from bisect import bisect_left
from itertools import chain
from collections.abc import Sequence

import numpy as np

from reshard_job.formats.crc32 import crc32_rows

Segments = Sequence[tuple[int, int]]  # (offset, length) byte ranges, in any order, possibly overlapping
SHORT = 32  # ranges at most this long, within one chunk, are taken together
TOGETHER = 64  # ... when at least this many enter at once (fewer: one zlib call each is as quick)
_ITER_ROWS = 1 << 16


class SegmentTable(Sequence):
    """Byte ranges as one (n, 2) int64 array, read as the sequence of (offset, length) tuples it
    stands for: 300,000 compared tensors per file are 16 bytes a range, not a tuple of two ints
    (some 120 bytes), for as long as the hash pass holds them."""

    __slots__ = ("_a",)

    def __init__(self, table):
        a = np.array(table, dtype=np.int64).reshape(-1, 2)  # (a copy: nobody else changes it)
        a.flags.writeable = False
        self._a = a

    @property
    def array(self) -> np.ndarray:
        return self._a

    def __len__(self) -> int:
        return len(self._a)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return SegmentTable(self._a[i])
        offset, length = self._a[i].tolist()
        return offset, length

    def __iter__(self):
        for start in range(0, len(self._a), _ITER_ROWS):  # (a block of tuples at a time)
            yield from map(tuple, self._a[start:start + _ITER_ROWS].tolist())

    def __eq__(self, other) -> bool:
        if isinstance(other, SegmentTable):
            return np.array_equal(self._a, other._a)
        return isinstance(other, Sequence) and len(other) == len(self) and all(
            mine == tuple(theirs) for mine, theirs in zip(self, other))

    def __hash__(self) -> int:
        return hash(self._a.tobytes())

    def tobytes(self) -> bytes:
        """The ranges as native int64 pairs (what ``array("q", …)`` of them holds)."""
        return self._a.tobytes()


class SegmentCrcs:
    """The CRC32 of each of `segments` (``crcs``, in their order), fed by ``update``. More ranges
    may be added while chunks come (``add``), in order of their start and ahead of them."""

    def __init__(self, segments: Segments):
        if isinstance(segments, SegmentTable):  # kept as it is: a list is made only if one is added
            self.segments, self._table = segments, segments.array
        else:
            self.segments = [s if type(s) is tuple else tuple(s) for s in segments]
            # the ranges given at first, as an array
            self._table = np.fromiter(chain.from_iterable(self.segments), np.int64,
                                      2 * len(self.segments)).reshape(-1, 2)
        self.order = np.argsort(self._table[:, 0], kind="stable").tolist()
        self.crcs = [0] * len(self.segments)
        self._next = 0
        self._active: list[int] = []
        self._passed = 0  # bytes of the file fed so far

    def add(self, offset: int, length: int) -> bool:
        """One more range; False (and not added) if it starts before a range already added or
        before the bytes fed so far, whose CRC it could no longer take."""
        if offset < self._passed or (self.order and offset < self.segments[self.order[-1]][0]):
            return False
        if isinstance(self.segments, SegmentTable):
            self.segments = list(self.segments)
        self.order.append(len(self.segments))
        self.segments.append((offset, length))
        self.crcs.append(0)
        return True

    def _start(self, i: int) -> int:
        return self.segments[i][0]

    def update(self, pos: int, chunk: memoryview) -> None:
        end = pos + len(chunk)
        self._passed = end
        reached = bisect_left(self.order, end, lo=self._next, key=self._start)
        entering = self.order[self._next:reached]
        self._next = reached
        if len(entering) >= TOGETHER:
            entering = self._take_short(entering, pos, chunk)
        self._active.extend(entering)
        still = []
        for i in self._active:
            off, length = self.segments[i]
            lo, hi = max(off, pos), min(off + length, end)
            if lo < hi:
                self.crcs[i] = zlib.crc32(chunk[lo - pos : hi - pos], self.crcs[i])
            if off + length > end:
                still.append(i)
        self._active = still

    def _take_short(self, entering: list[int], pos: int, chunk: memoryview) -> list[int]:
        """The CRCs of the short ranges of `entering` that lie within `chunk`, all at once; returns
        the others, left to the range-by-range loop."""
        index = np.array(entering, dtype=np.int64)
        if max(entering) < len(self._table):
            ranges = self._table[index]
        else:
            ranges = np.array([self.segments[i] for i in entering], dtype=np.int64).reshape(-1, 2)
        offsets, lengths = ranges[:, 0] - pos, ranges[:, 1]
        short = (offsets >= 0) & (offsets + lengths <= len(chunk)) & (lengths <= SHORT)
        data = np.frombuffer(chunk, dtype=np.uint8)
        for length in np.unique(lengths[short]).tolist():
            alike = short & (lengths == length)
            if length == 0:
                continue  # the CRC of no bytes is 0, as set
            rows = data[offsets[alike][:, None] + np.arange(length)]
            for i, crc in zip(index[alike].tolist(), crc32_rows(rows).tolist()):
                self.crcs[i] = crc
        return index[~short].tolist()
