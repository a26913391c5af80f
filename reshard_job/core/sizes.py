"""Sizes as people write them: one parser, one set of units, for every size setting.

``512MiB``, ``4GiB`` (powers of 2), ``5GB``, ``500MB`` (powers of 10, as ``transformers`` counts a
shard's bound), single letters ``512M``, ``1G`` (powers of 2, as memory is usually meant), a plain
number or ``B`` for bytes; fractions (``1.5GiB``), any case and spaces are accepted. It is the union
of what ``job.max_memory`` and ``target.max_shard_size`` each accepted before they shared it, every
spelling keeping its value. Also the bounds on a tensor's shape (``shape_problem``). Pure: no I/O.
"""

from __future__ import annotations

import math

UNITS = {"": 1, "b": 1,
         "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
         "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
UNIT_LETTERS = "bBkKmMgGtTiI"


def parse_size(value) -> int:
    """Bytes from an int or a text such as ``'256MiB'``, ``'5GB'``, ``'512M'``; ValueError if it is none.

    The messages name the value, not the setting: callers name the key (``job.max_memory: ...``)."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r} (try e.g. 512MiB)")
    if isinstance(value, int):
        return value
    text = str(value).strip().replace(" ", "")
    number = text.rstrip(UNIT_LETTERS)
    unit = text[len(number):].lower()
    try:
        amount = float(number)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (try e.g. 512MiB)") from None
    if not math.isfinite(amount):
        raise ValueError(f"not a finite size: {text!r} (try e.g. 512MiB)")
    if unit not in UNITS:
        raise ValueError(f"unknown size unit in {text!r} (use KiB, MiB, GiB or KB, MB, GB)")
    return int(amount * UNITS[unit])


# ------------------------------------------------------------------------------ tensor shapes

MAX_DIM = 2**63 - 1  # MindSpore's dims are int64 (TensorProto.dims, Tensor.shape)
MAX_TENSOR_BYTES = 2**63 - 1  # numpy's bound on an array's bytes, counted over its non-zero dims


def shape_problem(shape, itemsize: int) -> str | None:
    """What makes `shape` (of items of `itemsize` bytes) one no array can have, in words, or None.

    Every dimension must be an int from 0 to 2**63-1 (MindSpore's int64 dims), and the product of
    the non-zero ones times the item size at most 2**63-1 bytes: numpy refuses even a zero-size
    array beyond that, so a zero-size tensor can keep its declared dims only within it. Python ints
    throughout (no overflow), stopping at the first dimension past the bound."""
    total = max(itemsize, 1)
    for d, n in enumerate(shape):
        if type(n) is not int or n < 0:
            return f"dimension {d} ({_brief_dim(n)}) is not a non-negative integer"
        if n > MAX_DIM:
            return f"dimension {d} ({_brief_dim(n)}) does not fit an int64 (at most 2**63-1)"
        if n:
            total *= n
            if total > MAX_TENSOR_BYTES:
                return (f"its non-zero dimensions multiply to more than 2**63-1 bytes "
                        f"(at dimension {d}), more than any array can hold")
    return None


def _brief_dim(n) -> str:
    text = repr(n)
    return text if len(text) <= 24 else text[:20] + "…"
