"""Telling each source file which byte ranges a rank task is about to read (pure: no I/O here).

A rank task reads, from each source file, the boxes its plan names, one at a time. Locally each
read is a ``pread``; from an object store each is a round trip. Many are small (layer norms and
biases, sharded across every rank by optimizer parallelism, come from every source file) and, when
a target takes only part of a source tensor, the large ones are not contiguous either, so a
reader that only sees one read at a time cannot coalesce them. The plan knows them all in
advance: ``expected_ranges`` turns a task's plan into the file ranges each source rank will serve
(the span of every box, mapped through the tensor's records), and ``announce`` hands them to the
readers, which may fetch them in batches of coalesced requests (``ObjectReader.expect``) within a
memory budget, or ignore them (local files).

A box's span runs from its first to its last byte, so a box of whole rows is exact and a box of
columns covers the rows it cuts (which is what reading it takes anyway). Strings and map tensors
are left out: they are small and read whole.
"""

from __future__ import annotations

from math import prod
from typing import TYPE_CHECKING, Mapping

import reshard_job.core.dtypes as dtypes
from reshard_job.formats.tensorfile import KIND_TENSOR
from reshard_job.plan.model import ACTION_COPY

if TYPE_CHECKING:
    from reshard_job.formats.tensorfile import TensorEntry
    from reshard_job.plan.model import RankPlan

MIN_BUDGET = 1024 * 1024


def box_span(shape: tuple[int, ...], box, itemsize: int) -> tuple[int, int]:
    """(first byte, end byte) of a box's elements within a C-ordered tensor's bytes; (0, 0) if empty."""
    if any(b <= a for a, b in box):
        return 0, 0
    strides = [prod(shape[d + 1:]) * itemsize for d in range(len(shape))]
    first = sum(a * s for (a, _), s in zip(box, strides))
    last = sum((b - 1) * s for (_, b), s in zip(box, strides))
    return first, last + itemsize


def file_ranges(entry: "TensorEntry", start: int, end: int) -> list[tuple[int, int]]:
    """The (file offset, length) ranges holding bytes [start, end) of a tensor, across its records."""
    out = []
    pos = 0
    for offset, length in entry.pieces:
        lo, hi = max(start, pos), min(end, pos + length)
        if lo < hi:
            out.append((offset + lo - pos, hi - lo))
        pos += length
        if pos >= end:
            break
    return out


def expected_ranges(plan: "RankPlan", entries: Mapping[int, Mapping[str, "TensorEntry"]]) -> dict[int, list]:
    """Source rank -> the file ranges the task will read from it, in the order of the plan."""
    out: dict[int, list[tuple[int, int]]] = {}
    for p in plan.params:
        dt = dtypes.BY_NAME.get(p.dtype)
        for c in p.copies:
            entry = entries.get(c.source_rank, {}).get(p.name)
            if entry is None or entry.kind != KIND_TENSOR or not entry.pieces:
                continue
            sliceable = dt is not None and dt.sliceable and dt.storage is not None and p.action != ACTION_COPY
            start, end = (box_span(tuple(entry.shape), c.source_box, dt.storage.itemsize) if sliceable
                          else (0, entry.stored_bytes))
            out.setdefault(c.source_rank, []).extend(file_ranges(entry, start, end))
    return out


def announce(plan: "RankPlan", readers: Mapping[int, object], budget: int) -> None:
    """Hand each reader the ranges it will serve, with an equal share of `budget` bytes to buffer.

    Only readers that want them are told (local files do not): working the ranges out costs a
    walk over every copy of the plan, noticeable for checkpoints of very many small tensors."""
    readers = {r: reader for r, reader in readers.items() if getattr(reader, "wants_read_ahead", False)}
    if not readers:
        return
    entries = {r: getattr(reader, "entries", {}) for r, reader in readers.items()}
    ranges = expected_ranges(plan, entries)
    share = max(MIN_BUDGET, budget // max(1, len(ranges)))
    for rank, wanted in ranges.items():
        expect = getattr(readers[rank], "expect_reads", None)
        if expect is not None:
            expect(wanted, share)
