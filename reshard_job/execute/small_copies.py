"""Whole small tensors copied from one source file, a run at a time.

A model of many small parameters (experts, their optimizer states, biases) pays per parameter, not
per byte. Where a target rank's plan copies a run of whole small tensors, each stored in one record
of the same source file, the run's spans are looked up together (``whole_spans``), its bytes read
in one read of the range they lie in (``read_spans``) and its records written together
(``add_alike``, per dtype and shape), instead of a handful of calls per tensor. A tensor whose
source entry is not what the plan expects is handed back (`fallback`), in its place in the order,
to be read, checked and refused in detail.

A tensor the fingerprints count comes with its tap spec (``WriterTap.spec_for``), handed to the
writer with the run instead of an ``expect`` each; one handed back is expected before it goes.
"""

from __future__ import annotations

from typing import Callable

from reshard_job.formats.base import whole_spans_of

RUN = 2048  # tensors looked up and read together
HOLD = 1 << 20  # bytes of tensors held before they are written


class WholeCopies:
    """Collects the whole small copies of a rank's plan in order and writes them in runs.

    `fallback(tensor, piece)` writes one parameter the long way; `progress(n)` hears of bytes done."""

    def __init__(self, writer, sources, fallback: Callable, progress: Callable[[int], None] | None):
        self._writer = writer
        self._tap = getattr(writer, "fingerprint_tap", None)
        self._alike = getattr(writer, "add_alike", None)
        self._sources = sources
        self._fallback = fallback
        self._progress = progress
        self._readers: dict[int, object] = {}
        self._rank: int | None = None
        self._run: list[tuple] = []  # (tensor facts, plan slice, source extents, tap spec or None)

    def add(self, tensor, piece: tuple, extents: tuple, spec: tuple | None = None) -> None:
        """A whole small copy from source rank ``piece[1][0].source_rank``, next in the order;
        `spec`: how the fingerprints count it (None: not counted here)."""
        rank = piece[1][0].source_rank
        if rank != self._rank or len(self._run) >= RUN:
            self.flush()
            self._rank = rank
        self._run.append((tensor, piece, extents, spec))

    def flush(self) -> None:
        """Write what was collected (before anything that comes after it in the order)."""
        run, self._run = self._run, []
        if not run:
            return
        reader = self._readers.get(self._rank)
        if reader is None:
            reader = self._readers[self._rank] = self._sources.reader(self._rank)
        spans = whole_spans_of(reader, [item[0].name for item in run])
        good = [span is not None and span[1] == extents and span[0] == tensor.dtype
                for (tensor, _, extents, _), span in zip(run, spans)]
        start = 0
        while start < len(run):
            if not good[start]:
                self._expect(run[start:start + 1])
                self._fallback(*run[start][:2])
                start += 1
                continue
            stop = start + 1
            dtype, shape = run[start][0].dtype, run[start][1][0]
            while stop < len(run) and good[stop] and run[stop][0].dtype == dtype and run[stop][1][0] == shape:
                stop += 1
            self._write(reader, run[start:stop], spans[start:stop])
            start = stop

    def _write(self, reader, run: list[tuple], spans: list[tuple]) -> None:
        """Tensors of one dtype and target shape, each the whole of one source record."""
        nbytes = run[0][1][2]
        step = max(1, HOLD // nbytes)
        for i in range(0, len(run), step):
            part = run[i:i + step]
            names = [item[0].name for item in part]
            offsets = [span[2] for span in spans[i:i + step]]
            if self._alike is not None and hasattr(reader, "read_spans"):
                counted = [item[3] for item in part] if self._tap is not None else None
                self._alike(names, part[0][0].dtype, part[0][1][0], reader.read_spans(offsets, nbytes), counted)
            else:
                self._expect(part)
                for name, offset in zip(names, offsets):
                    self._writer.add_bytes(name, part[0][0].dtype, part[0][1][0], reader.read_near(offset, nbytes))
            if self._progress:
                self._progress(nbytes * len(part))

    def _expect(self, items: list[tuple]) -> None:
        """The counted ones of `items` expected by the tap, for a writer told of them one by one."""
        if self._tap is not None:
            for item in items:
                self._tap.expect_spec(item[0].name, item[3])
