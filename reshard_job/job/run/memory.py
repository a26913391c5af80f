"""Keep the job's resident memory at what it uses, not at what it once used.

glibc raises its mmap threshold each time a large block is freed, up to 32 MiB, so that later
buffers of that size come from the heap, where freed space stays resident and fragments; the
resident size of a job then depends on the order in which threads happened to allocate. A fixed
threshold of 1 MiB keeps every large buffer (read blocks, plan JSON, hashing buffers) in its own
mapping, returned to the system when freed. Linux/glibc only; elsewhere nothing is changed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_MMAP_THRESHOLD = -3
THRESHOLD = 1024 * 1024


def fix_mmap_threshold() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        return bool(libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD))
    except (OSError, AttributeError):
        return False
