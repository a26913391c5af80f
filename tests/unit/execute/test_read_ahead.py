"""The byte ranges a rank task announces to its source files: exact for rows, covering for columns."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard_job.formats.tensorfile import TensorEntry
from reshard_job.execute.read_ahead import box_span, expected_ranges, file_ranges


@st.composite
def shapes_and_boxes(draw):
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=4)))
    box = []
    for n in shape:
        a = draw(st.integers(0, n - 1))
        box.append((a, draw(st.integers(a + 1, n))))
    return shape, tuple(box), draw(st.sampled_from([1, 2, 4]))


@settings(max_examples=200, deadline=None)
@given(shapes_and_boxes())
def test_the_span_holds_every_byte_of_the_box_and_starts_and_ends_with_it(case):
    shape, box, itemsize = case
    offsets = np.arange(int(np.prod(shape)) * itemsize).reshape(shape + (itemsize,))
    inside = offsets[tuple(slice(a, b) for a, b in box)]
    first, end = box_span(shape, box, itemsize)
    assert first == inside.min() and end == inside.max() + 1
    whole_rows = all(box[d] == (0, shape[d]) for d in range(1, len(shape)))
    if whole_rows:  # a box of whole rows is one contiguous range: nothing extra is announced
        assert end - first == inside.size


def test_empty_box_has_no_span():
    assert box_span((4, 4), ((1, 1), (0, 4)), 2) == (0, 0)


def test_ranges_follow_a_tensor_across_its_records():
    entry = TensorEntry("w", "Float32", (6, 4), 96, pieces=[(1000, 40), (2000, 56)]).finish()
    assert file_ranges(entry, 0, 96) == [(1000, 40), (2000, 56)]
    assert file_ranges(entry, 32, 48) == [(1032, 8), (2000, 8)]
    assert file_ranges(entry, 40, 41) == [(2000, 1)]


def test_a_plan_announces_per_source_rank_in_plan_order():
    from reshard_job.plan.model import ACTION_RESHARD, Copy, ParamPlan, RankPlan

    entries = {0: {"a": TensorEntry("a", "Float32", (4, 4), 64, pieces=[(100, 64)]).finish()},
               1: {"a": TensorEntry("a", "Float32", (4, 4), 64, pieces=[(500, 64)]).finish(),
                   "s": TensorEntry("s", "str", (), 3, pieces=[(900, 3)], kind="str").finish()}}
    plan = RankPlan(0, [ParamPlan("a", "Float32", "tensor", ACTION_RESHARD, (4, 8), (4, 4),
                                  [Copy(0, ((2, 4), (0, 4)), ((0, 2), (0, 4))),
                                   Copy(1, ((0, 2), (1, 3)), ((2, 4), (0, 4)))], itemsize=4, nbytes=64)])
    got = expected_ranges(plan, entries)
    assert got == {0: [(100 + 32, 32)], 1: [(500 + 4, 16 + 8)]}  # rows 2-3 whole; columns 1-2 of rows 0-1
