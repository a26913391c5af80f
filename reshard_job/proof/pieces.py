"""Fingerprints fed straight from the source pieces of a one-device plan, nothing assembled.

The one-device plan names, for every parameter, the boxes of stored tensors that make up the
global tensor once, and where each lands (``Copy.target_box`` is a box of the global tensor). The
fingerprint is a sum over bytes keyed by their global position, so each box can be read in
bounded row blocks and fed as it is read, in any order: no tensor is put together in C order of
its global shape, and no block is copied after it is read. A block of whole rows of a stored
tensor is one positioned read into one reused buffer (the read window).

Small whole tensors (the many biases and norms of a large model) go to ``WholeTensorBatch``, read
from the file's read-ahead window (``read_near``), so that adjacent small tensors are one read and
one vectorised pass per shape, not a call each.

Parts: the plan's bytes are cut into `parts` ranges of equal size, a block belonging to the part
where it starts; ``fingerprint_part`` reads only its part's blocks. A parameter whose blocks all
fall in one part is finished there; the others come back as partial fingerprints, which
``merge_parts`` adds up (the fingerprints of disjoint parts merge by addition). So parts can run
in separate processes over the same plan and files.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from math import prod
from typing import Callable, Container, Iterable

import numpy as np

import reshard_job.core.dtypes as dtypes
from reshard_job.core.boxes import Box, box_shape, split_rows
from reshard_job.core.fingerprint import Fingerprint
from reshard_job.core.fingerprint_batch import WholeTensorBatch
from reshard_job.errors import FormatError
from reshard_job.formats.tensorfile import KIND_TENSOR, Scratch
from reshard_job.plan.model import ParamPlans, RankPlan

READ_BLOCK = 8 << 20  # bytes read at a time: the read window (row blocks of a stored tensor)
BATCHED_TENSOR = 64 << 10  # whole tensors up to this size are fingerprinted in batches of one shape
COPY_BLOCK = 4 << 20  # bytes of a tensor fed at a time as raw bytes (not cut into boxes)
REPORT_EVERY = 4 << 20  # bytes done before progress hears of them


@dataclass
class PartFingerprints:
    """What one part of a plan gave: finished digests, and the fingerprints of parameters whose
    bytes other parts hold too (to be merged)."""

    digests: dict[str, str] = field(default_factory=dict)
    partial: dict[str, Fingerprint] = field(default_factory=dict)


def plan_entries(rank_plan: RankPlan, wanted: Container[str] | None = None):
    """(tensor facts, (target shape, copies, nbytes)) of each tensor of `rank_plan` to fingerprint."""
    params = rank_plan.params
    # a slice may carry a fourth element, the tensor's place in the outputs (``plan.model.Place``)
    pairs = zip(params.tensors, (sl[:3] for sl in params.slices)) if isinstance(params, ParamPlans) else \
        ((p.tensor, (p.target_shape, p.copies, p.nbytes)) for p in params)
    return ((t, piece) for t, piece in pairs
            if t.kind == KIND_TENSOR and (wanted is None or t.name in wanted))


def plan_bytes(rank_plan: RankPlan, wanted: Container[str] | None = None) -> int:
    """Bytes of the tensors of `rank_plan` that are fingerprinted (what the parts share out)."""
    return sum(piece[2] for _, piece in plan_entries(rank_plan, wanted))


def fingerprint_part(rank_plan: RankPlan, sources, *, wanted: Container[str] | None = None, part: int = 0,
                     parts: int = 1, progress: Callable[[int], None] | None = None, read_block: int = READ_BLOCK,
                     batched: int = BATCHED_TENSOR) -> PartFingerprints:
    """Part `part` of `parts` of the fingerprints of the tensors of a one-device `rank_plan` read
    from `sources` (the ``SourceFiles`` it was planned over); `wanted`: only these names.
    `read_block`: the most bytes read at a time; `batched`: whole tensors up to this size go to
    ``WholeTensorBatch`` (every part of one plan must be given the same two)."""
    feeder = _Feeder(sources, _Share(part, parts, plan_bytes(rank_plan, wanted)), progress, read_block, batched)
    for tensor, piece in plan_entries(rank_plan, wanted):
        feeder.tensor(tensor, *piece)
    return feeder.finish()


def merge_parts(parts: Iterable[PartFingerprints]) -> dict[str, str]:
    """The digests of every parameter from the results of all the parts of one plan. The first
    part's dict is the result, grown in place (a copy of 600,000 digests would cost tens of MiB)."""
    digests: dict[str, str] | None = None
    partial: dict[str, Fingerprint] = {}
    for p in parts:
        if digests is None:
            digests = p.digests
        else:
            digests.update(p.digests)
        for name, fp in p.partial.items():
            if name in partial:
                partial[name].merge(fp)
            else:
                partial[name] = fp
    digests = {} if digests is None else digests
    for name, fp in partial.items():
        digests[name] = fp.hexdigest()  # raises unless the parts fed every byte between them
    return digests


