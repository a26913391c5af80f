"""Executing a plan: read only the needed boxes of the needed files, write each target rank's file.

Memory is bounded by the slice in flight, not by the model or the file size: a target tensor is
produced in row blocks of at most ``max_memory / 2`` bytes (the other half is for a read buffer
when a source box does not land contiguously in the block), each block is filled from the source
boxes that meet it with positioned reads, then streamed to the output, which hashes it on the way.
A tensor copied unchanged is streamed in fixed-size blocks without being interpreted at all.

Nothing here knows about configuration, databases or progress bars; a callback reports bytes.
"""

from __future__ import annotations

import socket
import time
from typing import Callable

import numpy as np

from reshard_job.errors import FormatError
import reshard_job.core.dtypes as dtypes
from reshard_job.formats.base import TensorDecl, TensorReader
from reshard_job.core.boxes import Box, box_shape, intersect, split_rows
from reshard_job.formats.tensor_digests import TensorDigests
from reshard_job.formats.registry import open_writer
from reshard_job.formats.tensorfile import KIND_MAP, KIND_STR, KIND_TENSOR, Scratch
from reshard_job.plan.model import ACTION_COPY, ParamPlan, ParamPlans, RankPlan
from reshard_job.execute.read_ahead import announce
from reshard_job.sources.open_files import SourceFiles
from reshard_job.execute.tasks import FORMAT_CKPT, RankResult, RankTask
from reshard_job.execute.small_copies import WholeCopies
from reshard_job.execute.writer_tap import WriterTap

DEFAULT_MAX_MEMORY = 32 * 1024 * 1024
KNOWN_FACTS = 1 << 16  # distinct (plan slice, tensor kind) facts kept while a rank is written
COPY_BLOCK = 4 * 1024 * 1024

Progress = Callable[[int], None]


def execute_rank(
    rank_plan: RankPlan,
    sources: SourceFiles,
    out_path: str,
    *,
    fmt: str = FORMAT_CKPT,
    max_memory: int = DEFAULT_MAX_MEMORY,
    crc: bool = False,
    progress: Progress | None = None,
    metadata: dict | None = None,
    publish_later: bool = False,
    tap: WriterTap | None = None,
):
    """Write one target rank's file from its plan; atomic (published only when complete).

    Returns the ``WrittenFile``; with `publish_later`, (WrittenFile, handle) where the file is
    complete but not yet durable nor visible until ``handle.publish()`` (handle None: published).
    `tap`: fed the bytes of the tensors this rank counts (``execute.writer_tap``)."""
    writer = open_writer(out_path, fmt, crc=crc, metadata=metadata, storage=getattr(sources, "storage", None))
    if tap is not None:
        writer.fingerprint_tap = tap
    try:
        write_params(writer, rank_plan, sources, max_memory=max_memory, progress=progress)
        if publish_later and hasattr(writer, "seal"):
            return writer.seal()
        written = writer.commit()
        return (written, None) if publish_later else written
    except BaseException:
        writer.abort()
        raise


def write_params(writer, rank_plan: RankPlan, sources: SourceFiles, *, max_memory: int = DEFAULT_MAX_MEMORY,
                 progress: Progress | None = None) -> None:
    """Feed every parameter of `rank_plan` to `writer` (a file writer, or anything with the same
    calls: ``arrange``, ``add_bytes``, ``add_str``, ``add_map``, ``begin``), reading the sources as
    the plan says, in bounded memory."""
    params = rank_plan.params
    tap = getattr(writer, "fingerprint_tap", None)
    counted = rank_plan.counts if tap is not None else None
    if getattr(writer, "writes_in_given_order", False) and isinstance(params, ParamPlans):
        _write_in_order(writer, params, sources, max_memory, progress, counted)
        return
    by_name = {p.name: p for p in params}  # ParamPlan views are made on access: once each
    order = writer.arrange([TensorDecl(p.name, p.dtype, p.target_shape, p.kind) for p in by_name.values()])
    for name in order:
        p = by_name[name]
        if counted is not None and counted(p.place):
            tap.expect(p.name, p.dtype, p.kind, p.global_shape, p.target_shape, p.place.origin)
        _write_param(writer, p, sources, max_memory, progress)


