"""The partial fingerprints of a remote source's records, taken as the object streams past while indexed.

A remote rank file is read once, front to back, for its index and its sha256 together
(``sources.file_digests.DigestingReader``). The sources' fingerprints want the same bytes, but
their taps (``proof.source_taps.FileTap``) can only be made from the one-device plan, after every
rank is indexed: they read each object's counted records a second time, as many bytes again as
the hash pass. A ``StreamTap`` rides on the first read instead. The format reader notes each
tensor record as it finds it (name, dtype, stored dims, where its bytes lie); ``RecordBoxes``
foresees from the strategy where the record lands in its global tensor; the record's bytes are fed
to its partial fingerprint as they leave the stream's memory (the same sums a ``FileTap`` would
take, ``execute.writer_tap``). Replicas the plan will not count are fingerprinted too (the kernel
costs a fraction of the sha256 beside it).

Once the plan is made, ``StreamedRecords.serve`` gives a file's tap its result where every record
the tap counts was taken here whole, at the offset, length, dtype, global shape and box the plan
says; any difference and the tap is fed from its records as before. A forecast is never trusted
where it differs, so it costs at most the second read it was meant to save.
"""

from __future__ import annotations

from array import array
from typing import Callable, Mapping

import numpy as np

import reshard_job.core.dtypes as dtypes
from reshard_job.core.boxes import full_box
from reshard_job.core.fingerprint import Fingerprint
from reshard_job.execute.writer_tap import SMALL, PartialFingerprints, _BoxBatches, _box_bytes, _lanes

MAX_RECORDS = 1 << 20  # records of one file tapped at most (beyond, its tap is fed from reads later)
HELD = 1 << 20  # bytes of small records held for their batch (per object; several stream at once)
_RECORD = 16  # bytes of lane sums per record


