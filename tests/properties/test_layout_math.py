"""`Layout.box` against the spec's worked examples and against an independent reference slicer."""

from __future__ import annotations

from math import prod

import numpy as np
import pytest
from hypothesis import given, settings

from reshard_job.errors import LayoutError
from reshard_job.formats.strategy import read_strategy
from reshard_job.core.strategy_model import ParamLayout
from reshard_job.core.layout import Layout, coords
from reshard_job.core.topology import Topology

from .reference import layout_and_shape, reference_box


def boxes(pl: ParamLayout, shape, ranks=None) -> list:
    layout = Layout.from_recorded(pl, len(shape))
    return [layout.box(q, tuple(shape)) for q in (range(layout.devices) if ranks is None else ranks)]


# ================================================================================ spec §10


def test_coordinates_last_position_fastest():
    # §1: c_{n-1} = q mod d_{n-1}, ...
    assert [coords(q, (2, 4)) for q in (0, 1, 4, 7)] == [(0, 0), (0, 1), (1, 0), (1, 3)]
    assert coords(5, (2, 1, 2, 2)) == (1, 0, 0, 1)


def test_spec_10_1_source_and_destination_boxes():
    src = ParamLayout((2, 4), (1, -1))
    assert boxes(src, (784, 512)) == [((0, 392), (0, 512))] * 4 + [((392, 784), (0, 512))] * 4
    dst = ParamLayout((4,), (-1, 0))
    assert boxes(dst, (784, 512)) == [((0, 784), (128 * t, 128 * t + 128)) for t in range(4)]


