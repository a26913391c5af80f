"""Safetensors files, plain and as MindSpore writes them: an indexing reader and a streaming writer.

A safetensors file is an 8-byte little-endian header length ``n``, ``n`` bytes of JSON header
(``{"__metadata__": {str: str}, name: {"dtype", "shape", "data_offsets"}, ...}``, padded with
spaces), then the data section, every tensor's bytes in C order at ``8 + n + begin``.

Reading. ``SafetensorsReader`` parses and validates the header only (at most 100 MB, the limit the
``safetensors`` library and MindSpore's ``_fast_safe_open`` both enforce, read in windows into
compact columns) and serves ``entries`` in data-offset order; tensors and boxes are then served by
``PositionedReader`` with positioned reads, so a box of a large tensor costs about the box's bytes,
never the file. Everything that can be wrong with the input (length prefix, UTF-8, JSON, integers of
absurd length, dtypes, shapes no array can have, offsets, ``crc_num``) is reported as
``SafetensorsFormatError`` naming the file and, where there is one, the tensor. Shapes are kept
exactly as declared: a zero-size tensor keeps its dims, within int64 and numpy's bound on the bytes
its non-zero dims describe (``core.sizes.shape_problem``). Offsets must tile the data section exactly (no gap, no overlap, nothing after the last
tensor) as both the library and MindSpore require; a file that breaks this would be refused by
whatever consumes our output, so accepting it here would only move the failure.

MindSpore flavour (spec: checkpoint-format §10): ``save_checkpoint(format="safetensors")`` goes
through ``safetensors.numpy.save_file`` and adds ``__metadata__`` entries: ``"format": "ms"``,
optionally ``"remove_redundancy"``, ``"crc_num"`` (zlib CRC32 chained over every tensor in sorted
name order, first the UTF-8 name, then ``bytes()`` of its numpy array: the raw bytes, except that a
0-d integer holding ``n`` counts as ``n`` zero bytes, see ``formats.crc32``) and ``"<name>": "Int4"``
for each qint4x2 tensor. The reader turns such a marker into dtype ``Int4`` (one byte, two 4-bit
values, per element of the stored shape: sliced like Int8, see ``core.dtypes``) and checks
``crc_num`` when asked to.

Writing: why declare-then-stream. The header, which holds every tensor's offsets, precedes the
data, so the complete list of tensors (names, dtypes, shapes) must be known before the first data
byte is written, but the data itself need not be: ``declare`` every tensor, then stream each one's
bytes through ``begin(name)`` in file order (``data_order()``), so memory stays at the caller's
buffers no matter how large the file. ``add`` is the small-file convenience: it copies the array
and writes it when its turn in file order comes (at the latest on ``commit``).

The layout is the ``safetensors`` library's, so that for the same tensors our bytes equal
``save_file``'s: tensors sorted by descending dtype alignment (the order of the library's ``Dtype``
enum), then by name (byte-wise UTF-8, which is Python's ``str`` order); compact JSON with
``__metadata__`` first, then tensors in file order, each as ``dtype``, ``shape``,
``data_offsets``; non-ASCII characters written raw and control characters escaped as serde_json
does; the header padded with spaces to a multiple of 8. One thing cannot be matched: the library
keeps metadata in a hash map, so with two or more metadata keys its key order varies from run to
run. We write metadata keys sorted, which makes our output deterministic; files with zero or one
metadata key are byte-identical to the library's.

The CRC and the header. ``crc_num`` depends on all the data but sits in the header, before it.
* If every tensor was given with ``add`` (in memory), the CRC is computed before the header is
  written: one pass, bytes exactly as MindSpore writes them.
* ``crc=<int>``: the caller already knows the value (e.g. copying a file whose CRC was verified).
  It is written straight away and checked against the streamed data on ``commit``.
* ``crc=True`` while streaming: the header is written with room for the widest CRC (10 digits),
  the data is streamed (the CRC of each tensor computed on the way and chained in sorted-name order
  at the end with ``crc32_combine``), then the real header is written over the reserved one and
  padded with spaces to the reserved length, which JSON ignores. The file's sha256 is then computed
  by reading it back once, because the header bytes changed after they were hashed. The result is
  read by MindSpore and the library alike; it is byte-identical to MindSpore's own file whenever
  the real CRC's digits fit in the same multiple of 8 (most of the time: three quarters of all
  CRC values have 10 digits), otherwise it differs only in the amount of header padding.
"""

from reshard_job.formats.safetensors.header import CRC_KEY, FORMAT_KEY, INT4_MARK, MAX_HEADER_BYTES, METADATA_KEY
from reshard_job.formats.safetensors.reader import SafetensorsReader
from reshard_job.formats.safetensors.writer import SafetensorsWriter, TensorSink, save_file
from reshard_job.formats.crc32 import chain_crc, crc32_combine

__all__ = [
    "CRC_KEY", "FORMAT_KEY", "INT4_MARK", "MAX_HEADER_BYTES", "METADATA_KEY", "SafetensorsReader",
    "SafetensorsWriter", "TensorSink", "chain_crc", "crc32_combine", "save_file",
]
