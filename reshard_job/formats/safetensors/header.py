"""Constants of the safetensors header shared by the reader and the writer."""

from __future__ import annotations

MAX_HEADER_BYTES = 100_000_000  # the safetensors library's MAX_HEADER_SIZE; MindSpore uses the same
METADATA_KEY = "__metadata__"
INT4_MARK = "Int4"
CRC_KEY = "crc_num"
FORMAT_KEY = "format"
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