def run_rank_task(task: RankTask, *, sources: SourceFiles | None = None,
                  progress: Progress | None = None, publish_later: bool = False):
    """Produce one target file from a ``RankTask``; `sources` may hold already-open readers.

    The sources are checked against the identities the job hashed, before the first read and
    after the last, so a file changed under the job fails the task instead of feeding it.
    With `publish_later`, returns (RankResult, handle): see ``execute_rank``.
    """
    started = time.monotonic()
    handle = None
    own = sources is None
    readers = sources if sources is not None else SourceFiles(
        dict(task.sources), verify_crc=False, identities=task.source_identities, storage=task.storage,
        names=task.names or None)
    try:
        opts = task.options
        # object stores fetch the announced ranges in batches instead of one request per read
        announce(task.plan, {r: readers.reader(r) for r in task.sources}, opts.max_memory)
        tap = WriterTap() if opts.fingerprints and task.plan.counting is not None else None
        written = execute_rank(task.plan, readers, task.out_path, fmt=opts.format, max_memory=opts.max_memory,
                               crc=opts.crc, progress=progress, metadata=opts.metadata,
                               publish_later=publish_later, tap=tap)
        if publish_later:
            written, handle = written
        readers.check_unchanged()
    except BaseException:
        if handle is not None:
            handle.abort()  # written from sources that changed since: never published
        if not own:
            raise
        readers.close()
        raise
    if own:
        readers.close()
    tensors = written.tensors  # the finished writer's own dict: no copy (a million digests, many small tensors)
    result = RankResult(task.target_rank, written.path, written.size, written.sha256,
                        tensors if isinstance(tensors, (dict, TensorDigests)) else dict(tensors),
                        task.plan.bytes_read, time.monotonic() - started, socket.gethostname(), task.part,
                        tap.result() if tap is not None else None)
    return (result, handle) if publish_later else result


def _write_in_order(writer, params: ParamPlans, sources: SourceFiles, max_memory: int,
                    progress: Progress | None, counted: Callable | None = None) -> None:
    """Every parameter, in plan order, into a writer that stores them in the order given.

    A model of many small parameters pays per parameter, not per byte: a small tensor copied whole
    from one source tensor stored in one record (experts and their optimizer states, mostly) is
    written with the others of its run (``small_copies``), read from the source with them and
    written as one record each, without a ParamPlan view or an assembly buffer. Anything else, or a
    source entry that is not what the plan expects, goes through ``_write_param``, which reads,
    checks and refuses in detail."""
    # (id of a plan slice, dtype, kind, global shape) -> (its source extents when a whole small
    # copy, else None; whether counted; its tap spec): slices and shapes live as long as `params`
    known: dict[tuple, tuple] = {}
    tap = writer.fingerprint_tap if counted is not None else None

    def the_long_way(tensor, piece) -> None:
        _write_param(writer, ParamPlan._shared(tensor, *piece), sources, max_memory, progress)

    copies = WholeCopies(writer, sources, the_long_way, progress)
    for tensor, piece in zip(params.tensors, params.slices):
        key = (id(piece), tensor.dtype, tensor.kind, tensor.global_shape)
        facts = known.get(key)
        if facts is None:
            if len(known) >= KNOWN_FACTS:  # (a model of as many slices as parameters: bounded all the same)
                known.clear()
            facts = known[key] = _facts_of(tensor, piece, tap, counted)
        extents, counts, spec = facts
        if extents is not None:
            copies.add(tensor, piece, extents, spec)  # the tap told of it with the run
            continue
        if counts:
            tap.expect_spec(tensor.name, spec)
        copies.flush()
        the_long_way(tensor, piece)
    copies.flush()


def _facts_of(tensor, piece: tuple, tap: WriterTap | None, counted: Callable | None) -> tuple:
    """(source extents of a whole small copy of a tensor or None, whether counted here, tap spec)."""
    counts = tap is not None and counted(piece[3] if len(piece) > 3 else None)
    spec = tap.spec_for(tensor.dtype, tensor.kind, tensor.global_shape, piece[0], piece[3].origin) if counts else None
    whole = tensor.kind == KIND_TENSOR and tensor.itemsize
    return (_whole_small_copy(piece) if whole else None), counts, spec


