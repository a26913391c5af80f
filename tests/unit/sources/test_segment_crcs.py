"""The CRC32 of byte ranges taken as a file's chunks pass: each equals zlib's over the range alone,
whether taken range by range or many short ones at once."""

import random
import zlib

import numpy as np
import pytest

from reshard_job.formats.crc32 import crc32_rows
from reshard_job.sources.segment_crcs import TOGETHER, SegmentCrcs


@pytest.mark.parametrize("length", [0, 1, 3, 4, 8, 31, 32])
def test_rows_give_zlibs_crc_of_each_row(length):
    rows = np.random.default_rng(length).integers(0, 256, (500, length), dtype=np.uint8)
    assert crc32_rows(rows).tolist() == [zlib.crc32(row.tobytes()) for row in rows]


def _fed(data: bytes, segments, chunk_sizes, added=()) -> list[int]:
    crcs = SegmentCrcs(segments)
    pos, sizes = 0, iter(chunk_sizes)
    pending = list(added)
    while pos < len(data):
        while pending and crcs.add(*pending[0]):
            pending.pop(0)
        n = min(next(sizes), len(data) - pos)
        crcs.update(pos, memoryview(data)[pos:pos + n])
        pos += n
    return crcs.crcs


@pytest.mark.parametrize("seed", range(6))
def test_many_short_and_long_overlapping_ranges_across_random_chunks(seed):
    rnd = random.Random(seed)
    data = rnd.randbytes(20_000)
    segments = [(rnd.randrange(len(data)), rnd.choice([0, 1, 4, 7, 32, 33, 500, 5000])) for _ in range(3000)]
    segments = [(off, min(n, len(data) - off)) for off, n in segments] + [(0, len(data))]
    rnd.shuffle(segments)
    chunks = [rnd.choice([1, 13, 700, 4096]) for _ in range(len(data))]
    got = _fed(data, segments, chunks)
    assert got == [zlib.crc32(data[off:off + n]) for off, n in segments]
    assert len(segments) > TOGETHER  # enough short ranges in one chunk to be taken together


def test_ranges_added_while_chunks_come_and_ranges_refused_once_passed():
    data = bytes(range(256)) * 40
    added = [(1000 + 8 * i, 4) for i in range(200)]
    got = _fed(data, [(0, 16)], [512] * 40, added)
    assert got == [zlib.crc32(data[off:off + n]) for off, n in [(0, 16)] + added]
    crcs = SegmentCrcs([(0, 4)])
    crcs.update(0, memoryview(data)[:100])
    assert not crcs.add(50, 4)  # its bytes went by


@pytest.mark.parametrize("seed", range(3))
def test_a_table_of_ranges_reads_as_its_tuples_and_gives_the_same_crcs_and_cache_key(seed):
    """``SegmentTable`` (the hash pass's compact form for a file of many compared tensors) is the
    sequence of its (offset, length) tuples: the same CRCs, ranges added to it included, and the
    same digest-cache key as the tuples."""
    from reshard_job.sources.file_digests import _segments_key
    from reshard_job.sources.segment_crcs import SegmentTable

    rnd = random.Random(seed)
    data = rnd.randbytes(30_000)
    segments = [(rnd.randrange(20_000), rnd.choice([0, 3, 8, 40, 900])) for _ in range(2000)] + [(0, 20_000)]
    table = SegmentTable(segments)
    assert len(table) == len(segments) and list(table) == segments and table == segments and table == tuple(segments)
    assert table[5] == segments[5] and type(table[5][0]) is int and list(table[10:20]) == segments[10:20]
    assert table != [[off, n + 1] for off, n in segments] and table == [list(s) for s in segments]
    assert table[-1] == (0, 20_000) and hash(table) == hash(SegmentTable(tuple(segments))) and table != segments[:-1]
    assert _segments_key(table) == _segments_key(tuple(segments))
    added = [(25_000 + 16 * i, 8) for i in range(50)]
    chunks = [rnd.choice([7, 700, 4096]) for _ in range(len(data))]
    assert _fed(data, table, chunks, added) == _fed(data, segments, chunks, added) == \
        [zlib.crc32(data[off:off + n]) for off, n in segments + added]
