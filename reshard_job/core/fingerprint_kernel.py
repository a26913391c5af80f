"""Which kernel computes the fingerprint's row sums (``poslin64x2-v1``): compiled, or numpy.

The hot part of the fingerprint is one sum per row and lane of the row's words times their column
keys. ``_fingerprint_c``, a small C extension built at install time when a compiler is there, does
both lanes in one pass over the bytes, pads rows cut mid-word without a copy and releases the GIL;
without it (or with ``RESHARD_JOB_FINGERPRINT_KERNEL=numpy``) numpy's uint64 matmul does each
lane in its own pass. Both give the same bits: the sums are exact mod 2^64, so neither order nor
grouping matters. Tests and benchmarks compare the two in one process with ``forced``.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator, Sequence

import numpy as np

try:
    from reshard_job.core import _fingerprint_c as _compiled
except ImportError:  # not built (no compiler at install time): numpy does the work
    _compiled = None

ENV = "RESHARD_JOB_FINGERPRINT_KERNEL"
KERNELS = ("compiled", "numpy")


def _chosen() -> str:
    """``RESHARD_JOB_FINGERPRINT_KERNEL=numpy`` forces numpy; otherwise the compiled kernel when built."""
    forced_numpy = os.environ.get(ENV, "").strip().lower() == "numpy"
    return "numpy" if forced_numpy or _compiled is None else "compiled"


_active = _chosen()


def available() -> bool:
    """Whether the compiled kernel was built and imports."""
    return _compiled is not None


def active() -> str:
    """``"compiled"`` or ``"numpy"``: the kernel that fingerprints use now."""
    return _active


def describe() -> str:
    """The active kernel in words, with the compiled one's instruction set (``compiled (avx512)``)."""
    return f"compiled ({_compiled.variant()})" if _active == "compiled" else "numpy"


@contextmanager
def forced(kernel: str) -> Iterator[None]:
    """Use `kernel` (``"compiled"`` or ``"numpy"``) inside the block; not thread-safe (tests, benchmarks)."""
    global _active
    if kernel not in KERNELS:
        raise ValueError(f"unknown fingerprint kernel {kernel!r}: expected one of {', '.join(KERNELS)}")
    if kernel == "compiled" and _compiled is None:
        raise RuntimeError("the compiled fingerprint kernel is not built (pip install -e . with a C compiler)")
    saved, _active = _active, kernel
    try:
        yield
    finally:
        _active = saved


def compiled_row_sums(rows: np.ndarray, start: int, columns: Sequence[np.ndarray],
                      segments: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Both lanes' sums of each row of bytes `rows` (rows, width), whose first byte is byte `start`
    of its grid row; `columns`: each lane's column table (S keys); `segments`: each lane's keys of
    the segments ``start // 8 // S`` onwards that the rows reach."""
    if rows.shape[1] > 1 and rows.strides[1] != 1:  # bytes apart within a row: the kernel reads them packed
        rows = np.ascontiguousarray(rows)
    out = np.empty((2, rows.shape[0]), dtype=np.uint64)
    _compiled.row_sums(rows, start % 8, start // 8, columns[0], columns[1], segments[0], segments[1], out[0], out[1])
    return [out[0], out[1]]


def compiled_odd_keys(lo: int, hi: int, seed: int) -> np.ndarray:
    """``fingerprint._odd_keys``'s keys of indices lo..hi-1, given the purpose's `seed`, in one C loop."""
    out = np.empty(hi - lo, dtype=np.uint64)
    _compiled.odd_keys(lo, seed, out)
    return out
