"""The index of an export for inference, as ``transformers`` writes and reads it:
``model.safetensors.index.json`` = ``{"metadata": {"total_size": <bytes>}, "weight_map": {<tensor>:
<shard file>}}`` beside shards named ``model-00001-of-00003.safetensors``. Bytes <-> values only.
"""

from __future__ import annotations

import json
import os
import re

from reshard_job.errors import FormatError

INDEX_FILE = "model.safetensors.index.json"
MAX_INDEX_BYTES = 1024**3  # an index larger than this is not one
SHARD_FILE = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")
# the shards' safetensors __metadata__: transformers loads only files whose format it knows
EXPORT_METADATA = {"format": "pt"}


def parse_index(data: bytes, path: str) -> dict[str, str]:
    """The weight map (tensor -> shard file) of an index document's bytes, checked for shape."""
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise FormatError(path, f"cannot be read as JSON ({e})") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise FormatError(path, "expected an object with a 'weight_map' of tensor names to file names")
    bad = next((v for v in weight_map.values() if os.path.basename(v) != v or v in ("", ".", "..")), None)
    if bad is not None:
        raise FormatError(path, f"weight_map names {bad!r}, which is not a file of the export folder")
    return weight_map


def check_against_index(reader, weight_map: dict[str, str], index_path: str) -> None:
    """Every tensor of an export folder's shards (one ``MultiFileReader``) is where the index says,
    and every tensor the index lists is there."""
    for name in reader.names():
        where = os.path.basename(reader.file_of(name))
        if weight_map.get(name) != where:
            raise FormatError(index_path, f"tensor {name!r} is in {where} but the index "
                                          f"says {weight_map.get(name) or 'nothing about it'}")
    absent = [n for n in weight_map if n not in reader]
    if absent:
        raise FormatError(index_path, f"lists tensor {absent[0]!r} in {weight_map[absent[0]]}, which lacks it")
