"""The sources' fingerprints from the bytes the hash pass reads: one tap per source file.

Every source file the plan needs is read front to back once, for its sha256 and its CRCs
(``job.stages.integrity``). The parameters' fingerprints ride on that read: a one-device plan of
the sources (``proof.collect.single_device_plan``) names, for every parameter, the stored
records that make up its global tensor once (one replica of each block) and where each lands;
each record counted is fed to a partial fingerprint (``execute.writer_tap``: the same partial
sums the outputs' side adds up) as its bytes pass by. A file the hash pass does not read (its
digest was cached) is read for its counted records only, and what each file gave is kept in the
digest cache under its identity and this tap's key (``sources.byte_taps``): a rerun over
unchanged sources reads nothing for its fingerprints. A remote object, hashed in the read that
indexed it before any plan existed, gives its taps what that read took on the way
(``proof.stream_taps``), where it took every record as the plan counts it.

Taps take records that are read whole, as stored, in the file's own bytes: a tensor of a
sliceable dtype whose counted copy is its whole stored record (one piece, or several in file
order). Anything else (an opaque dtype, a part of a stored tensor, stored dims that differ from
the global ones) is left to ``proof.pieces`` (``residual``), as is every parameter of a file
whose tap could not be fed whole: what a tap gives is either complete or not used.
"""

from __future__ import annotations

import hashlib
import json
import logging
from array import array
from concurrent.futures import ThreadPoolExecutor
from math import prod
from typing import Callable

import numpy as np

import reshard_job.core.dtypes as dtypes
from reshard_job.core.digest_table import DigestTable
from reshard_job.core.boxes import box_shape, full_box
from reshard_job.core.fingerprint import ALGORITHM
from reshard_job.execute.writer_tap import PartialFingerprints, TargetSums, WriterTap
from reshard_job.formats.multifile import MultiFileReader
from reshard_job.formats.tensorfile import KIND_TENSOR
from reshard_job.plan.model import ParamPlans
from reshard_job.proof.tapped import Tapped, TappedColumns
from reshard_job.sources.byte_taps import TapCache, feed_ranges

log = logging.getLogger("reshard_job")
_MAGIC = b"reshard_job source tap 2\n"  # 1: the names as JSON
WHOLE_RUN = 1 << 16  # parameters of one copy looked up together (their spans are transient)
TAP_RUN = 1 << 13  # whole records of them added to a tap together