def test_spec_10_1_variant_with_optimizer_sharding():
    src = ParamLayout((2, 4), (1, -1), 1, -1)
    want = [((392 * (q // 4) + 98 * (q % 4), 392 * (q // 4) + 98 * (q % 4) + 98), (0, 512)) for q in range(8)]
    assert boxes(src, (784, 512)) == want
    assert boxes(src, (784, 512))[5] == ((490, 588), (0, 512))
    assert boxes(ParamLayout((2, 4), (1, -1), 1, 4), (784, 512)) == want


def test_spec_10_2_tutorial_layouts():
    src = ParamLayout((2, 1, 2, 2), (2, 1))
    left, right = ((0, 784), (0, 256)), ((0, 784), (256, 512))
    assert boxes(src, (784, 512)) == [left, left, right, right, left, left, right, right]
    for size in (-1, 2):
        dst = ParamLayout((2, 2, 1), (1, 0), 2, size)
        assert boxes(dst, (784, 512)) == [((0, 196), (0, 512)), ((392, 588), (0, 512)),
                                          ((196, 392), (0, 512)), ((588, 784), (0, 512))]
        assert Layout.from_recorded(dst, 2).local_shape((784, 512)) == (196, 512)


def test_spec_10_3_pipeline_stage_layouts():
    stage0 = ParamLayout((2, 2), (-1, 0), 2, -1)
    assert boxes(stage0, (784, 512)) == [((0, 392), (0, 256)), ((0, 392), (256, 512)),
                                         ((392, 784), (0, 256)), ((392, 784), (256, 512))]
    stage1 = ParamLayout((2, 2), (0, -1), 2, -1)
    assert boxes(stage1, (512, 512)) == [((0, 128), (0, 512)), ((256, 384), (0, 512)),
                                         ((128, 256), (0, 512)), ((384, 512), (0, 512))]
    assert boxes(ParamLayout((4,), (0, -1)), (784, 512)) == [((196 * t, 196 * t + 196), (0, 512)) for t in range(4)]
    assert boxes(ParamLayout((4,), (-1, 0)), (512, 512)) == [((0, 512), (128 * t, 128 * t + 128)) for t in range(4)]


def test_multi_axis_first_listed_axis_is_most_significant():
    # dim 0 split by axes [1, 0] of dev [2, 3]: block = c_0 * 3 + c_1
    pl = ParamLayout((2, 3), ((1, 0), -1))
    assert [b[0] for b in boxes(pl, (12, 2))] == [(2 * k, 2 * k + 2) for k in range(6)]
    pl = ParamLayout((2, 3), ((0, 1), -1))  # block = c_1 * 2 + c_0
    assert [b[0][0] // 2 for b in boxes(pl, (12, 2))] == [0, 2, 4, 1, 3, 5]


def test_replicas_do_not_change_the_box_and_opt_shards_tile_the_model_block():
    pl = ParamLayout((2, 2, 2), (-1, 1), 4, 2)  # position 1 splits dim 1; positions 0, 2 replicate
    layout = Layout.from_recorded(pl, 2)
    assert layout.opt_shard == 2
    got = boxes(pl, (8, 4))
    # replica groups {0,1,4,5} and {2,3,6,7}; u = (c_0, c_2) read left to right; chunks of 2
    assert got[0] == ((0, 4), (0, 2)) and got[1] == ((4, 8), (0, 2))
    assert got[4] == got[0] and got[5] == got[1]
    assert got[2] == ((0, 4), (2, 4)) and got[3] == ((4, 8), (2, 4))


# ================================================================================ reference slicer


def test_reference_slicer_reproduces_the_spec_examples():
    for pl, shape in [(ParamLayout((2, 4), (1, -1), 1, -1), (784, 512)),
                      (ParamLayout((2, 2, 1), (1, 0), 2, -1), (784, 512)),
                      (ParamLayout((2, 2), (0, -1), 2, -1), (512, 512)),
                      (ParamLayout((2, 1, 2, 2), (2, 1)), (784, 512))]:
        assert [reference_box(pl.dev_matrix, pl.tensor_map, pl.opt_shard_step, pl.opt_shard_size, shape, q)
                for q in range(prod(pl.dev_matrix))] == boxes(pl, shape)


@settings(deadline=None, max_examples=150)
@given(case=layout_and_shape())
def test_layout_box_equals_reference(case):
    pl, shape = case
    layout = Layout.from_recorded(pl, len(shape))
    layout.check_shape(shape)
    for q in range(prod(pl.dev_matrix)):
        want = reference_box(pl.dev_matrix, pl.tensor_map, pl.opt_shard_step, pl.opt_shard_size, shape, q)
        assert layout.box(q, shape) == want, q
    local = layout.local_shape(shape)
    assert layout.global_shape(local) == shape
    assert all(tuple(b - a for a, b in layout.box(q, shape)) == local for q in range(layout.devices))


@settings(deadline=None, max_examples=100)
@given(case=layout_and_shape())
def test_every_optimizer_chunk_tiles_the_tensor(case):
    """The ranks of one optimizer chunk hold every block exactly once, and ``rank_holding``
    (computed from digits, without listing the devices) finds each block's holder: it is the
    inverse of ``(chunk(q), block(q))``."""
    pl, shape = case
    layout = Layout.from_recorded(pl, len(shape))
    members: dict[int, dict[tuple, int]] = {}
    for q in range(layout.devices):
        chunk, block = layout.chunk(q), layout.block(q)
        assert block not in members.setdefault(chunk, {}), "two ranks of one chunk hold the same block"
        members[chunk][block] = q
        assert layout.rank_holding(chunk, block) == q
    assert sorted(members) == list(range(layout.chunks))
    for chunk, held in members.items():
        count = np.zeros(shape, dtype=np.int32)
        for q in held.values():
            count[tuple(slice(a, b) for a, b in layout.box(q, shape))] += 1
        assert (count == 1).all()
        assert len(held) * prod(layout.local_shape(shape)) == prod(shape)


def golden_layouts():
    from pathlib import Path

    golden = Path(__file__).resolve().parents[1] / "golden"
    out = []
    for manifest in sorted(golden.glob("*/manifest.json")):
        import json

        m = json.loads(manifest.read_text())
        shapes = {p["name"]: tuple(p["shape"]) for p in m["params"]}
        for side in ("src", "dst"):
            info = m[side]
            rel = info.get("merged_strategy_file") or info.get("strategy_file")
            if rel:
                out.append(pytest.param(manifest.parent / rel, shapes, id=f"{manifest.parent.name}-{side}"))
    return out


@pytest.mark.parametrize("path,shapes", golden_layouts())
def test_compiled_golden_layouts_equal_reference(path, shapes):
    """The layouts MindSpore compiled for the golden scenarios, with their real global shapes."""
    topo = Topology.from_strategy(read_strategy(path))
    checked = 0
    for name, per_stage in topo.layouts.items():
        if name not in shapes:
            continue
        for stage, pl in per_stage.items():
            shape = shapes[name]
            layout = Layout.from_recorded(pl, len(shape), topo.stage_devices, name)
            assert prod(pl.dev_matrix) == topo.stage_devices
            for q in range(topo.stage_devices):
                want = reference_box(pl.dev_matrix, pl.tensor_map, pl.opt_shard_step, pl.opt_shard_size, shape, q)
                assert layout.box(q, shape) == want, (name, q)
            checked += 1
    assert checked >= 10


# ================================================================================ validation


@pytest.mark.parametrize("pl,ndim,match", [
    (ParamLayout((2, 2), (1, 0)), 3, "3 dimension"),
    (ParamLayout((2, 2), (1, 0, -1)), 2, "has 3 entries"),
    (ParamLayout((2, 2), (2, -1)), 2, "names device axis 2"),
    (ParamLayout((2, 2), (0, 0)), 2, "more than one dimension"),
    (ParamLayout((2, 2), ((0, 1), 1)), 2, "more than one dimension"),
    (ParamLayout((), (-1,)), 1, "must be 1 to 64 positive sizes"),
    (ParamLayout((2, 0), (-1,)), 1, "positive"),
    (ParamLayout((2, 2), (1, -1), 1, 3), 2, "does not divide"),
    (ParamLayout((2, 2), (1, 0), 1, 2), 2, "does not divide"),  # no replicas left to shard over
    (ParamLayout((2, 2), (1, -1), 0, 2), 2, "step 0"),
    (ParamLayout((4,), (), 1, 2), 0, "scalar"),
])
def test_invalid_layouts_are_refused_naming_the_parameter(pl, ndim, match):
    with pytest.raises(LayoutError, match=match) as ei:
        Layout.from_recorded(pl, ndim, name="model.w")
    assert "'model.w'" in str(ei.value)


def test_indivisible_shape_is_refused():
    layout = Layout.from_recorded(ParamLayout((4,), (0, -1)), 2)
    with pytest.raises(LayoutError, match="'w'.*dimension 0 of size 6 cannot be split into 4"):
        layout.check_shape((6, 3), "w")


def test_smaller_device_matrix_is_extended_by_replication():
    pl = ParamLayout((2,), (0, -1))
    layout = Layout.from_recorded(pl, 2, stage_devices=8)
    assert layout.dev_matrix == (4, 2)
    assert [layout.box(q, (4, 1))[0] for q in range(8)] == [(0, 2), (2, 4)] * 4
    with pytest.raises(LayoutError, match="does not divide"):
        Layout.from_recorded(ParamLayout((3,), (0, -1)), 2, stage_devices=8, name="w")
