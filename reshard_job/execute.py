"""Executing a plan: read only the needed boxes of the needed files, write each target rank's file.

Memory is bounded by the slice in flight, not by the model or the file size: a target tensor is
produced in row blocks of at most ``max_memory / 2`` bytes (the other half is for a read buffer
when a source box does not land contiguously in the block), each block is filled from the source
boxes that meet it with positioned reads, then streamed to the output, which hashes it on the way.
A tensor copied unchanged is streamed in fixed-size blocks without being interpreted at all.

Nothing here knows about configuration, databases or progress bars; a callback reports bytes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .errors import FormatError, PlanError
from .formats import dtypes
from .formats.boxes import Box, box_shape, intersect, split_rows
from .formats.ckpt import KIND_MAP, KIND_STR, CheckpointReader, CheckpointWriter, WrittenFile
from .formats.tensorfile import PositionedReader, Scratch
from .plan import ACTION_COPY, ParamPlan, RankPlan, TensorMeta

DEFAULT_MAX_MEMORY = 32 * 1024 * 1024
COPY_BLOCK = 4 * 1024 * 1024

FORMAT_CKPT = "ckpt"
FORMAT_SAFETENSORS = "safetensors"

Progress = Callable[[int], None]


def detect_format(path: str) -> str:
    return FORMAT_SAFETENSORS if path.endswith(".safetensors") else FORMAT_CKPT


def open_reader(path: str, *, verify_crc: bool = True) -> PositionedReader:
    if detect_format(path) == FORMAT_SAFETENSORS:
        from .formats.safetensors import SafetensorsReader

        return SafetensorsReader(path, verify_crc=verify_crc)
    return CheckpointReader(path, verify_crc=verify_crc)


def reader_index(reader: PositionedReader) -> dict[str, TensorMeta]:
    """What a reader holds, as the planner sees it."""
    out = {}
    for name, e in reader.entries.items():
        kind = e.extra.get("kind", "tensor") if e.extra else "tensor"
        out[name] = TensorMeta(e.dtype, tuple(e.shape), kind, e.nbytes)
    return out


class SourceFiles:
    """The source checkpoint files by global rank, opened lazily and read-only."""

    def __init__(self, paths: dict[int, str], *, verify_crc: bool = True):
        self.paths = dict(paths)
        self.verify_crc = verify_crc
        self._readers: dict[int, PositionedReader] = {}

    def reader(self, rank: int) -> PositionedReader:
        r = self._readers.get(rank)
        if r is None:
            if rank not in self.paths:
                raise PlanError(f"source rank {rank} has no checkpoint file")
            r = open_reader(self.paths[rank], verify_crc=self.verify_crc)
            self._readers[rank] = r
        return r

    def index(self) -> dict[int, dict[str, TensorMeta]]:
        return {rank: reader_index(self.reader(rank)) for rank in sorted(self.paths)}

    def close(self) -> None:
        for r in self._readers.values():
            r.close()
        self._readers.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_writer(path: str, fmt: str, *, crc: bool = False):
    if fmt == FORMAT_SAFETENSORS:
        from .formats.safetensors import SafetensorsWriter

        return SafetensorsWriter(path, crc=crc)
    return CheckpointWriter(path, crc=crc)


@dataclass
class RankResult:
    target_rank: int
    file: WrittenFile


def execute_rank(
    rank_plan: RankPlan,
    sources: SourceFiles,
    out_path: str,
    *,
    fmt: str = FORMAT_CKPT,
    max_memory: int = DEFAULT_MAX_MEMORY,
    crc: bool = False,
    progress: Progress | None = None,
) -> WrittenFile:
    """Write one target rank's file from its plan; atomic (temp name, then rename)."""
    writer = open_writer(out_path, fmt, crc=crc)
    try:
        params = rank_plan.params
        if fmt == FORMAT_SAFETENSORS:
            for p in params:
                if p.kind != "tensor":
                    raise PlanError(f"parameter {p.name!r}: {p.kind} entries cannot be stored in safetensors; use ckpt")
                writer.declare(p.name, p.dtype, p.target_shape)
            by_name = {p.name: p for p in params}
            params = [by_name[n] for n in writer.data_order()]
        for p in params:
            _write_param(writer, p, sources, max_memory, progress)
        return writer.commit()
    except BaseException:
        writer.abort()
        raise