class FileTap:
    """The partial fingerprints of one source file's counted records (``sources.byte_taps.ByteTap``).

    Records are (offset, length, tensor) in increasing offset, a tensor (``Tapped``) of several
    pieces having a record each."""

    def __init__(self, path: str, identity: tuple):
        self.path, self.identity = path, tuple(identity)
        self.tensors = TappedColumns()
        self._offsets, self._lengths, self._of = array("q"), array("q"), array("q")
        self._tap: WriterTap | None = None
        self._feeds: dict[int, object] = {}  # tensor index -> its feed, while its pieces come
        self._next = 0  # the first record not fed whole yet
        self._fed = 0  # bytes of that record fed
        self._broken = False
        self._result: PartialFingerprints | None = None
        self._key: str | None = None
        self.restored = False  # its state came from the cache

    def add(self, tensor: Tapped, pieces) -> None:
        index = len(self.tensors)
        self.tensors.append(tensor)
        for offset, length in pieces:
            if length:  # an empty piece has no bytes to wait for (a zero-size tensor is done at the end)
                self._offsets.append(offset)
                self._lengths.append(length)
                self._of.append(index)

    def add_whole(self, names: list[str], kinds: list[tuple], offsets: list[int], lengths: list[int]) -> None:
        """``add`` of each of a run of tensors stored whole in one record: (dtype, global shape,
        None) and the record's offset and length each, for all at once."""
        if 0 in lengths:  # (an empty tensor has no record to wait for)
            for name, kind, offset, length in zip(names, kinds, offsets, lengths):
                self.add(Tapped(name, *kind), ((offset, length),))
            return
        index = len(self.tensors)
        self.tensors.extend(names, kinds)
        self._offsets.extend(offsets)
        self._lengths.extend(lengths)
        self._of.extend(range(index, index + len(names)))

    def seal(self) -> None:
        """Put the records in file order (called once all are added)."""
        order = np.argsort(np.frombuffer(self._offsets, np.int64), kind="stable")  # (columns, not an int each)

        def in_order(column: array) -> array:
            return array("q", np.frombuffer(column, np.int64)[order].tobytes())
        # one column at a time: each old one let go before the next is made
        self._offsets = in_order(self._offsets)
        self._lengths = in_order(self._lengths)
        self._of = in_order(self._of)
        self._state = bytearray(len(self.tensors))  # per tensor: 0 not begun, 1 begun, 2 fed whole

    @property
    def key(self) -> str:
        if self._key is None:
            h = hashlib.sha256(ALGORITHM.encode() + b"\n")
            for column in (self._offsets, self._lengths, self._of):  # the records, in file order
                h.update(len(column).to_bytes(8, "little") + column.tobytes())
            self.tensors.hash_into(h)  # (name, dtype, shape, box) of each
            self._key = h.hexdigest()[:32]
        return self._key

    @property
    def untouched(self) -> bool:
        """Whether nothing has fed it yet (nor taken a kept state)."""
        return self._result is None and not self._broken and self._next == 0 and self._fed == 0

    def ranges(self) -> list[tuple[int, int]]:
        return list(zip(self._offsets, self._lengths))

    def records(self) -> tuple[array, array, array]:
        """(offset, length, tensor index) of its records, in file order (once sealed)."""
        return self._offsets, self._lengths, self._of

    def take(self, partials: PartialFingerprints) -> None:
        """Its result, taken by another read of the same bytes (``proof.stream_taps``)."""
        self._result = partials

    def ready(self) -> bool:
        return self._result is not None

    def update(self, pos: int, chunk) -> None:
        if self._broken or self._result is not None:
            return
        end = pos + len(chunk)
        try:
            while self._next < len(self._offsets):
                offset, length = self._offsets[self._next], self._lengths[self._next]
                start = offset + self._fed
                if start >= end:
                    return
                if start < pos:  # bytes of a record went by unfed (records overlap): not used
                    self._broken = True
                    return
                stop = min(offset + length, end)
                index = self._of[self._next]
                if stop - start == length and not self._state[index] and self._take_whole(index, chunk, start - pos):
                    self._next += 1  # a small tensor in one record, all of it in this chunk
                    continue
                feed = self._feed(index)
                feed.update(chunk[start - pos:stop - pos])
                if feed.fp is None:  # the tensor's last byte: its feed is done (its sums are in the tap)
                    self._state[index] = 2
                    del self._feeds[index]
                self._fed += stop - start
                if self._fed < length:
                    return
                self._next, self._fed = self._next + 1, 0
            self._finish()
        except (ValueError, KeyError) as e:  # a record the file does not hold as planned: left to the pieces
            log.debug("%s: fingerprints not taken in the hash pass (%s)", self.path, e)
            self._broken = True

    def _take_whole(self, index: int, chunk, at: int) -> bool:
        """Tensor `index` fed at once from `chunk` (at `at`), if it is a small whole tensor."""
        tensor = self.tensors[index]
        if tensor.box is not None:
            return False
        if self._tap is None:
            self._tap = WriterTap()
        length = self._lengths[self._next]
        if not self._tap.take_whole(tensor.name, tensor.dtype, tensor.global_shape, chunk[at:at + length]):
            return False
        self._state[index] = 2
        return True

    def _feed(self, index: int):
        feed = self._feeds.get(index)
        if feed is None:
            if self._state[index]:  # fed whole already: the tensor's records met twice
                raise ValueError(f"parameter {self.tensors.name(index)!r} fed twice")
            feed = self._feeds[index] = self._begin(index)
        return feed

    def _begin(self, index: int):
        if self._tap is None:
            self._tap = WriterTap()
        name, dtype, shape, box = self.tensors[index]
        box = full_box(shape) if box is None else box
        self._tap.expect(name, dtype, KIND_TENSOR, shape, box_shape(box), tuple(lo for lo, _ in box))
        self._state[index] = 1
        return self._tap.feed(name)

    def _finish(self) -> None:
        """Every record was fed: the zero-size tensors (no record) are added, and the sums taken."""
        for index in (i for i, state in enumerate(self._state) if not state):
            self._begin(index).update(b"")  # done at once if it has no bytes; else left open: no result
        self._result = (self._tap or WriterTap()).result()
        self._broken = self._result is None
        self._tap, self._feeds = None, {}

    def result(self) -> PartialFingerprints | None:
        return self._result

    def state(self) -> bytes | None:
        """What `restore` takes back: the sums, and per sum the tensor it is of, as its index among
        this tap's tensors (which the cache key covers): no names, which for 600,000 parameters
        were 57 MiB of strings made again on each restore."""
        p = self._result
        if p is None:
            return None
        first: dict[str, int] = {}  # a tensor of several boxes here sums under its name: any index of it will do
        for i, name in enumerate(self.tensors.names()):
            first.setdefault(name, i)
        order = array("I", map(first.__getitem__, p.names))
        header = json.dumps({"algorithm": ALGORITHM, "count": len(p)}).encode() + b"\n"
        return _MAGIC + header + bytes(p.lanes) + p.fed.tobytes() + order.tobytes()

    def restore(self, blob: bytes) -> bool:
        try:
            if not blob.startswith(_MAGIC):
                return False
            end = blob.index(b"\n", len(_MAGIC))
            header = json.loads(blob[len(_MAGIC):end])
            count = header["count"]
            body = memoryview(blob)[end + 1:]
            if header["algorithm"] != ALGORITHM or count != len(self.tensors) or len(body) != 28 * count:
                return False
            order = array("I")
            order.frombytes(body[24 * count:])
            if count and max(order) >= count:
                return False
            p = PartialFingerprints()
            p.__setstate__(([self.tensors.name(i) for i in order], body[:16 * count], body[16 * count:24 * count]))
        except (ValueError, KeyError, TypeError):
            return False
        self._result, self.restored = p, True
        return True


