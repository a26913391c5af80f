"""The outputs' fingerprints from the bytes written: each rank task's partial sums, and their sum.

The fingerprint (``core.fingerprint``) is a sum over a tensor's bytes, each weighted by a key of its
global position, so the parts of a tensor written by different target ranks add up to the whole
tensor's fingerprint, whatever the layout. A rank task knows where each tensor it writes lies in
the global tensor (``Place`` in the plan) and whether its copy is the one counted (one rank per
distinct box: ``RankPlan.counts``). For those tensors the writer hands every byte it hashes for the
per-tensor sha256 to a ``WriterTap`` feed as well, in the same place: the output's hashing thread
where the file is written through ``O_DIRECT``, else the writing thread, so that what is
fingerprinted is exactly what was written, and nothing is read back.

What crosses process (and Ray) boundaries is ``PartialFingerprints``: per tensor its name, the two
64-bit lane sums (16 bytes, without the header mask) and how many bytes were fed. The job adds
them up per parameter (``TargetSums``) and checks that every parameter's bytes were fed exactly
as many times as the global tensor has bytes, then applies the mask of its dtype and shape.
"""

from __future__ import annotations

import threading
from array import array
from functools import lru_cache
from math import prod
from typing import Iterable, Iterator

import numpy as np

import reshard_job.core.dtypes as dtypes
from reshard_job.core.digest_table import DigestTable
from reshard_job.core.fingerprint import LANES, _READS, Fingerprint, _column_dot, _dim_keys, _words
from reshard_job.formats.tensorfile import KIND_TENSOR

_MASK64 = (1 << 64) - 1
SMALL = 64 << 10  # tensors up to this size are fingerprinted in batches of one (dtype, shape, box)
BATCH_BYTES = 8 << 20  # bytes of small tensors held before their batches are computed


@lru_cache(maxsize=4096)
def _mask(dtype: str, shape: tuple[int, ...]) -> int:
    """The header mask of a fingerprint: what an empty one's digest is (no byte fed, lanes zero)."""
    return int.from_bytes(Fingerprint(dtype, shape).digest(partial=True), "little")


