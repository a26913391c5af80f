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
    increasing offset as they leave memory (``update``); ``finish`` gives what it took."""

    def __init__(self, boxes: Callable[[str, tuple], tuple | None], *, limit: int = MAX_RECORDS):
        self._boxes = boxes  # (name, stored dims) -> (global shape, box) or None (``RecordBoxes``)
        self._limit = limit
        self._specs: list[tuple] = []  # (dtype, global shape, box), each once
        self._spec_ids: dict[tuple, int] = {}
        self._offsets, self._lengths, self._spec = array("q"), array("q"), array("I")
        self._next = 0  # the first record whose bytes have not all passed
        self._fp: Fingerprint | None = None  # the partial fingerprint of record `_next`, while its bytes pass
        self._fed = 0  # bytes of record `_next` fed
        self._passed = 0  # bytes of the file that have left memory
        self._sums = PartialFingerprints()  # per record taken: its ordinal as its name
        self._batches = _BoxBatches(self._sums)
        self._broken = False

    def note(self, offset: int, length: int, name: str, dtype: str, dims: tuple) -> None:
        """A tensor record: `length` bytes at `offset`, of `name`, stored as `dtype` with `dims`."""
        if self._broken or length <= 0:
            return
        if offset < self._passed or (self._offsets and offset < self._offsets[-1] + self._lengths[-1]):
            return  # its bytes went by already, or it overlaps the last one: left to the plan's taps
        dt = dtypes.BY_NAME.get(dtype)
        if dt is None or not dt.sliceable:
            return
        try:
            shape, box = self._boxes(name, tuple(dims)) or (None, None)
            if box is None:
                return
            spec = (dtype, tuple(shape), tuple(box))
            if _box_bytes(dtype, spec[2]) != length:
                return  # not the whole of its box in this record (a chunk of a larger tensor, say)
        except Exception:  # noqa: BLE001 - a forecast that fails is no forecast; the planner judges the layout
            return
        if len(self._offsets) >= self._limit:
            self._broken = True
            return
        number = self._spec_ids.get(spec)
        if number is None:
            number = self._spec_ids[spec] = len(self._specs)
            self._specs.append(spec)
        self._offsets.append(offset)
        self._lengths.append(length)
        self._spec.append(number)

    def update(self, pos: int, chunk) -> None:
        """Bytes ``[pos, pos + len(chunk))`` of the file, after every byte before them."""
        end = pos + len(chunk)
        offsets, lengths = self._offsets, self._lengths
        while self._next < len(offsets) and not self._broken:
            offset, length = offsets[self._next], lengths[self._next]
            start = offset + self._fed
            if start >= end:
                break
            if start < pos:  # bytes of it passed unseen: this record is not taken
                self._skip()
                continue
            stop = min(offset + length, end)
            self._feed(chunk[start - pos:stop - pos], whole=self._fed == 0 and stop - start == length)
            if self._fed == length:
                self._next, self._fed, self._fp = self._next + 1, 0, None
        self._passed = max(self._passed, end)

    def _feed(self, data, *, whole: bool) -> None:
        dtype, shape, box = self._specs[self._spec[self._next]]
        if whole and len(data) <= SMALL:
            self._batches.add((dtype, shape, box), self._next, bytes(data))
            if self._batches.held >= HELD:
                self._batches.flush()
            self._fed = len(data)
            return
        if self._fp is None:
            self._fp = Fingerprint(dtype, shape)
        self._fp.add_box_run(box, self._fed, data)
        self._fed += len(data)
        if self._fed == self._lengths[self._next]:
            self._sums.add(self._next, _lanes(self._fp, dtype, shape), self._fp.fed)

    def _skip(self) -> None:
        self._next, self._fed, self._fp = self._next + 1, 0, None

    def finish(self) -> "StreamedRecords | None":
        """What was taken (None when the file had too many records to keep)."""
        if self._broken:
            return None
        self._batches.flush()
        return StreamedRecords(self._offsets, self._lengths, self._spec, self._specs, self._sums)


class StreamedRecords:
    """The records of one file taken whole while it streamed, and their partial fingerprints."""

    def __init__(self, offsets: array, lengths: array, spec: array, specs: list[tuple], sums: PartialFingerprints):
        order = np.asarray(sums.names, dtype=np.int64)  # record ordinals, in the order they completed
        count = len(offsets)
        self.offsets = np.frombuffer(offsets, np.int64, count)
        self.lengths = np.frombuffer(lengths, np.int64, count)
        self.spec = np.frombuffer(spec, np.uint32, count)
        self.specs = specs
        self.taken = np.zeros(count, bool)
        self.taken[order] = True
        self.lanes = np.zeros((count, _RECORD), np.uint8)
        self.lanes[order] = np.frombuffer(bytes(sums.lanes), np.uint8).reshape(-1, _RECORD)
        self.fed = np.zeros(count, np.uint64)
        self.fed[order] = np.frombuffer(sums.fed, np.uint64, len(order))

    def serve(self, records: tuple[array, array, array], tensors) -> PartialFingerprints | None:
        """The partial fingerprints of a file tap's tensors (``TappedColumns``) whose `records`
        (offsets, lengths, tensor of each, in file order) are one each and were all taken here as
        the tap counts them; None otherwise."""
        offsets, lengths, of = (np.frombuffer(c, np.int64, len(c)) for c in records)
        if len(np.unique(of)) != len(of):
            return None  # a tensor of several records: the tap reads
        empty = _without_records(of, tensors)
        if empty is None:
            return None
        at = np.searchsorted(self.offsets, offsets)
        if len(at) and at.max() >= len(self.offsets):
            return None
        if not (np.array_equal(self.offsets[at], offsets) and np.array_equal(self.lengths[at], lengths)
                and self.taken[at].all()):
            return None
        wanted = _spec_numbers([tensors[i] for i in of.tolist()], self.specs)
        if wanted is None or not np.array_equal(self.spec[at], wanted):
            return None
        out = PartialFingerprints()
        names = tensors.names()
        out.names = [names[i] for i in of.tolist()]
        out.lanes = bytearray(self.lanes[at].tobytes())
        out.fed = array("Q", self.fed[at].tobytes())
        out.extend([names[i] for i in empty], bytes(_RECORD * len(empty)), 0)  # no byte: sums 0, as fed
        return out


def _without_records(of: np.ndarray, tensors) -> list[int] | None:
    """The tensors of `tensors` that no record holds, all of zero bytes (a zero-size dim); None
    where one of them has bytes (the tap would find it unfed)."""
    held = np.zeros(len(tensors), bool)
    held[of] = True
    empty = np.flatnonzero(~held).tolist()
    for i in empty:
        t = tensors[i]
        if _box_bytes(t.dtype, full_box(t.global_shape) if t.box is None else tuple(t.box)):
            return None
    return empty


def _spec_numbers(tensors, specs: list[tuple]) -> np.ndarray | None:
    """Per tensor of `tensors` (``Tapped``), the number of its (dtype, global shape, box) among `specs`; None
    where one of them is not among them."""
    ids = {spec: i for i, spec in enumerate(specs)}
    numbers = np.empty(len(tensors), np.int64)
    for i, t in enumerate(tensors):
        box = full_box(t.global_shape) if t.box is None else tuple(t.box)
        number = ids.get((t.dtype, tuple(t.global_shape), box))
        if number is None:
            return None
        numbers[i] = number
    return numbers


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