class SourceTaps:
    """The taps of every source file of one job, and the fingerprints they give."""

    def __init__(self):
        self.files: dict[tuple[int, int], FileTap] = {}  # (source rank, file of the rank) -> its tap
        self.residual: set[str] = set()  # parameters left to ``proof.pieces``
        self.read_back = 0  # taps fed from reads of their records (not by the hash pass, nor the cache)
        self.restored = 0  # taps whose state came from the cache
        self._settled: tuple[DigestTable, set[str]] | None = None

    def tap(self, rank: int, file: int) -> FileTap | None:
        return self.files.get((rank, file))

    def unfed(self, cache: TapCache | None = None) -> list[FileTap]:
        """The taps the hash pass did not feed (their files' digests were cached) and `cache` has
        kept no state for (for the file as it is now): those ``feed`` reads for."""
        return [tap for tap in self.files.values()
                if tap.untouched and not (cache is not None and cache.restore(tap, tap.path, tap.identity))]

    def feed(self, taps: list[FileTap], *, storage=None, progress: Callable[[int], None] | None = None,
             threads: int = 2) -> None:
        """Feed `taps` from reads of their records only (positioned reads, `threads` files at once)."""
        self.read_back += len(taps)

        def one(tap: FileTap) -> None:
            feed_ranges(tap, tap.path, tap.identity, storage_options=storage, progress=progress)
            tap.update(0, memoryview(b""))  # a tap without records is done once asked

        if threads <= 1 or len(taps) <= 1:
            for tap in taps:
                one(tap)
            return
        with ThreadPoolExecutor(max_workers=threads) as pool:
            for f in [pool.submit(one, tap) for tap in taps]:
                f.result()

    def keep(self, cache: TapCache, computed: list[FileTap] | None = None) -> None:
        """Keep in `cache` the states computed in this run (of `computed`, default all taps)."""
        for tap in self.files.values() if computed is None else computed:
            if tap.ready() and not tap.restored:
                cache.keep(tap, tap.path, tap.identity)
        cache.trim()

    def settle(self) -> None:
        """Add the sums up once every tap was fed, and let the taps go: their records are tens of
        MiB for a model of many parameters, held through the conversion otherwise."""
        self.restored = sum(tap.restored for tap in self.files.values())
        self._settled = self.digests()
        self.files = {}

    def digests(self) -> tuple[DigestTable, set[str]]:
        """(parameter -> hex fingerprint from the taps, the parameters they could not give)."""
        if self._settled is not None:
            return self._settled
        residual = set(self.residual)
        sums = TargetSums()
        for tap in self.files.values():
            if tap.result() is None:
                residual.update(tap.tensors.names())
            else:
                sums.add(tap.result())
        digests, uncovered = sums.digests(t for tap in self.files.values() for t in tap.tensors
                                          if t.name not in residual)
        if uncovered:
            log.debug("fingerprints: %d parameter(s) not fed whole by the taps, read by pieces", len(uncovered))
        residual.update(uncovered)
        return digests, residual