@lru_cache(maxsize=4096)
def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes a fingerprint of this dtype and shape is fed in all (the global tensor's)."""
    return Fingerprint(dtype, shape).nbytes


def _lanes(fp: Fingerprint, dtype: str, shape: tuple[int, ...]) -> bytes:
    """A partial fingerprint's two lane sums, without the header mask (so that parts add)."""
    return (int.from_bytes(fp.digest(partial=True), "little") ^ _mask(dtype, shape)).to_bytes(16, "little")


@lru_cache(maxsize=4096)
def _box_bytes(dtype: str, box: tuple) -> int:
    """Bytes of a box of a tensor of this dtype."""
    return dtypes.BY_NAME[dtype].itemsize * prod(hi - lo for lo, hi in box)


@lru_cache(maxsize=4096)
def _whole_key(dtype: str, shape: tuple) -> tuple | None:
    """(dtype, shape, full box, bytes) of a whole tensor small enough to be fingerprinted in a
    batch; None for any other (empty, large, or not of a sliceable dtype)."""
    dt = dtypes.BY_NAME.get(dtype)
    if dt is None or not dt.sliceable:
        return None
    nbytes = dt.itemsize * prod(shape)
    return (dtype, shape, tuple((0, n) for n in shape), nbytes) if 0 < nbytes <= SMALL else None


class PartialFingerprints:
    """Per tensor a rank counted: name, 16 bytes of lane sums, bytes fed. Plain, compact, picklable."""

    __slots__ = ("names", "lanes", "fed")

    def __init__(self) -> None:
        self.names: list[str] = []
        self.lanes = bytearray()
        self.fed = array("Q")

    def add(self, name: str, lanes: bytes, fed: int) -> None:
        self.names.append(name)
        self.lanes += lanes
        self.fed.append(fed)

    def extend(self, names: list[str], lanes: bytes, fed: int) -> None:
        """``add`` of each of `names`, `lanes` holding their 16 bytes one after the other, each fed `fed`."""
        self.names.extend(names)
        self.lanes += lanes
        self.fed.extend([fed] * len(names))

    def __len__(self) -> int:
        return len(self.names)

    def __iter__(self) -> Iterator[tuple[str, bytes, int]]:
        for i, name in enumerate(self.names):
            yield name, bytes(self.lanes[16 * i:16 * i + 16]), self.fed[i]

    def __getstate__(self):
        return self.names, bytes(self.lanes), self.fed.tobytes()

    def __setstate__(self, state) -> None:
        names, lanes, fed = state
        self.names, self.lanes, self.fed = names, bytearray(lanes), array("Q")
        self.fed.frombytes(fed)


class _Feed:
    """One counted tensor's bytes, in the C order of its target shape, into its partial fingerprint."""

    __slots__ = ("tap", "name", "fp", "box", "offset", "total")

    def __init__(self, tap: "WriterTap", name: str, fp: Fingerprint, box: tuple, total: int):
        self.tap, self.name, self.fp, self.box, self.offset, self.total = tap, name, fp, box, 0, total

    def update(self, data) -> None:
        n = memoryview(data).nbytes
        if not n:  # nothing to add; a zero-size tensor was done when its feed was made
            return
        self.fp.add_box_run(self.box, self.offset, data)
        self.offset += n
        if self.offset >= self.total:
            self.tap._done(self)


class _SmallFeed:
    """A small counted tensor's bytes, kept until its batch is computed (``_BoxBatches``)."""

    __slots__ = ("tap", "name", "key", "total", "data", "fp")

    def __init__(self, tap: "WriterTap", name: str, key: tuple, total: int):
        self.tap, self.name, self.key, self.total, self.data = tap, name, key, total, bytearray()
        self.fp = key  # not None until done (as a _Feed's)

    def update(self, data) -> None:
        self.data += memoryview(data).cast("B")  # a copy: the writer reuses its buffers
        if len(self.data) >= self.total:
            self.tap._small_done(self)


class _BoxBatches:
    """Partial fingerprints of many small tensors at once: tensors of one dtype, global shape and
    box share every key, so k of them are one (k * rows, words) matmul per lane and one contraction
    per leading dim, as ``core.fingerprint_batch`` does for whole tensors."""

    def __init__(self, out: PartialFingerprints):
        self.out = out
        self._groups: dict[tuple, tuple[list[str], list[bytes]]] = {}
        self.held = 0

    def add(self, key: tuple, name: str, data: bytes) -> None:
        names, blobs = self._groups.setdefault(key, ([], []))
        names.append(name)
        blobs.append(data)
        self.held += len(data)
        if self.held >= BATCH_BYTES:
            self.flush()

    def flush(self) -> None:
        for key, (names, blobs) in self._groups.items():
            self._compute(key, names, blobs)
        self._groups.clear()
        self.held = 0

    def _compute(self, key: tuple, names: list[str], blobs: list[bytes]) -> None:
        dtype, shape, box = key
        grid_box = Fingerprint(dtype, shape)._grid_box(box)
        lead = tuple(hi - lo for lo, hi in grid_box[:-1])
        width = grid_box[-1][1] - grid_box[-1][0]
        k = len(names)
        sums = np.zeros((k, LANES), "<u8")  # per tensor its lane sums, little-endian: its 16 bytes
        if width and 0 not in lead:
            raw = np.frombuffer(b"".join(blobs), dtype=np.uint8).reshape(k * prod(lead), width)
            words = _words(raw, grid_box[-1][0])
            for lane in range(LANES):
                y = _column_dot(words.view(_READS[lane]), grid_box[-1][0] // 8, lane).reshape((k,) + lead)
                for d in reversed(range(len(lead))):
                    y = y @ _dim_keys(lane, d, *grid_box[d])
                sums[:, lane] = y
        self.out.extend(names, sums.tobytes(), width * prod(lead))


class WriterTap:
    """The partial fingerprints of one rank task. The task says which tensor comes (``expect``);
    the writer asks for its feed when it starts that tensor (``feed``) and feeds it what it hashes."""

    def __init__(self) -> None:
        self._expected: dict[str, tuple] = {}
        self._open = 0  # feeds handed out and not yet complete
        self._lock = threading.Lock()  # feeds complete in the output's hashing thread
        self.partials = PartialFingerprints()
        self._batches = _BoxBatches(self.partials)

    def expect(self, name: str, dtype: str, kind: str, global_shape: tuple, target_shape: tuple, origin) -> None:
        """The next tensor `name` is counted here, at `origin` of the global tensor (tensors only:
        strings and map entries have no fingerprint)."""
        self.expect_spec(name, self.spec_for(dtype, kind, global_shape, target_shape, origin))

    @staticmethod
    def spec_for(dtype: str, kind: str, global_shape: tuple, target_shape: tuple, origin) -> tuple | None:
        """What ``expect`` keeps of a tensor counted here: (dtype, global shape, box); None for what
        has no fingerprint. Tensors of one spec share it (``take_many``)."""
        if kind != KIND_TENSOR or not dtypes.BY_NAME[dtype].sliceable:
            return None
        return dtype, tuple(global_shape), tuple((o, o + n) for o, n in zip(origin, target_shape))

    def expect_spec(self, name: str, spec: tuple | None) -> None:
        """``expect`` of a tensor by its ``spec_for`` (None: not counted)."""
        if spec is not None:
            self._expected[name] = spec

    def take_many(self, names: list[str], contents: list, specs: list) -> None:
        """Tensors written whole in one piece, each counted by its spec (None: not counted here),
        without an ``expect`` each: their bookkeeping done for all at once."""
        small = []
        for name, data, spec in zip(names, contents, specs):
            if spec is None:
                continue
            if 0 < len(data) <= SMALL and len(data) == _box_bytes(spec[0], spec[2]):
                small.append((spec, name, bytes(data)))
            else:
                self._expected[name] = spec
                self.feed(name).update(data)
        with self._lock:
            for spec, name, data in small:
                self._batches.add(spec, name, data)

    def feed(self, name: str) -> _Feed | _SmallFeed | None:
        """The feed of an expected tensor the writer starts (None: not counted here)."""
        spec = self._expected.pop(name, None)
        if spec is None:
            return None
        dtype, shape, box = spec
        total = _box_bytes(dtype, box)
        with self._lock:
            self._open += 1
        if 0 < total <= SMALL:
            return _SmallFeed(self, name, spec, total)
        feed = _Feed(self, name, Fingerprint(dtype, shape), box, total)
        if total == 0:
            self._done(feed)
        return feed

    def feed_many(self, names: list[str], contents: list) -> None:
        """``feed(name).update(data)`` of each, for tensors written whole in one piece (a run of
        small ones): those expected are taken as ``take_many`` takes them."""
        self.take_many(names, contents, [self._expected.pop(name, None) for name in names])

    def take_whole(self, name: str, dtype: str, shape: tuple, data) -> bool:
        """A small tensor of a sliceable dtype, the whole of it fed at once (what ``expect`` at the
        origin, ``feed`` and one update do); False, and nothing taken, for any other."""
        key = _whole_key(dtype, shape)
        if key is None or len(data) != key[3]:
            return False
        with self._lock:
            self._batches.add(key[:3], name, bytes(data))
        return True

    def _small_done(self, feed: _SmallFeed) -> None:
        if len(feed.data) != feed.total:
            raise ValueError(f"parameter {feed.name!r}: {len(feed.data)} bytes fed, {feed.total} expected")
        with self._lock:
            self._batches.add(feed.key, feed.name, bytes(feed.data))
            self._open -= 1
        feed.fp = feed.data = None

    def _done(self, feed: _Feed) -> None:
        dtype, shape = feed.fp.dtype, feed.fp.shape
        lanes = _lanes(feed.fp, dtype, shape)
        with self._lock:
            self.partials.add(feed.name, lanes, feed.fp.fed)
            self._open -= 1
        feed.fp = None  # done: a late update is a bug, and fails

    def result(self) -> PartialFingerprints | None:
        """The partial fingerprints, once the file is committed (its hashing finished); None when some
        expected tensor was not fed whole, so that the job reads that file back instead."""
        if self._expected or self._open:
            return None
        self._batches.flush()
        return self.partials


READ_BLOCK = 8 << 20


def fingerprint_written(rank_plan, reader) -> PartialFingerprints | None:
    """The partial fingerprints of the tensors `rank_plan` counts, read back from the file written
    for it (`reader`): for a file a rank task did not tap (one kept from an earlier run)."""
    tap = WriterTap()
    for p in rank_plan.params:
        if rank_plan.counts(p.place):
            tap.expect(p.name, p.dtype, p.kind, p.global_shape, p.target_shape, p.place.origin)
            feed = tap.feed(p.name)
            if feed is not None:
                for block in reader.iter_content(p.name, READ_BLOCK):
                    feed.update(block)
                if feed.fp is not None:  # the file holds fewer bytes than the plan says
                    return None
    return tap.result()


class TargetSums:
    """The partial fingerprints of every target rank, added up per parameter: a row per name (lane
    sums and bytes fed as uint64 columns, which add mod 2^64 as the lanes do), not an object each
    (a model of 600,000 parameters)."""

    def __init__(self) -> None:
        self._row: dict[str, int] = {}
        self._sums = np.zeros((0, 3), np.uint64)  # lane 1, lane 2, bytes fed
        self.units: set = set()  # the output files whose partials were added

    def add(self, partials: PartialFingerprints, unit=None) -> None:
        """Add one output file's partial fingerprints (`unit`: its key, remembered in ``units``)."""
        self.units.add(unit)
        row = self._row
        rows = np.fromiter((row.setdefault(name, len(row)) for name in partials.names), np.int64, len(partials))
        if len(row) > len(self._sums):
            grown = np.zeros((max(len(row), 2 * len(self._sums)), 3), np.uint64)
            grown[:len(self._sums)] = self._sums
            self._sums = grown
        values = np.empty((len(partials), 3), np.uint64)
        values[:, :2] = np.frombuffer(bytes(partials.lanes), "<u8").reshape(-1, 2)
        values[:, 2] = np.frombuffer(partials.fed, np.uint64)
        np.add.at(self._sums, rows, values)

    def digests(self, tensors: Iterable) -> tuple[DigestTable, list[str]]:
        """(name -> hex fingerprint, names whose bytes were not counted exactly once). `tensors`: the
        parameters to give (anything with ``name``, ``dtype`` and ``global_shape``; repeats skipped).
        Once: the sums are let go, so that the manifest is built without them. Worked out with
        whole-column operations: per tensor, a lookup."""
        kinds: dict[tuple, int] = {}  # (dtype, global shape) -> its number
        rows = self._row  # name -> its row, in the order of the rows
        kind_of = array("q", [-1]) * len(rows)  # row -> the number of its tensor's kind (-1: not asked for)
        for t in tensors:
            i = rows.get(t.name)
            if i is not None and kind_of[i] < 0:
                kind_of[i] = kinds.setdefault((t.dtype, tuple(t.global_shape)), len(kinds))
        kind = np.frombuffer(kind_of, np.int64)
        asked = np.flatnonzero(kind >= 0)
        names = list(rows)
        names = [names[i] for i in asked.tolist()]
        kind, sums = kind[asked], self._sums[asked]
        del rows, kind_of  # the name -> row dict (30 MiB for 600,000 names) is not held through the rest
        self._row, self._sums = {}, np.zeros((0, 3), np.uint64)
        want = [_nbytes(*k) for k in kinds]
        masks = [_mask(*k) for k in kinds]
        whole = sums[:, 2] == np.array([min(n, _MASK64) for n in want], np.uint64)[kind]
        whole &= np.array([n < _MASK64 for n in want], bool)[kind]  # (a size past 2^64 is never fed whole)
        raw = np.empty((len(names), 2), "<u8")
        raw[:, 0] = sums[:, 0] ^ np.array([m & _MASK64 for m in masks], np.uint64)[kind]
        raw[:, 1] = sums[:, 1] ^ np.array([m >> 64 for m in masks], np.uint64)[kind]
        given = [names[i] for i in np.flatnonzero(whole).tolist()]
        return DigestTable.of(given, raw[whole].view(np.uint8)), [names[i] for i in np.flatnonzero(~whole).tolist()]
