"""Keep the job's resident memory at what it uses, not at what it once used.

glibc raises its mmap threshold each time a large block is freed, up to 32 MiB, so that later
buffers of that size come from the heap, where freed space stays resident and fragments; the
resident size of a job then depends on the order in which threads happened to allocate. A fixed
threshold of 1 MiB keeps every large buffer (read blocks, plan JSON, hashing buffers) in its own
mapping, returned to the system when freed. Linux/glibc only; elsewhere nothing is changed.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
THRESHOLD = 1024 * 1024
TRIM_DEFAULT = 128 * 1024  # glibc's, which a fixed mmap threshold leaves in place


def fix_mmap_threshold() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        return bool(libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD))
    except (OSError, AttributeError):
        return False


@contextlib.contextmanager
def heap_top_kept(nbytes: int = 8 * 1024 * 1024):
    """Meanwhile, up to `nbytes` freed at the top of the heap stay mapped instead of going back to
    the system at once. Work that allocates and frees buffers just under the mmap threshold, one
    after the other (the fingerprint kernel's per-step temporaries), would otherwise shrink and
    regrow the heap every step and page-fault every byte of them in again: the proof of 2 GB did
    300,000 page faults a side. Linux/glibc only; elsewhere nothing is changed."""
    libc = None
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
            if not libc.mallopt(M_TRIM_THRESHOLD, nbytes):
                libc = None
        except (OSError, AttributeError):
            libc = None
    try:
        yield
    finally:
        if libc is not None:
            libc.mallopt(M_TRIM_THRESHOLD, TRIM_DEFAULT)
