"""Which target rank writes each laid-out parameter with redundancy removed (``plan.redundancy``):
MindSpore's rule (``train/_utils.py:remove_param_redundancy``) on hand-worked cases, and on the
goldens' MindSpore-compiled target strategies every block written by exactly one rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from reshard_job.core.layout import Layout
from reshard_job.core.topology import Topology
from reshard_job.formats.strategy import read_strategy
from reshard_job.plan.redundancy import replica_groups, stage_owners

GOLDEN = Path(__file__).parents[2] / "golden"


def test_parameters_sharing_a_group_are_dealt_round_robin_in_name_order():
    # 16 ranks, device matrix (4, 4); tensor map [0] splits on the last axis: groups rank % 4
    split = Layout((4, 4), ((1,),))
    replicated = Layout((4, 4), ((),))
    assert replica_groups(split, 16) == ((0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15))
    owners = stage_owners([("w.d", split), ("a", replicated), ("w.b", split), ("w.c", split)], 16).owned
    # sorted: a (one group of all 16: rank 0), then w.b, w.c, w.d: 1st, 2nd, 3rd rank of each group
    assert owners[0] == {"a", "w.b"}
    assert [owners[r] for r in (1, 2, 3)] == [{"w.b"}] * 3
    assert [owners[r] for r in (4, 5, 6, 7)] == [{"w.c"}] * 4
    assert [owners[r] for r in (8, 9, 10, 11)] == [{"w.d"}] * 4
    assert [owners[r] for r in (12, 13, 14, 15)] == [set()] * 4


def test_optimizer_shards_split_the_replica_group_by_stride():
    # 4 replicas cut into optimizer parts of k=2: positions i, i+2 hold the same part (MindSpore's
    # param_ranks[i::k])
    layout = Layout((4,), ((),), opt_shard=2)
    assert replica_groups(layout, 4) == ((0, 2), (1, 3))
    owners = stage_owners([("x", layout), ("y", layout)], 4).owned
    assert owners == [{"x"}, {"x"}, {"y"}, {"y"}]


def test_parameters_without_replicas_are_written_by_every_rank_and_not_listed():
    sharded = Layout((2, 2), ((0,), (1,)))  # four blocks, one per rank
    owners = stage_owners([("s", sharded), ("r", Layout((2, 2), ((),)))], 4)
    assert owners.replicated == {"r"} and owners.owned == [{"r"}, set(), set(), set()]
    assert all(owners.writes(q, "s") for q in range(4)) and [owners.writes(q, "r") for q in range(4)] == \
        [True, False, False, False]


def test_layouts_giving_the_same_group_share_its_counter():
    a = Layout((2, 2), ((0,),))  # groups (0, 1), (2, 3)
    same_groups = Layout((2, 2, 1), ((0,),))  # another layout, the same groups
    assert replica_groups(a, 4) == replica_groups(same_groups, 4) == ((0, 1), (2, 3))
    owners = stage_owners([("a", a), ("b", same_groups), ("c", a)], 4).owned
    assert owners == [{"a", "c"}, {"b"}, {"a", "c"}, {"b"}]


@pytest.mark.parametrize("scenario", ["S1_mlp_tutorial_8to4", "S2_block_mp4dp2opt_to_mp4",
                                      "S3_pipeline2x4opt_to_4", "S5b_split_1to8"])
def test_every_block_of_a_golden_target_is_written_by_exactly_one_rank(scenario):
    topo = Topology.from_strategy(read_strategy(GOLDEN / scenario / "dst_strategy.ckpt"))
    T = topo.stage_devices
    for stage in range(topo.num_stages):
        laid_out = {name: Layout.from_recorded(per[stage], len(per[stage].tensor_map), T, name)
                    for name, per in topo.layouts.items() if stage in per}
        owners = stage_owners(laid_out.items(), T)
        for name, layout in laid_out.items():
            writers = [q for q in range(T) if owners.writes(q, name)]
            blocks = [layout.block(q) for q in writers]
            assert len(set(blocks)) == len(blocks), f"{name}: a block written twice"
            assert set(blocks) == {layout.block(q) for q in range(T)}, f"{name}: a block not written"


def test_the_planner_keeps_on_each_target_rank_only_what_it_owns_stage_by_stage():
    from reshard_job.core.strategy_model import ParamLayout
    from reshard_job.core.tensor_meta import TensorMeta
    from reshard_job.plan.planner import Planner

    split, whole = ParamLayout((2,), (0, -1)), ParamLayout((2,), (-1,))
    # two pipeline stages of two ranks: b lives in both (one copy per stage), step in no layout
    dst = Topology(2, 2, {"w": {0: split}, "b": {0: whole, 1: whole}, "c": {1: whole}}, "dst.json")
    index = {0: {"w": TensorMeta("Float32", (4, 4)), "b": TensorMeta("Float32", (4,)),
                 "c": TensorMeta("Float32", (4,)), "step": TensorMeta("Int64", ())}}
    full = Planner(Topology.unsharded(), dst, index).plan()
    plan = Planner(Topology.unsharded(), dst, index, remove_redundancy=True).plan()
    names = [sorted(p.name for p in rp.params) for rp in plan.ranks]
    # stage 0: b (group 0,1) -> rank 0, w split (groups of one); stage 1: b -> rank 2, c -> rank 3
    assert names == [["b", "step", "w"], ["step", "w"], ["b", "step"], ["c", "step"]]
    for kept, every in zip(plan.ranks, full.ranks):
        assert [p for p in every.params if p.name in {q.name for q in kept.params}] == list(kept.params)
        assert kept.bytes_written <= every.bytes_written
    assert plan.target["remove_redundancy"] is True and "remove_redundancy" not in full.target