def _write_param(writer, p: ParamPlan, sources: SourceFiles, max_memory: int, progress: Progress | None) -> None:
    if p.kind == KIND_STR:
        reader = sources.reader(p.copies[0].source_rank)
        writer.add_str(p.name, reader.read_str(p.name))
        return
    if p.kind == KIND_MAP:
        reader = sources.reader(p.copies[0].source_rank)
        entry = reader[p.name]
        records = [[(part.dims, part.dtype, reader.pread(part.content_offset, part.content_len)) for part in rec]
                   for rec in entry.extra["map_records"]]
        writer.add_map(p.name, records)
        return
    sink = writer.begin(p.name, p.dtype, p.target_shape)
    if p.action == ACTION_COPY or not dtypes.BY_NAME[p.dtype].sliceable:
        reader = sources.reader(p.copies[0].source_rank)
        _check_source(reader, p, p.copies[0].source_box)
        for block in reader.iter_content(p.name, COPY_BLOCK):
            sink.write(block)
            if progress:
                progress(len(block))
    else:
        _fill_tensor(sink, p, sources, max_memory, progress)
    sink.close()


def _check_source(reader: PositionedReader, p: ParamPlan, box: Box) -> None:
    """The plan was made from this file's index; re-check in case the file changed since."""
    if p.name not in reader:
        raise FormatError(reader.path, f"parameter {p.name!r} disappeared from the file since it was planned")
    e = reader[p.name]
    if e.dtype != p.dtype or any(b > n for (_, b), n in zip(box, e.shape)) or len(box) != len(e.shape):
        raise FormatError(reader.path, f"parameter {p.name!r} changed since it was planned")


# One assembly buffer and one staging buffer per process, reused across pieces and tensors.
_ASSEMBLY = Scratch()
_STAGING = Scratch()


def _fill_tensor(sink, p: ParamPlan, sources: SourceFiles, max_memory: int, progress: Progress | None) -> None:
    storage = dtypes.BY_NAME[p.dtype].storage
    shape = p.target_shape
    row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * storage.itemsize if shape else storage.itemsize
    budget = max(storage.itemsize, max_memory // 2)
    whole = tuple((0, n) for n in shape)
    for piece in split_rows(whole, row_bytes, budget):
        buf = _ASSEMBLY.array(box_shape(piece), storage)
        for c in p.copies:
            overlap = intersect(c.target_box, piece) if piece else ()
            if overlap is None:
                continue
            src_box = tuple((sa + (oa - ta), sa + (ob - ta)) for (sa, _), (ta, _), (oa, ob) in
                            zip(c.source_box, c.target_box, overlap))
            index = tuple(slice(a - pa, b - pa) for (a, b), (pa, _) in zip(overlap, piece))
            view = buf[index] if index else buf  # a 0-d array indexed by () would give a scalar copy
            reader = sources.reader(c.source_rank)
            _check_source(reader, p, src_box)
            if view.flags.c_contiguous:
                reader.read_box(p.name, src_box, out=view)
            else:  # stage the box contiguously, then place it
                staged = _STAGING.array(box_shape(src_box), storage)
                view[...] = reader.read_box(p.name, src_box, out=staged)
        sink.write(buf.reshape(-1).view(np.uint8))
        if progress:
            progress(buf.nbytes)


def run_rank_task(task: "RankTask", *, sources: SourceFiles | None = None,
                  progress: Progress | None = None) -> "RankResult":
    """Produce one target file from a ``RankTask``; `sources` may hold already-open readers."""
    import socket
    import time

    from .tasks import RankResult

    started = time.monotonic()
    own = sources is None
    readers = SourceFiles(dict(task.sources), verify_crc=False) if own else sources
    try:
        written = execute_rank(task.plan, readers, task.out_path, fmt=task.options.format,
                               max_memory=task.options.max_memory, crc=task.options.crc, progress=progress)
    finally:
        if own:
            readers.close()
    return RankResult(task.target_rank, written.path, written.size, written.sha256, dict(written.tensors),
                      task.plan.bytes_read, time.monotonic() - started, socket.gethostname())
