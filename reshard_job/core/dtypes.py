"""Element types as MindSpore names them, and how their bytes are held in numpy.

The converter only ever moves bytes: a tensor is never cast. BFloat16 is therefore held as its raw
16-bit words (numpy ``uint16``), never widened to float32, which keeps it bit-exact and halves the
memory MindSpore's own converter needs for it.

``Int4`` is MindSpore's ``qint4x2``: each element is one byte holding two 4-bit values, packed
along the last dimension, and the shape MindSpore stores (``.ckpt`` dims, safetensors shape, strategy
slice shapes) counts these bytes (``TypeIdSize(kNumberTypeInt4)`` is 1; the host tensor is an int8
array of that shape, and only the device view doubles the last dimension). So an Int4 tensor is
held as int8 words and any split of its stored shape falls on whole bytes, i.e. on even boundaries
of the 4-bit values: it is sliced exactly like Int8, as MindSpore's converters slice its int8 array.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DType:
    name: str  # MindSpore's tensor_type string, e.g. "Float16"
    storage: np.dtype | None  # numpy dtype that holds the raw element bytes (None: packed/opaque)
    safetensors: str | None  # safetensors dtype code, None when it has none

    @property
    def itemsize(self) -> int:
        if self.storage is None:
            raise ValueError(f"{self.name} has no fixed element size")
        return self.storage.itemsize

    @property
    def sliceable(self) -> bool:
        return self.storage is not None


def _dt(name: str, storage: str | None, st: str | None) -> DType:
    return DType(name, None if storage is None else np.dtype(storage).newbyteorder("<"), st)


_ALL = [
    _dt("Bool", "bool", "BOOL"),
    _dt("Int8", "int8", "I8"),
    _dt("UInt8", "uint8", "U8"),
    _dt("Int16", "int16", "I16"),
    _dt("UInt16", "uint16", "U16"),
    _dt("Int32", "int32", "I32"),
    _dt("UInt32", "uint32", "U32"),
    _dt("Int64", "int64", "I64"),
    _dt("UInt64", "uint64", "U64"),
    _dt("Float16", "float16", "F16"),
    _dt("Float32", "float32", "F32"),
    _dt("Float64", "float64", "F64"),
    _dt("BFloat16", "uint16", "BF16"),  # raw bf16 words
    _dt("Complex64", "complex64", "C64"),
    _dt("Complex128", "complex128", None),  # safetensors has no 128-bit complex code
    _dt("Int4", "int8", None),  # qint4x2: one byte (two 4-bit values) per stored element
]

BY_NAME: dict[str, DType] = {d.name: d for d in _ALL}
BY_SAFETENSORS: dict[str, DType] = {d.safetensors: d for d in _ALL if d.safetensors}

# safetensors codes we can read although MindSpore never writes them; mapped to storage only.
_EXTRA_SAFETENSORS = {"F8_E4M3": "uint8", "F8_E5M2": "uint8"}

STR_TYPE = "str"  # append_dict string entries: UTF-32LE code points, dims [0]


def lookup(name: str) -> DType:
    """The DType for a MindSpore tensor_type string; KeyError if unknown."""
    return BY_NAME[name]


def from_safetensors(code: str) -> DType:
    if code in BY_SAFETENSORS:
        return BY_SAFETENSORS[code]
    if code in _EXTRA_SAFETENSORS:
        return DType(code, np.dtype(_EXTRA_SAFETENSORS[code]), code)
    raise KeyError(code)


def from_numpy(dtype: np.dtype) -> DType:
    """The MindSpore name for a numpy dtype (uint16 maps to UInt16, never to BFloat16)."""
    dtype = np.dtype(dtype)
    for d in _ALL:
        if d.storage is not None and d.name != "BFloat16" and d.storage == dtype.newbyteorder("<"):
            return d
    raise KeyError(str(dtype))


def bf16_to_float32(words: np.ndarray) -> np.ndarray:
    """Widen raw bfloat16 words to float32 (for display and tests only; never used when copying)."""
    return (words.astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16(values: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 words (round-to-nearest-even); for building test data."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = bits + (0x7FFF + ((bits >> 16) & 1))
    return (rounded >> 16).astype(np.uint16)