def _whole_small_copy(piece: tuple) -> tuple | None:
    """For a plan slice (target shape, copies, nbytes) that copies one whole source tensor into the
    whole target tensor, small enough to write as one record: the source tensor's extents."""
    target_shape, copies, nbytes = piece[:3]
    if not 0 < nbytes <= SMALL_TENSOR or len(copies) != 1:
        return None
    c = copies[0]
    if c.target_box != _full(target_shape) or any(lo for lo, _ in c.source_box):
        return None
    return tuple(hi for _, hi in c.source_box)


def _write_str(writer, reader, name: str) -> None:
    """A str entry, a block at a time where the writer takes it so (a .ckpt's may be hundreds of MB)."""
    if hasattr(reader, "iter_str_bytes") and hasattr(writer, "add_str_blocks"):
        writer.add_str_blocks(name, reader.iter_str_bytes(name, COPY_BLOCK), reader.entries[name].stored_bytes)
    else:
        writer.add_str(name, reader.read_str(name))


def _write_param(writer, p: ParamPlan, sources: SourceFiles, max_memory: int, progress: Progress | None) -> None:
    if p.kind == KIND_STR:
        _write_str(writer, sources.reader(p.copies[0].source_rank), p.name)
        return
    if p.kind == KIND_MAP:
        writer.add_map(p.name, sources.reader(p.copies[0].source_rank).map_records(p.name))
        return
    if p.nbytes <= SMALL_TENSOR and p.action != ACTION_COPY and dtypes.BY_NAME[p.dtype].sliceable:
        writer.add_bytes(p.name, p.dtype, p.target_shape, _small_tensor(p, sources))
        if progress:
            progress(p.nbytes)
        return
    sink = writer.begin(p.name, p.dtype, p.target_shape)
    if p.action == ACTION_COPY or not dtypes.BY_NAME[p.dtype].sliceable:
        reader = sources.reader(p.copies[0].source_rank)
        entry = _check_source(reader, p, p.copies[0].source_box)
        room = getattr(sink, "room", None)
        if room is not None and room() > 0 and hasattr(reader, "read_logical") \
                and getattr(entry, "stored_bytes", -1) == sink.total:
            _copy_in_place(sink, reader, entry, progress)
        else:
            for block in reader.iter_content(p.name, COPY_BLOCK):
                sink.write(block)
                if progress:
                    progress(len(block))
    else:
        _fill_tensor(sink, p, sources, max_memory, progress)
    sink.close()


def _copy_in_place(sink, reader, entry, progress: Progress | None) -> None:
    """A tensor copied whole, read straight into the output's staging space (no block copy)."""
    done, total = 0, sink.total
    while done < total:
        n = min(sink.room(), total - done)
        if n <= 0:  # cannot happen while bytes are due; never spin
            raise RuntimeError(f"parameter {entry.name!r}: the output took {done} of {total} bytes")
        reader.read_logical(entry, done, sink.reserve(n))
        sink.commit(n)
        done += n
        if progress:
            progress(n)


def _check_source(reader: TensorReader, p: ParamPlan, box: Box):
    """The plan was made from this file's index; re-check in case the file changed since. Returns the entry."""
    if p.name not in reader:
        raise FormatError(reader.path, f"parameter {p.name!r} disappeared from the file since it was planned")
    e = reader[p.name]
    if e.dtype != p.dtype or any(b > n for (_, b), n in zip(box, e.shape)) or len(box) != len(e.shape):
        raise FormatError(reader.path, f"parameter {p.name!r} changed since it was planned")
    return e


SMALL_TENSOR = 256 * 1024  # assembled whole in memory and written as one record


def _full(shape) -> tuple:
    return tuple((0, n) for n in shape)


