"""The index of an export for inference, as ``transformers`` writes and reads it:
``model.safetensors.index.json`` = ``{"metadata": {"total_size": <bytes>}, "weight_map": {<tensor>:
<shard file>}}`` beside shards named ``model-00001-of-00003.safetensors``. Bytes <-> values only.

``total_size`` is what ``huggingface_hub``'s ``split_torch_state_dict_into_shards`` (which
``transformers``' ``save_pretrained`` calls) adds up: every tensor's bytes (elements times item
size; tensors sharing storage, which safetensors files cannot hold twice, once). Some tools write
the shards' file sizes instead, headers included; both are accepted, anything else is refused by
``check_against_index``: an index that does not describe its shards' bytes belongs to other shards.
An index without ``metadata`` or ``total_size`` is accepted (``transformers`` reads only the
weight map).

The document is read a window at a time (``json_stream.JsonStream``), so a weight map of a million
tensors costs what is kept of it (shard names are shared), and a padded or sparse file is refused
by its size before it is read: see ``index_size_limit``.
"""

from __future__ import annotations

import io
import os
import re
import sys
from dataclasses import dataclass

from reshard_job.errors import FormatError
from reshard_job.formats.safetensors.header import header_scaled_limit
from reshard_job.json_stream import JsonProblem, JsonStream

INDEX_FILE = "model.safetensors.index.json"
# MindSpore's name -> shard map beside unified shards: load_distributed_checkpoint(unified_safetensors_dir=...)
# needs it when the folder holds several .safetensors files (one file is mapped by itself). Its loader
# takes the object's "weight_map" if present (else the object itself) as name -> file name in the folder;
# unified_safetensors writes {"metadata": {"total_size": <bytes>}, "weight_map": {...}} with indent 4.
PARAM_NAME_MAP_FILE = "param_name_map.json"
SHARD_FILE = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")
# the shards' safetensors __metadata__: transformers loads only files whose format it knows
EXPORT_METADATA = {"format": "pt"}
# How large an index may be: its weight map names each tensor of the shards once, and a tensor's
# entry there ("<name>": "<shard file>") is about as long as its entry in a shard's header (name,
# dtype, shape, offsets). So: 16 MiB, plus 4 bytes per byte of each shard up to MAX_HEADER_BYTES.
INDEX_BASE_BYTES = 16 << 20
INDEX_BYTES_PER_HEADER_BYTE = 4
# How long a shard's header may be, from the index: each tensor the index lists in the shard is one
# header entry (its name, at most 12 characters for each of its own once escaped, then a dtype, at
# most 64 dims and two offsets of at most 20 digits each: under 2 KiB), and the __metadata__ and the
# padding are allowed 16 MiB together. A longer header describes tensors the index does not list:
# refused before it is parsed (a 100 MB one of a million empty tensors took 20 s and 640 MB to parse).
SHARD_ENTRY_BYTES = 2048
SHARD_EXTRA_BYTES = 16 << 20


@dataclass(frozen=True)
class ExportIndex:
    """What an index says: where each tensor is, and the total size it declares (None: none)."""

    weight_map: dict[str, str]
    total_size: int | None = None


def index_size_limit(shard_sizes) -> tuple[int, str]:
    """(bytes, why) an index beside .safetensors files of `shard_sizes` bytes may have."""
    return header_scaled_limit(shard_sizes, INDEX_BASE_BYTES, INDEX_BYTES_PER_HEADER_BYTE, "the folder's")


def shard_header_limit(names) -> int:
    """The most header bytes a shard holding the tensors `names` (as its index lists them) can need."""
    return SHARD_EXTRA_BYTES + sum(12 * len(name) + SHARD_ENTRY_BYTES for name in names)


def parse_index(data: bytes, path: str) -> dict[str, str]:
    """The weight map (tensor -> shard file) of an index document's bytes, checked for shape."""
    return read_index_document(io.BytesIO(data).read, path).weight_map


