"""Shrinking the fingerprint's column segment and step for tests, so that tiny tensors cross them."""

from __future__ import annotations

from contextlib import contextmanager

import reshard_job.core.fingerprint as fp


@contextmanager
def small_segments(segment=4, chunk=24):
    """Column segments of `segment` words and steps of `chunk` bytes, so that small tensors cross
    both (the segment size is part of the definition: digests differ, properties and kernels must
    not)."""
    saved = fp.SEGMENT, fp.CHUNK
    fp.SEGMENT, fp.CHUNK = segment, chunk
    fp._table.cache_clear(), fp._segment_key.cache_clear()
    try:
        yield
    finally:
        fp.SEGMENT, fp.CHUNK = saved
        fp._table.cache_clear(), fp._segment_key.cache_clear()