class _Share:
    """Which blocks belong to this part: a block is this part's when its first byte, counted over
    the plan's tensors in plan order, lies in this part's equal share of the total."""

    def __init__(self, part: int, parts: int, total: int):
        self.part, self.parts, self.total = part, parts, max(1, total)
        self.pos = 0

    def take(self, nbytes: int) -> bool:
        start = self.pos
        self.pos += nbytes
        return self.parts == 1 or start * self.parts // self.total == self.part


class _Feeder:
    """Reads the pieces of a plan's tensors and feeds them to their fingerprints."""

    def __init__(self, sources, share: _Share, progress: Callable[[int], None] | None, read_block: int,
                 batched: int):
        self.sources, self.share, self.progress = sources, share, progress
        self.read_block, self.batched = max(1, read_block), batched
        self.result = PartFingerprints()
        self._batch = WholeTensorBatch(self.result.digests)
        self._window = Scratch()
        self._readers: dict[int, object] = {}
        self._near: dict[int, Callable | None] = {}  # rank -> its read-ahead reads, where it has them
        self._pending = 0

    def reader(self, rank: int):
        r = self._readers.get(rank)
        if r is None:
            r = self._readers[rank] = self.sources.reader(rank)
        return r

    def tensor(self, t, shape: tuple, copies: tuple, nbytes: int) -> None:
        dt = dtypes.BY_NAME[t.dtype]
        if not dt.sliceable or any(box_shape(c.source_box) != box_shape(c.target_box) for c in copies):
            if self.share.take(nbytes):  # read as raw bytes, whole (a pass-through entry)
                self._raw(t, shape, copies[0], nbytes)
        elif nbytes <= self.batched:
            if self.share.take(nbytes):
                self._batch.add(t.name, t.dtype, shape, self._small(t, shape, copies, nbytes, dt.storage))
                self._done(nbytes)
        else:
            self._boxes(t, shape, copies, dt.storage)

    def finish(self) -> PartFingerprints:
        self._batch.flush()
        if self._pending and self.progress:
            self.progress(self._pending)
        return self.result

    def _done(self, nbytes: int) -> None:
        self._pending += nbytes
        if self._pending >= REPORT_EVERY and self.progress:
            self.progress(self._pending)
            self._pending = 0

    def _boxes(self, t, shape: tuple, copies: tuple, storage: np.dtype) -> None:
        """Each copy's source box in row blocks of at most `read_block` bytes, fed with its global box."""
        fp = None
        for c in copies:
            src = c.source_box
            row_bytes = prod(box_shape(src)[1:]) * storage.itemsize
            read = None
            for block in split_rows(src, row_bytes, self.read_block):
                n = prod(box_shape(block)) * storage.itemsize
                if not self.share.take(n):
                    continue
                if read is None:  # the entry is looked up once per copy, and only where it is read
                    read = self._box_reader(c.source_rank, t, src)
                    fp = fp or Fingerprint(t.dtype, shape)
                fp.add_box(_moved(block, src, c.target_box), read(block, self._window.array(box_shape(block), storage)))
                self._done(n)
        if fp is not None:
            self._keep(t.name, fp)

    def _box_reader(self, rank: int, t, box: Box) -> Callable:
        """``read(block, out)``: a block of parameter `t`'s stored tensor on source rank `rank`,
        checked against the plan first (`box` is all the plan reads of it)."""
        reader = self.reader(rank)
        entry = _check_source(reader, t.name, t.dtype, box)
        by_entry = getattr(reader, "read_entry_box", None)
        if by_entry is not None:
            return lambda block, out: by_entry(entry, block, out)
        return lambda block, out: reader.read_box(t.name, block, out=out)

    def _keep(self, name: str, fp: Fingerprint) -> None:
        if fp.complete or self.share.parts == 1:
            self.result.digests[name] = fp.hexdigest()  # raises unless every byte was fed
        else:
            self.result.partial[name] = fp

    def _small(self, t, shape: tuple, copies: tuple, nbytes: int, storage: np.dtype):
        """A small tensor's bytes in C order: a whole stored record from the read-ahead window, or
        its few pieces put in one small buffer."""
        if len(copies) == 1 and nbytes and copies[0].target_box == _full(shape):
            data = self._whole_record(t, copies[0], nbytes)
            if data is not None:
                return data
        buf = np.empty(shape, storage)
        for c in copies:
            reader = self.reader(c.source_rank)
            _check_source(reader, t.name, t.dtype, c.source_box)
            view = buf[tuple(slice(a, b) for a, b in c.target_box)] if shape else buf
            if view.flags.c_contiguous:
                reader.read_box(t.name, c.source_box, out=view)
            else:
                view[...] = reader.read_box(t.name, c.source_box)
        return buf

    def _whole_record(self, t, c, nbytes: int):
        """The bytes of a stored tensor that lies whole in one place of its file, from the file's
        read-ahead window (None where it does not: read it as boxes)."""
        reader = self.reader(c.source_rank)
        if hasattr(reader, "whole_span"):  # a .ckpt: straight from its index columns, no entry built
            span = reader.whole_span(t.name)
            ok = span is not None and span[0] == t.dtype and span[3] == nbytes and c.source_box == _full(span[1])
            return reader.read_near(span[2], nbytes) if ok else None
        near = self._near.get(c.source_rank, _UNSET)
        if near is _UNSET:
            near = self._near[c.source_rank] = _near_reads(reader)
        if near is None:
            return None
        entry = _check_source(reader, t.name, t.dtype, c.source_box)
        if c.source_box != _full(entry.shape) or len(entry.pieces) != 1 or entry.pieces[0][1] != nbytes:
            return None
        return near(entry.pieces[0][0], nbytes)

    def _raw(self, t, shape: tuple, c, nbytes: int) -> None:
        """A tensor fed as the raw bytes of one stored entry, in order (its dtype is opaque, or
        its stored dims differ from its global ones while its bytes do not)."""
        reader = self.reader(c.source_rank)
        _check_source(reader, t.name, t.dtype, c.source_box)
        dt = dtypes.BY_NAME[t.dtype]
        fp = Fingerprint(t.dtype, shape) if dt.sliceable else Fingerprint(t.dtype, shape, nbytes=nbytes)
        offset = 0
        for block in reader.iter_content(t.name, COPY_BLOCK):
            fp.add_run(offset, block)
            offset += len(block)
            self._done(len(block))
        self.result.digests[t.name] = fp.hexdigest()


