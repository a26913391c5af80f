"""The safetensors header: constants shared by the reader and the writer, and how the writer
builds a header (dtypes resolved to codes, the metadata, the JSON) byte for byte as the library does."""

from __future__ import annotations

import json
from dataclasses import dataclass

from reshard_job.errors import LayoutError
import reshard_job.core.dtypes as dtypes

MAX_HEADER_BYTES = 100_000_000  # the safetensors library's MAX_HEADER_SIZE; MindSpore uses the same
METADATA_KEY = "__metadata__"
INT4_MARK = "Int4"
CRC_KEY = "crc_num"
FORMAT_KEY = "format"
MINDSPORE_FORMAT = "ms"
REDUNDANCY_KEY = "remove_redundancy"
# what save_checkpoint(..., format="safetensors", remove_redundancy=True) puts in __metadata__
DEDUPLICATED_METADATA = {FORMAT_KEY: MINDSPORE_FORMAT, REDUNDANCY_KEY: "True"}
CRC_WIDTH = 10  # decimal digits of the largest CRC32 value, 4294967295

# The safetensors library's Dtype enum in declaration (= increasing alignment) order, restricted to
# the codes we read and write. The library lays tensors out by descending position here, then name.
LIBRARY_DTYPE_ORDER = [
    "BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3",
    "I16", "U16", "F16", "BF16",
    "I32", "U32", "F32",
    "C64", "F64", "I64", "U64",
]
DTYPE_RANK = {code: i for i, code in enumerate(LIBRARY_DTYPE_ORDER)}
# Int4 has no safetensors code: MindSpore hands the packed bytes to numpy, which stores them as
# one-byte integers, and marks the name in the metadata.
INT4_STORAGE_CODE = "I8"


@dataclass
class DeclaredTensor:
    name: str
    dtype: str  # MindSpore name
    code: str  # safetensors code written to the header
    shape: tuple[int, ...]
    nbytes: int


def resolve_dtype(name: str, dtype: str) -> tuple[str, str, int]:
    """(MindSpore name, safetensors code, itemsize) for a dtype given by MindSpore name or code."""
    if dtype == dtypes.STR_TYPE:
        raise LayoutError(
            f"parameter {name!r}: str entries cannot be stored in safetensors (MindSpore refuses them too)"
        )
    if dtype == INT4_MARK:
        return INT4_MARK, INT4_STORAGE_CODE, 1
    dt = dtypes.BY_NAME.get(dtype)
    if dt is None:
        try:
            dt = dtypes.from_safetensors(dtype)
        except KeyError:
            raise LayoutError(f"parameter {name!r}: unknown dtype {dtype!r}") from None
    if dt.safetensors not in DTYPE_RANK:
        raise LayoutError(
            f"parameter {name!r}: dtype {dt.name} has no code the safetensors format knows "
            f"({dt.safetensors or 'none'}), so it cannot be written as safetensors"
        )
    return dt.name, dt.safetensors, dt.itemsize


def json_str(s: str) -> str:
    # ensure_ascii=False: raw UTF-8, only '"', '\\' and control characters escaped (lowercase
    # \u00xx), which is exactly what serde_json produces
    return json.dumps(s, ensure_ascii=False)


def header_metadata(user_metadata: dict[str, str] | None, decls: dict[str, DeclaredTensor], *, mindspore: bool,
                    crc_text: str | None) -> dict[str, str] | None:
    """The ``__metadata__`` a writer puts in its header: the user's entries, and, where there are
    tensors, ``format`` (``mindspore``; a user's value wins), Int4 markers and ``crc_num``."""
    if mindspore and not decls:
        return None  # MindSpore saves an empty dict without any metadata (spec §10)
    meta = None if user_metadata is None else dict(user_metadata)
    if decls:
        auto: dict[str, str] = {}
        if mindspore:
            auto[FORMAT_KEY] = MINDSPORE_FORMAT
        for d in decls.values():
            if d.dtype == INT4_MARK:
                auto[d.name] = INT4_MARK
        if crc_text is not None:
            auto[CRC_KEY] = crc_text
        if auto:
            meta = meta or {}
            for k, v in auto.items():
                if k == FORMAT_KEY:
                    meta.setdefault(k, v)
                else:
                    meta[k] = v
    if meta:
        # a user key that names a tensor would be read back as (or as not) an Int4 marker
        for k, v in meta.items():
            d = decls.get(k)
            if d is not None and (v == INT4_MARK) != (d.dtype == INT4_MARK):
                raise ValueError(
                    f"metadata key {k!r} names a {d.dtype} tensor; its value {v!r} would change how it is read"
                )
    return meta


def header_json(meta: dict[str, str] | None, decls: dict[str, DeclaredTensor], order: list[str]) -> bytes:
    """The header's JSON (unpadded), laid out as the safetensors library writes it."""
    parts = []
    if meta is not None:
        items = ",".join(f"{json_str(k)}:{json_str(v)}" for k, v in sorted(meta.items()))
        parts.append(f'"{METADATA_KEY}":{{{items}}}')
    pos = 0
    for name in order:
        d = decls[name]
        dims = ",".join(str(x) for x in d.shape)
        parts.append(
            f'{json_str(name)}:{{"dtype":"{d.code}","shape":[{dims}],"data_offsets":[{pos},{pos + d.nbytes}]}}'
        )
        pos += d.nbytes
    return ("{" + ",".join(parts) + "}").encode("utf-8")


def header_scaled_limit(file_sizes, base: int, per_header_byte: int, what: str) -> tuple[int, str]:
    """(bytes, why) a JSON document describing .safetensors files of `file_sizes` bytes may have:
    `base` plus `per_header_byte` for each byte their headers can hold (each file counted up to
    MAX_HEADER_BYTES). Used for MindFormers' metadata.json and an export's index."""
    sizes = list(file_sizes)
    headers = sum(min(size, MAX_HEADER_BYTES) for size in sizes)
    why = (f"{base >> 20} MiB + {per_header_byte} bytes per byte of {what} {len(sizes)} .safetensors file(s), "
           f"{headers} bytes, each counted up to {MAX_HEADER_BYTES}")
    return base + per_header_byte * headers, why