def plan_source_taps(rank_plan, sources, names) -> SourceTaps:
    """The taps of a one-device `rank_plan`'s counted records, for the parameters in `names`.
    `sources`: what the plan was made over (``raw_reader(rank)``; ``names``: a selection's new
    name -> stored name)."""
    taps = SourceTaps()
    rename = getattr(sources, "names", None) or {}
    params = rank_plan.params
    pairs = zip(params.tensors, (sl[:3] for sl in params.slices)) if isinstance(params, ParamPlans) else \
        ((p.tensor, (p.target_shape, p.copies, p.nbytes)) for p in params)
    whole: dict[int, list] = {}  # source rank -> (tensor, copy) of parameters made of one copy, a run at a time
    for t, (_, copies, _) in pairs:
        if t.kind != KIND_TENSOR or t.name not in names:
            continue
        if len(copies) == 1:
            rank = copies[0].source_rank
            items = whole.setdefault(rank, [])
            items.append((t, copies[0]))
            if len(items) >= WHOLE_RUN:
                _add_whole(taps, rank, whole.pop(rank), sources, rename)
        else:
            _add(taps, t, copies, sources, rename)
    for rank, items in whole.items():
        _add_whole(taps, rank, items, sources, rename)
    for tap in taps.files.values():
        tap.seal()
    return taps


def _add(taps: SourceTaps, t, copies, sources, rename) -> None:
    """Parameter `t`'s records to the taps of their files (or it to the residual)."""
    records = _records(t, copies, sources, rename.get(t.name, t.name))
    if records is None:
        taps.residual.add(t.name)
        return
    shape = tuple(t.global_shape)
    for key, path, identity, box, pieces in records:
        tap = taps.files.get(key)
        if tap is None:
            tap = taps.files[key] = FileTap(path, identity)
        tap.add(Tapped(t.name, t.dtype, shape, None if box == full_box(shape) else box), pieces)