_UNSET = object()


def _near_reads(reader) -> Callable[[int, int], memoryview] | None:
    """``read_near(offset, nbytes)`` of a reader whose entries' offsets are its files' (a
    safetensors file), or of several files read as one rank, whose entries' offsets run on from
    one file into the next (each file keeps its own read-ahead window); None for other readers."""
    if hasattr(reader, "read_near"):
        return reader.read_near
    files = getattr(reader, "readers", None)
    if not files or not all(hasattr(f, "read_near") for f in files):
        return None
    bases = list(itertools.accumulate((f.size for f in files[:-1]), initial=0))

    def read_near(offset: int, nbytes: int) -> memoryview:
        i = bisect.bisect_right(bases, offset) - 1
        return files[i].read_near(offset - bases[i], nbytes)

    return read_near


def _full(shape) -> Box:
    return tuple((0, n) for n in shape)


def _moved(block: Box, source_box: Box, target_box: Box) -> Box:
    """`block`, a box inside `source_box`, at its place inside `target_box` (same shape)."""
    return tuple((tlo + lo - slo, tlo + hi - slo) for (lo, hi), (slo, _), (tlo, _) in
                 zip(block, source_box, target_box))


def _check_source(reader, name: str, dtype: str, box: Box):
    """The plan was made from this file's index; re-check in case the file changed since."""
    if name not in reader:
        raise FormatError(reader.path, f"parameter {name!r} disappeared from the file since it was planned")
    e = reader[name]
    if e.dtype != dtype or len(box) != len(e.shape) or any(b > n for (_, b), n in zip(box, e.shape)):
        raise FormatError(reader.path, f"parameter {name!r} changed since it was planned")
    return e
