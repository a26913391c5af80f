"""Properties of request coalescing (pure): every byte asked for is covered, requests stay within
their caps, and nothing is read that no range needs except gaps up to ``max_gap``."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard_job.storage.ranges import clip_ranges, plan_requests

range_lists = st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 700)), max_size=40)


def _bytes_of(requests, ranges):
    """What the caller would get: each range rebuilt from the pieces of the requests."""
    out = [bytearray(length) for _, length in ranges]
    for request in requests:
        for piece in request.pieces:
            assert request.offset <= piece.offset and piece.end <= request.end
            base = ranges[piece.index][0]
            out[piece.index][piece.offset - base:piece.end - base] = bytes(
                (i * 7) % 251 for i in range(piece.offset, piece.end))
    return [bytes(b) for b in out]


@settings(max_examples=300, deadline=None)
@given(ranges=range_lists, max_gap=st.integers(0, 600), max_request=st.integers(1, 2000))
def test_requests_cover_every_range_within_their_caps(ranges, max_gap, max_request):
    requests = plan_requests(ranges, max_gap=max_gap, max_request=max_request)
    expected = [bytes((i * 7) % 251 for i in range(o, o + n)) for o, n in ranges]
    assert _bytes_of(requests, ranges) == expected
    for request in requests:
        assert 0 < request.length <= max_request
        assert request.pieces
        assert request.offset == min(p.offset for p in request.pieces)
        assert request.end == max(p.end for p in request.pieces)
    # in file order; requests overlap only where the caller's ranges do
    for before, after in zip(requests, requests[1:]):
        assert before.offset <= after.offset
        if before.end > after.offset:
            assert any(p.end > after.offset for p in before.pieces)
    if all(a[0] + a[1] <= b[0] for a, b in zip(sorted(ranges), sorted(ranges)[1:])):
        assert sum(r.length for r in requests) <= sum(n for _, n in ranges) + max_gap * len(ranges)


@settings(max_examples=300, deadline=None)
@given(ranges=range_lists, max_gap=st.integers(0, 600))
def test_gaps_read_are_bounded(ranges, max_gap):
    requests = plan_requests(ranges, max_gap=max_gap, max_request=10_000_000)
    for request in requests:
        covered = sorted((p.offset, p.end) for p in request.pieces)
        reach = covered[0][1]
        for start, end in covered[1:]:
            assert start - reach <= max_gap  # no gap longer than max_gap inside a request
            reach = max(reach, end)


def test_neighbours_merge_and_distant_ranges_do_not():
    requests = plan_requests([(0, 10), (15, 10), (1000, 10)], max_gap=5, max_request=100)
    assert [(r.offset, r.length) for r in requests] == [(0, 25), (1000, 10)]
    assert plan_requests([(0, 0), (50, 0)], max_gap=5, max_request=100) == []


def test_a_long_range_is_split():
    requests = plan_requests([(10, 250)], max_gap=0, max_request=100)
    assert [(r.offset, r.length) for r in requests] == [(10, 100), (110, 100), (210, 50)]


def test_clip_ranges():
    assert clip_ranges([(0, 10), (95, 10), (100, 5), (200, 1)], 100) == [(0, 10), (95, 5), (100, 0), (100, 0)]
    with pytest.raises(ValueError):
        clip_ranges([(-1, 5)], 100)
    with pytest.raises(ValueError):
        plan_requests([(0, 1)], max_gap=0, max_request=0)