def _add_whole(taps: SourceTaps, rank: int, items: list, sources, rename) -> None:
    """Parameters each made of one copy from source `rank`: where the rank is one file,
    their records are looked up together (``whole_spans``: a model of many small parameters)."""
    raw = sources.raw_reader(rank)
    if isinstance(raw, MultiFileReader):  # offsets of one file, for that file's tap
        raw = raw.readers[0] if len(raw.readers) == 1 else None
    spans = raw.whole_spans([rename.get(t.name, t.name) for t, _ in items]) if hasattr(raw, "whole_spans") else None
    if spans is None:
        for t, c in items:
            _add(taps, t, (c,), sources, rename)
        return
    run: tuple[list, list, list, list] = ([], [], [], [])  # whole records, added together in their order
    kind: tuple = (None, None, None)
    plain: dict[tuple, bool] = {}  # (dtype, shape, stored dtype, dims, bytes, copy) -> a whole record of it
    for (t, c), span in zip(items, spans):
        shape = tuple(t.global_shape)
        whole = False
        if span is not None:
            dims = span[1] if type(span[1]) is tuple else tuple(span[1])
            key = (t.dtype, shape, span[0], dims, span[3], c)
            whole = plain.get(key)
            if whole is None:
                whole = _whole_record(t.dtype, shape, span, c)
                if len(plain) < 4096:
                    plain[key] = whole
        if not whole:
            _add_run(taps, rank, raw, run)
            _add(taps, t, (c,), sources, rename)  # anything but a whole record of the whole tensor
            continue
        if kind[0] != t.dtype or kind[1] != shape:
            kind = (t.dtype, shape, None)  # (one tuple for a run of tensors alike)
        run[0].append(t.name)
        run[1].append(kind)
        run[2].append(span[2])
        run[3].append(span[3])
        if len(run[0]) >= TAP_RUN:
            _add_run(taps, rank, raw, run)
    _add_run(taps, rank, raw, run)


def _add_run(taps: SourceTaps, rank: int, raw, run: tuple[list, list, list, list]) -> None:
    """The whole records collected in `run` (names, kinds, offsets, lengths) to the file's tap; emptied."""
    if not run[0]:
        return
    tap = taps.files.get((rank, 0)) or taps.files.setdefault((rank, 0), FileTap(raw.path, raw.identity))
    tap.add_whole(*run)
    for column in run:
        column.clear()


def _whole_record(dtype: str, shape: tuple, span: tuple, c) -> bool:
    """Whether a stored record `span` (dtype, dims, offset, length) is the whole of a tensor of
    this dtype and global shape, and copy `c` takes all of it."""
    dt = dtypes.BY_NAME.get(dtype)
    return (dt is not None and dt.sliceable and span[0] == dtype and tuple(span[1]) == shape
            and span[3] == prod(shape) * dt.itemsize and c.source_box == c.target_box == full_box(shape))


def _records(t, copies, sources, stored: str) -> list | None:
    """Per copy of `t`: (file key, path, identity, global box, pieces); None where a copy is not a
    whole stored record of the same dtype and shape."""
    dt = dtypes.BY_NAME.get(t.dtype)
    if dt is None or not dt.sliceable:
        return None
    out = []
    for c in copies:
        if box_shape(c.source_box) != box_shape(c.target_box):
            return None
        found = _stored_record(sources.raw_reader(c.source_rank), stored)
        if found is None:
            return None
        file, f, dtype, shape, pieces = found
        if dtype != t.dtype or c.source_box != full_box(shape) or sum(n for _, n in pieces) != prod(shape) * dt.itemsize:
            return None
        if any(a + n > b for (a, n), (b, _) in zip(pieces, pieces[1:])):
            return None
        out.append(((c.source_rank, file), f.path, tuple(getattr(f, "identity", ()) or ()), c.target_box, pieces))
    return out


def _stored_record(raw, stored: str):
    """(file index in the rank, its reader, dtype, shape, pieces) of tensor `stored`; None if absent."""
    files = raw.readers if isinstance(raw, MultiFileReader) else (raw,)
    for i, f in enumerate(files):
        if stored not in f:
            continue
        span = f.whole_span(stored) if hasattr(f, "whole_span") else None
        if span is not None:
            return i, f, span[0], tuple(span[1]), ((span[2], span[3]),)
        e = f.entries[stored]
        return i, f, e.dtype, tuple(e.shape), tuple(tuple(p) for p in e.pieces)
    return None