def read_index_document(read, path: str) -> ExportIndex:
    """The index `read` (``read(n) -> bytes``) yields, read a window at a time and checked for shape."""
    stream = JsonStream(read)
    weight_map = metadata = None
    try:
        if not stream.peek():
            raise FormatError(path, "is empty (expected an object with a 'weight_map')")
        if stream.peek() != "{":
            raise FormatError(path, "expected an object with a 'weight_map' of tensor names to file names")
        for key in stream.members():
            if key == "weight_map" and weight_map is None and stream.peek() == "{":
                weight_map = _read_weight_map(stream, path)
            elif key == "metadata" and metadata is None:
                metadata = stream.value()
            elif key in ("weight_map", "metadata"):
                raise FormatError(path, f"expected {key!r} once, as an object")
            else:
                stream.value()  # other keys (a tool's notes): read past them
        stream.end()
    except JsonProblem as e:
        text = str(e)
        raise FormatError(path, text if text.startswith("not valid") else f"cannot be read as JSON ({text})") from None
    if weight_map is None:
        raise FormatError(path, "expected an object with a 'weight_map' of tensor names to file names")
    if not weight_map:
        raise FormatError(path, "'weight_map' names no tensor (an export holds at least one)")
    return ExportIndex(weight_map, _total_size(metadata, path))


def _read_weight_map(stream: JsonStream, path: str) -> dict[str, str]:
    weight_map: dict[str, str] = {}
    files: dict[str, str] = {}  # one object per shard name
    for name, file_name, _ in stream.items():
        if not isinstance(file_name, str):
            raise FormatError(path, "expected an object with a 'weight_map' of tensor names to file names")
        if name in weight_map:
            raise FormatError(path, f"weight_map lists tensor {name[:80]!r} twice")
        if file_name not in files:
            if (os.path.basename(file_name) != file_name or file_name in ("", ".", "..") or "\0" in file_name
                    or len(file_name) > 255):
                raise FormatError(path, f"weight_map names {file_name[:80]!r}, which is not a file of the export folder")
            files[file_name] = file_name
        weight_map[sys.intern(name)] = files[file_name]
    return weight_map


def _total_size(metadata, path: str) -> int | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise FormatError(path, "'metadata' must be an object (with 'total_size')")
    total = metadata.get("total_size")
    if total is None:
        return None
    if isinstance(total, float) and total.is_integer():
        total = int(total)  # some tools write sizes as floats
    if not isinstance(total, int) or isinstance(total, bool) or total < 0:
        raise FormatError(path, f"metadata.total_size must be a non-negative number of bytes, got {str(total)[:40]}")
    return total


def check_against_index(reader, index: ExportIndex | dict[str, str], index_path: str) -> None:
    """Every tensor of an export folder's shards (one ``MultiFileReader``) is where the index says,
    every tensor the index lists is there, and the index's total size is the shards' (see the
    module docstring)."""
    if not isinstance(index, ExportIndex):
        index = ExportIndex(index)
    weight_map = index.weight_map
    tensor_bytes = 0
    for name in reader.names():
        where = os.path.basename(reader.file_of(name))
        if weight_map.get(name) != where:
            raise FormatError(index_path, f"tensor {name!r} is in {where} but the index "
                                          f"says {weight_map.get(name) or 'nothing about it'}")
        tensor_bytes += reader.describe(name)[3]
    absent = [n for n in weight_map if n not in reader]
    if absent:
        raise FormatError(index_path, f"lists tensor {absent[0]!r} in {weight_map[absent[0]]}, which lacks it")
    if index.total_size is not None and index.total_size not in (tensor_bytes, reader.size):
        raise FormatError(index_path, f"metadata.total_size says {index.total_size} bytes, but the tensors of its "
                                      f"{len(reader.paths)} shard(s) hold {tensor_bytes} bytes (the files "
                                      f"{reader.size}); the index describes other shards, or was edited")