def _small_tensor(p: ParamPlan, sources: SourceFiles) -> np.ndarray:
    """A small target tensor assembled in one buffer: per-tensor overhead is what a model of many
    small parameters pays for, so each source entry is looked up once and whole boxes are one read."""
    storage = dtypes.BY_NAME[p.dtype].storage
    buf = _ASSEMBLY.array(p.target_shape, storage)
    if len(p.copies) == 1:  # the commonest case: one whole source tensor, one positioned read
        c = p.copies[0]
        reader = sources.reader(c.source_rank)
        span = reader.whole_span(p.name) if hasattr(reader, "whole_span") else None
        if (span is not None and span[0] == p.dtype and c.source_box == _full(span[1])
                and c.target_box == _full(p.target_shape) and span[3] == buf.nbytes):
            reader.pread_into(span[2], memoryview(buf.reshape(-1).view(np.uint8)))
            return buf.reshape(-1).view(np.uint8)
    entries: dict[int, object] = {}
    for c in p.copies:
        reader = sources.reader(c.source_rank)
        entry = entries.get(c.source_rank)
        if entry is None:
            entry = entries[c.source_rank] = _check_source(reader, p, c.source_box)
        elif any(b > n for (_, b), n in zip(c.source_box, entry.shape)):
            raise FormatError(reader.path, f"parameter {p.name!r} changed since it was planned")
        if (len(p.copies) == 1 and c.source_box == _full(entry.shape) and c.target_box == _full(p.target_shape)
                and hasattr(reader, "read_logical")):
            reader.read_logical(entry, 0, memoryview(buf.reshape(-1).view(np.uint8)))  # the whole tensor
            continue
        index = tuple(slice(a, b) for a, b in c.target_box)
        view = buf[index] if index else buf
        read = getattr(reader, "read_entry_box", None)
        out = view if view.flags.c_contiguous else _STAGING.array(box_shape(c.source_box), storage)
        got = read(entry, c.source_box, out=out) if read is not None else reader.read_box(p.name, c.source_box, out=out)
        if out is not view:
            view[...] = got
    return buf.reshape(-1).view(np.uint8)


# One assembly buffer and one staging buffer per process, reused across pieces and tensors.
_ASSEMBLY = Scratch()
_STAGING = Scratch()


def _fill_tensor(sink, p: ParamPlan, sources: SourceFiles, max_memory: int, progress: Progress | None) -> None:
    storage = dtypes.BY_NAME[p.dtype].storage
    shape = p.target_shape
    row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * storage.itemsize if shape else storage.itemsize
    budget = max(storage.itemsize, max_memory // 2)
    whole = tuple((0, n) for n in shape)
    room = getattr(sink, "room", None)
    if room is not None and shape and row_bytes and room() > 0:
        _fill_in_place(sink, p, sources, storage, row_bytes, budget, progress)
        return
    for piece in split_rows(whole, row_bytes, budget):
        _assemble_and_write(sink, p, sources, storage, piece, row_bytes, budget, progress)


def _fill_in_place(sink, p: ParamPlan, sources: SourceFiles, storage, row_bytes: int, budget: int,
                   progress: Progress | None) -> None:
    """Whole rows read straight into the output's staging space (no assembly copy); only the rows
    that straddle a staging block, or rows larger than one, go through the assembly buffer."""
    shape = p.target_shape
    rest = tuple((0, n) for n in shape[1:])
    budget_rows = max(1, budget // row_bytes)
    row = 0
    while row < shape[0]:
        room = sink.room()
        if room >= row_bytes:
            n = min(room // row_bytes, budget_rows, shape[0] - row)
            piece = ((row, row + n),) + rest
            buf = np.frombuffer(sink.reserve(n * row_bytes), dtype=storage).reshape(box_shape(piece))
            try:
                _fill_piece(buf, p, sources, storage, piece)
            finally:
                del buf  # the staging space must not stay exported once committed
            sink.commit(n * row_bytes)
            if progress:
                progress(n * row_bytes)
        else:
            n = 1
            _assemble_and_write(sink, p, sources, storage, ((row, row + 1),) + rest, row_bytes, budget, progress)
        row += n


def _assemble_and_write(sink, p: ParamPlan, sources: SourceFiles, storage, box, row_bytes: int, budget: int,
                        progress: Progress | None) -> None:
    for piece in split_rows(box, row_bytes, budget):
        buf = _ASSEMBLY.array(box_shape(piece), storage)
        _fill_piece(buf, p, sources, storage, piece)
        sink.write(buf.reshape(-1).view(np.uint8))
        if progress:
            progress(buf.nbytes)


def _fill_piece(buf: np.ndarray, p: ParamPlan, sources: SourceFiles, storage, piece) -> None:
    """Fill `buf` (shaped as `piece`, a box of the target tensor) from the plan's copies."""
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