class StreamTap:
    """Fed a file's tensor records as its format reader finds them (``note``) and its bytes in
    increasing offset as they leave memory (``update``); ``finish`` gives what it took.

    A tensor is one record, or several consecutive records of one name (a `.ckpt` cuts tensors
    over 512 MiB into chunk records, each with the full dims): their bytes, in file order, are the
    box's C-order bytes, fed to one partial fingerprint."""

    def __init__(self, boxes: Callable[[str, tuple], tuple | None], *, limit: int = MAX_RECORDS):
        self._boxes = boxes  # (name, stored dims) -> (global shape, box) or None (``RecordBoxes``)
        self._limit = limit
        self._specs: list[tuple] = []  # (dtype, global shape, box), each once
        self._spec_ids: dict[tuple, int] = {}
        # per record: where it lies, its tensor, where its bytes start in the tensor's
        self._offsets, self._lengths, self._tensor, self._at = array("q"), array("q"), array("q"), array("q")
        self._spec, self._total, self._records = array("I"), array("q"), array("q")  # per tensor
        self._open: tuple | None = None  # (name, dtype, dims, bytes noted) of a tensor awaiting chunks
        self._next = 0  # the first record whose bytes have not all passed
        self._fed = 0  # bytes of record `_next` fed
        self._fp: Fingerprint | None = None  # the partial fingerprint of the tensor being fed
        self._fp_of = -1  # ... and which tensor that is
        self._passed = 0  # bytes of the file that have left memory
        self._sums = PartialFingerprints()  # per tensor taken: its ordinal as its name
        self._batches = _BoxBatches(self._sums)
        self._broken = False

    def note(self, offset: int, length: int, name: str, dtype: str, dims: tuple) -> None:
        """A tensor record: `length` bytes at `offset`, of `name`, stored as `dtype` with `dims`."""
        if self._broken or length <= 0:
            return
        if offset < self._passed or (self._offsets and offset < self._offsets[-1] + self._lengths[-1]):
            self._open = None
            return  # its bytes went by already, or it overlaps the last one: left to the plan's taps
        if len(self._offsets) >= self._limit:
            self._broken = True
            return
        dims = tuple(dims)
        if self._open is not None and self._open[:3] == (name, dtype, dims):
            self._chunk(offset, length)
            return
        self._open = None
        spec = self._spec_of(name, dtype, dims)
        if spec is None:
            return
        total = _box_bytes(*spec[::2])
        if length > total:
            return
        number = self._spec_ids.get(spec)
        if number is None:
            number = self._spec_ids[spec] = len(self._specs)
            self._specs.append(spec)
        self._add_record(offset, length, len(self._spec), 0)
        self._spec.append(number)
        self._total.append(total)
        self._records.append(1)
        if length < total:  # its first chunk: the others follow under the same name
            self._open = (name, dtype, dims, length)

    def _spec_of(self, name: str, dtype: str, dims: tuple) -> tuple | None:
        """(dtype, global shape, box) foreseen for a record of `name`; None where there is none."""
        dt = dtypes.BY_NAME.get(dtype)
        if dt is None or not dt.sliceable:
            return None
        try:
            shape, box = self._boxes(name, dims) or (None, None)
            return None if box is None else (dtype, tuple(shape), tuple(box))
        except Exception:  # noqa: BLE001 - a forecast that fails is no forecast; the planner judges the layout
            return None

    def _chunk(self, offset: int, length: int) -> None:
        """Another chunk record of the open tensor (the last one noted)."""
        name, dtype, dims, noted = self._open
        tensor = len(self._spec) - 1
        if noted + length > self._total[tensor]:
            self._open = None  # more bytes than its box: never complete, so never taken
            return
        self._add_record(offset, length, tensor, noted)
        self._records[tensor] += 1
        self._open = (name, dtype, dims, noted + length) if noted + length < self._total[tensor] else None

    def _add_record(self, offset: int, length: int, tensor: int, at: int) -> None:
        self._offsets.append(offset)
        self._lengths.append(length)
        self._tensor.append(tensor)
        self._at.append(at)

    def update(self, pos: int, chunk) -> None:
        """Bytes ``[pos, pos + len(chunk))`` of the file, after every byte before them."""
        end = pos + len(chunk)
        offsets, lengths = self._offsets, self._lengths
        while self._next < len(offsets) and not self._broken:
            offset, length = offsets[self._next], lengths[self._next]
            start = offset + self._fed
            if start >= end:
                break
            if start < pos:  # bytes of it passed unseen: its tensor is not taken
                self._next, self._fed = self._next + 1, 0
                continue
            stop = min(offset + length, end)
            self._feed(chunk[start - pos:stop - pos], whole=self._fed == 0 and stop - start == length)
            if self._fed == length:
                self._next, self._fed = self._next + 1, 0
        self._passed = max(self._passed, end)

    def _feed(self, data, *, whole: bool) -> None:
        tensor = self._tensor[self._next]
        dtype, shape, box = self._specs[self._spec[tensor]]
        total = self._total[tensor]
        if whole and len(data) == total <= SMALL:  # a small tensor in one record: batched
            self._batches.add((dtype, shape, box), tensor, bytes(data))
            if self._batches.held >= HELD:
                self._batches.flush()
            self._fed = len(data)
            return
        if self._fp_of != tensor:
            self._fp, self._fp_of = Fingerprint(dtype, shape), tensor
        self._fp.add_box_run(box, self._at[self._next] + self._fed, data)
        self._fed += len(data)
        if self._fp.fed == total and self._fed == self._lengths[self._next]:
            self._sums.add(tensor, _lanes(self._fp, dtype, shape), self._fp.fed)
            self._fp, self._fp_of = None, -1

    def finish(self) -> "StreamedRecords | None":
        """What was taken (None when the file had too many records to keep)."""
        if self._broken:
            return None
        self._batches.flush()
        return StreamedRecords((self._offsets, self._lengths, self._tensor), (self._spec, self._records),
                               self._spec_ids, self._sums)


