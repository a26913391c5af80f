"""Rewriting a checkpoint file unchanged through the streaming path: the round-trip check.

``copy_checkpoint`` reproduces a `.ckpt` record for record (same chunking, same order, same
per-record dims and dtype, same CRC trailer) and ``copy_safetensors`` a safetensors file tensor
for tensor (same metadata and ``crc_num``). Byte-identical copies of MindSpore's files are how the
writers are shown to write exactly what MindSpore writes.
"""

from __future__ import annotations

import os

from reshard_job.formats.base import WrittenFile
from reshard_job.formats.ckpt import KIND_MAP, CheckpointReader, CheckpointWriter
from reshard_job.formats.safetensors import CRC_KEY, INT4_MARK, SafetensorsReader, SafetensorsWriter


def copy_checkpoint(reader: CheckpointReader, path: str | os.PathLike, *, crc: bool | None = None) -> WrittenFile:
    """Rewrite a checkpoint record for record (same chunking, same order): the round-trip path."""
    with CheckpointWriter(path, crc=reader.has_crc if crc is None else crc) as w:
        for entry in reader.groups:
            if entry.kind == KIND_MAP:
                w.add_map(entry.name, [[(p.dims, p.dtype, reader.pread(p.content_offset, p.content_len))
                                        for p in parts] for parts in reader.map_parts_of(entry)])
                continue
            # tensors and str entries alike: same records, same dims and dtype per record
            sink = w.begin_records(entry.name, [(r.dims, r.dtype, r.content_len) for r in reader.records_of(entry)])
            for block in reader.iter_entry(entry):
                sink.write(block)
            sink.close()
    return w.result


def copy_safetensors(reader: SafetensorsReader, path: str | os.PathLike, *, mode: int = 0o444) -> WrittenFile:
    """Rewrite a file tensor by tensor through the streaming path (same tensors, metadata and CRC)."""
    meta = reader.metadata
    if reader.has_metadata:
        meta.pop(CRC_KEY, None)
        for name, e in reader.entries.items():
            if e.dtype == INT4_MARK:
                meta.pop(name, None)
    else:
        meta = None
    crc = reader.stored_crc() if reader.has_crc else False
    with SafetensorsWriter(path, metadata=meta, mindspore=False, crc=crc, mode=mode) as w:
        for name, e in reader.entries.items():
            w.declare(name, e.dtype, e.shape)
        for name in w.data_order():
            sink = w.begin(name)
            for block in reader.iter_content(name):
                sink.write(block)
            sink.close()
    return w.result