class StreamedRecords:
    """The tensors of one file taken whole while it streamed, their records, and their partial fingerprints."""

    def __init__(self, records: tuple[array, array, array], tensors: tuple[array, array], spec_ids: dict[tuple, int],
                 sums: PartialFingerprints):
        self.offsets, self.lengths, self.tensor = (np.frombuffer(c, np.int64, len(c)) for c in records)
        spec, count = tensors
        self.spec = np.frombuffer(spec, np.uint32, len(spec))
        self.records = np.frombuffer(count, np.int64, len(count))  # records of each tensor
        self.spec_ids = spec_ids  # (dtype, global shape, box) -> its number in `spec`
        order = np.asarray(sums.names, dtype=np.int64)  # tensor ordinals, in the order they completed
        self.taken = np.zeros(len(spec), bool)
        self.taken[order] = True
        self.lanes = np.zeros((len(spec), _RECORD), np.uint8)
        self.lanes[order] = np.frombuffer(bytes(sums.lanes), np.uint8).reshape(-1, _RECORD)
        self.fed = np.zeros(len(spec), np.uint64)
        self.fed[order] = np.frombuffer(sums.fed, np.uint64, len(order))

    def serve(self, records: tuple[array, array, array], tensors) -> PartialFingerprints | None:
        """The partial fingerprints of a file tap's tensors (``TappedColumns``) whose `records`
        (offsets, lengths, tensor of each, in file order) are exactly those of tensors taken here,
        each as the tap counts it (dtype, global shape, box); None otherwise."""
        offsets, lengths, of = (np.frombuffer(c, np.int64, len(c)) for c in records)
        at = np.searchsorted(self.offsets, offsets)
        if len(at) and at.max() >= len(self.offsets):
            return None
        if not (np.array_equal(self.offsets[at], offsets) and np.array_equal(self.lengths[at], lengths)):
            return None
        pairs = np.unique(np.stack([of, self.tensor[at]], axis=1), axis=0).reshape(-1, 2)
        mine, theirs = pairs[:, 0], pairs[:, 1]
        if len(pairs) != len(np.unique(mine)) or len(pairs) != len(np.unique(theirs)):
            return None  # a tap tensor of records of several tensors here, or the other way round
        if not (np.array_equal(np.bincount(of, minlength=len(tensors))[mine], self.records[theirs])
                and self.taken[theirs].all()):
            return None  # records of a tensor here the tap does not count, or a tensor not taken whole
        numbers, kinds = tensors.numbered()
        numbers = np.frombuffer(numbers, np.uint32, len(numbers))
        specs = [_spec(kind) for kind in kinds]  # the tap's few kinds, each as a spec here
        wanted = np.array([self.spec_ids.get(spec, -1) for spec in specs], np.int64)[numbers[mine]]
        empty = _without_records(of, numbers, [_box_bytes(dtype, box) for dtype, _, box in specs])
        if empty is None or not np.array_equal(self.spec[theirs], wanted):
            return None
        out = PartialFingerprints()
        names = tensors.names()
        out.names = [names[i] for i in mine.tolist()]
        out.lanes = bytearray(self.lanes[theirs].tobytes())
        out.fed = array("Q", self.fed[theirs].tobytes())
        out.extend([names[i] for i in empty], bytes(_RECORD * len(empty)), 0)  # no byte: sums 0, as fed
        return out


def _spec(kind: tuple) -> tuple:
    """A tap's (dtype, global shape, box or None for all of it) as (dtype, global shape, box)."""
    dtype, shape, box = kind
    return dtype, tuple(shape), full_box(shape) if box is None else tuple(box)


def _without_records(of: np.ndarray, numbers: np.ndarray, kind_bytes: list[int]) -> list[int] | None:
    """The tensors (their kind `numbers`, bytes per kind `kind_bytes`) that no record holds, all of
    zero bytes (a zero-size dim); None where one of them has bytes (the tap would find it unfed)."""
    held = np.zeros(len(numbers), bool)
    held[of] = True
    empty = np.flatnonzero(~held)
    if len(empty) and np.asarray(kind_bytes, np.int64)[numbers[empty]].any():
        return None
    return empty.tolist()


def serve_taps(taps, streamed: Mapping[str, object]) -> int:
    """Give each file tap (``proof.source_taps.SourceTaps``) whose file streamed past a
    ``StreamTap`` unchanged since its result from there, where it serves; how many it gave."""
    served = 0
    for tap in taps.files.values():
        got = streamed.get(tap.path)
        records = getattr(got, "records", None)
        if records is None or not tap.untouched or tuple(got.digest.identity) != tuple(tap.identity):
            continue
        partials = records.serve(tap.records(), tap.tensors)
        if partials is not None:
            tap.take(partials)
            served += 1
    return served
