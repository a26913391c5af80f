"""Hostile or absurd strategies end in one bounded line, quickly, with bounded memory; planning
costs what exists (parameters, files, target ranks), never what a strategy declares.

The randomised, structure-aware version of these cases runs in a capped child process
(``tests/fuzz/test_fuzz_strategy.py``); here each limit is checked once, in process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tracemalloc
from math import prod

import pytest

from reshard_job.errors import LayoutError, MissingRankError, PlanError, ReshardError, StrategyFormatError
from reshard_job.formats import wire
from reshard_job.core.strategy_model import MAX_AXES, MAX_DEVICES, ParamLayout, StrategyFile, StrategyItem
from reshard_job.formats.strategy import read_strategy, write_strategy
from reshard_job.core.layout import Layout
from reshard_job.plan.planner import MISSING_SAMPLE, Planner
from reshard_job.plan.model import ParamPlans
from reshard_job.core.tensor_meta import TensorMeta
from reshard_job.plan.patterns import needed_local_ranks
from reshard_job.plan.rank_list import source_ranks_for
from reshard_job.core.topology import Topology

ITEMS = [StrategyItem("op", 0, ())]


def topo(layouts: dict, path="s.ckpt") -> Topology:
    """A topology; layouts named "<stage>-<name>" make a merged pipeline strategy."""
    merged = all(k.split("-")[0].isdigit() for k in layouts)
    return Topology.from_strategy(StrategyFile(layouts, [] if merged else ITEMS, path=path))


def one_line(err: BaseException, limit: int = 600) -> str:
    text = str(err)
    assert "\n" not in text and len(text) <= limit, text
    return text


# ================================================================================ ceilings


def test_a_json_device_count_of_400_digits(tmp_path):
    doc = {"parallel_strategy_item": {"op": {"stage": 0, "parallel_strategy": []}},
           "parallel_layout_item": {"w": {"dev_matrix": [10**400], "tensor_map": [0, -1], "field": 0,
                                          "opt_weight_shard_step": 0, "opt_weight_shard_size": 0}}}
    (tmp_path / "s.json").write_text(json.dumps(doc))
    with pytest.raises(StrategyFormatError) as ei:
        read_strategy(tmp_path / "s.json")
    assert "an integer of more than 20 digits" in one_line(ei.value, 300)  # refused as it is read


def test_a_json_device_count_of_20_digits(tmp_path):
    doc = {"parallel_strategy_item": {"op": {"stage": 0, "parallel_strategy": []}},
           "parallel_layout_item": {"w": {"dev_matrix": [10**19], "tensor_map": [0, -1], "field": 0,
                                          "opt_weight_shard_step": 0, "opt_weight_shard_size": 0}}}
    (tmp_path / "s.json").write_text(json.dumps(doc))
    with pytest.raises(StrategyFormatError) as ei:
        read_strategy(tmp_path / "s.json")
    assert f"declares more than {MAX_DEVICES} devices" in one_line(ei.value, 300)


def test_protobuf_device_matrix_of_two_uint32_maxima(tmp_path):
    write_strategy(StrategyFile({"w": ParamLayout((2**32 - 1, 2**32 - 1), (1, 0))}, ITEMS), tmp_path / "s.ckpt")
    with pytest.raises(StrategyFormatError, match="declares more than"):
        read_strategy(tmp_path / "s.ckpt")


def test_too_many_axes_and_a_product_over_the_ceiling():
    with pytest.raises(LayoutError, match=f"must be 1 to {MAX_AXES} positive sizes"):
        Layout.from_recorded(ParamLayout((1,) * (MAX_AXES + 1), (-1,)), 1, name="w")
    with pytest.raises(LayoutError, match="declares more than"):
        Layout.from_recorded(ParamLayout((2**11, 2**10), (1, 0)), 2, name="w")  # built in code, not parsed
    many = {f"{s}-w{s}": ParamLayout((2**10,), (0,)) for s in range(2**10 + 1)}
    with pytest.raises(LayoutError, match=f"exceed the {MAX_DEVICES} devices"):
        topo(many)


def test_stage_numbers_of_a_merged_file_are_bounded():
    with pytest.raises(LayoutError, match="names pipeline stage 1000000000000000") as ei:
        topo({"1000000000000000-w": ParamLayout((2,), (0,)), "0-w": ParamLayout((2,), (0,))}, path=None)
    one_line(ei.value)
    with pytest.raises(LayoutError, match=r"pipeline stages \[1, 2, 3, 4, 5, 6, 7, 8, …\] have no layouts"):
        topo({"0-w": ParamLayout((2,), (0,)), "1000-w": ParamLayout((2,), (0,))})


def test_ranks_outside_the_strategy():
    src = topo({"w": ParamLayout((2,), (0,))})
    meta = {"w": TensorMeta("Float32", (2,))}
    with pytest.raises(PlanError, match=r"source rank \[2\] lies outside the 2 rank"):
        Planner(src, None, {0: meta, 1: meta, 2: meta})
    planner = Planner(src, None, {0: meta, 1: meta})
    with pytest.raises(PlanError) as ei:
        planner.plan([10**40])
    assert "is outside 0..0" in one_line(ei.value, 200)
    with pytest.raises(PlanError):
        source_ranks_for(src, src, -1)


def test_long_names_are_shortened_in_messages():
    name = "layers." + "ξ" * 10_000 + ".weight"
    src = topo({name: ParamLayout((2,), (0, -1, -1))})
    with pytest.raises(LayoutError) as ei:
        Planner(src, None, {r: {name: TensorMeta("Float32", (2, 2))} for r in (0, 1)})
    text = one_line(ei.value, 400)
    assert "'layers.ξξ" in text and "…ξξ" in text and "ξ.weight'" in text


# ================================================================================ declared vs present


def test_a_million_device_source_with_two_files_plans_its_missing_ranks_quickly():
    """A strategy declaring 2^20 devices, two files present: each target rank's copy pattern needs
    a million source ranks. The planner lists a sample of the missing ones and says how many it
    left out, instead of enumerating the declared devices."""
    src = topo({"w": ParamLayout((1024, 1024), (1, 0)), "b": ParamLayout((1024, 1024), (1,))})
    index = {r: {"w": TensorMeta("Float32", (1, 1)), "b": TensorMeta("Float32", (1,))} for r in (0, 1)}
    tracemalloc.start()
    missing: dict[int, list[int]] = {}
    plan = Planner(src, None, index).plan(missing=missing)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 8 * 2**20
    assert 0 < len(missing) <= 2 * (MISSING_SAMPLE + len(index))  # a sample per parameter
    assert any("more source rank(s)" in n and "not listed" in n for n in plan.notes)
    with pytest.raises(MissingRankError) as ei:
        Planner(src, None, index).plan()
    assert "and " in one_line(ei.value, 700) and "more" in str(ei.value)


def test_rank_lists_cost_their_length():
    """rank_list_for_transform's answer can be every declared rank; building it costs that, with
    no boxes: 65,536 ranks at once."""
    src = topo({"w": ParamLayout((256, 256), (1, 0))})
    ranks = source_ranks_for(src, None, 0)
    assert len(ranks) == 256 * 256 and ranks[0] == 256 * 256 - 1
    assert len(needed_local_ranks(Layout.from_recorded(src.layout("w", 0), 2), Layout.replicated(2), 0)) == 65536


def test_65536_replicated_target_ranks_share_eight_plans():
    """A target of (256, 256) devices laying everything out replicated: 65,536 target ranks, each
    holding every tensor whole, read from source local rank r mod 8. Their plans differ only in
    which source file is read, so they share 8 parameter sequences."""
    src = topo({"w": ParamLayout((2, 4), (-1, 0), 4, -1), "b": ParamLayout((2, 4), (-1,), 1, -1)})
    dst = topo({"w": ParamLayout((256, 256), (-1, -1)), "b": ParamLayout((256, 256), (-1,))})
    index = {r: {"w": TensorMeta("Float32", (4, 2)), "b": TensorMeta("Float32", (1,)),
                 "global_step": TensorMeta("Int32", (1,))} for r in range(8)}
    tracemalloc.start()
    plan = Planner(src, dst, index).plan()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(plan.ranks) == 65536
    assert len({id(rp.params) for rp in plan.ranks}) == 8
    assert peak < 40 * 2**20, peak
    assert [p.name for p in plan.rank(65535).params] == ["w", "b", "global_step"]
    assert {c.source_rank for p in plan.rank(65535).params for c in p.copies} >= {7}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_million_replicated_target_ranks_under_an_address_space_cap():
    """The (1024, 1024) target of the issue, planned in full in a child capped at 512 MiB."""
    code = """
import resource
with open("/proc/self/status") as f:
    vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + 512 * 2**20, vm + 512 * 2**20))
from reshard_job.core.strategy_model import ParamLayout, StrategyFile, StrategyItem
from reshard_job.core.tensor_meta import TensorMeta
from reshard_job.plan.planner import Planner
from reshard_job.core.topology import Topology
items = [StrategyItem("op", 0, ())]
src = Topology.from_strategy(StrategyFile({"w": ParamLayout((2,), (0, -1))}, items))
dst = Topology.from_strategy(StrategyFile({"w": ParamLayout((1024, 1024), (-1, -1))}, items))
plan = Planner(src, dst, {r: {"w": TensorMeta("Float32", (4, 4))} for r in (0, 1)}).plan()
print(len(plan.ranks))
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=280)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == [str(2**20)]


# ================================================================================ memory per parameter


def moe_case(per_rank: int):
    """8 source ranks (dp 2 x mp 4, optimizer parallel) -> 4 target ranks (mp 4), `per_rank`
    entries per rank of a few shapes, like a mixture-of-experts model."""
    sharded = ParamLayout((2, 4), (-1, 0), 4, -1)
    norm = ParamLayout((2, 4), (-1,), 1, -1)
    names = {}
    for i in range(per_rank):
        names[f"layers.{i // 64}.experts.{i % 64}.w"] = (sharded, ParamLayout((4,), (-1, 0)), (16, 8), (8, 2))
        if i % 16 == 0:
            names[f"layers.{i // 64}.norm.{i}"] = (norm, ParamLayout((4,), (-1,)), (16,), (1,))
    src = topo({n: v[0] for n, v in names.items()})
    dst = topo({n: v[1] for n, v in names.items()})
    metas = {}
    index = {r: {n: metas.setdefault(v[3], TensorMeta("Float32", v[3], "tensor", 4 * prod(v[3])))
                 for n, v in names.items()} for r in range(8)}
    return src, dst, index


def planning_peak(per_rank: int) -> tuple[int, object]:
    src, dst, index = moe_case(per_rank)
    tracemalloc.start()
    plan = Planner(src, dst, index).plan()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak, plan


def test_planning_memory_is_small_per_parameter_and_linear():
    small, _ = planning_peak(2000)
    large, plan = planning_peak(8000)
    entries = sum(len(rp.params) for rp in plan.ranks)
    assert entries == 4 * 8500
    assert large / 8500 < 800, f"{large / 8500:.0f} bytes per parameter"  # all of planning, 4 target ranks
    assert large < 4.6 * small, (small, large)  # linear, not worse
    # what the parameters share is shared: slices (shape, copies) and the per-parameter facts
    params = plan.ranks[0].params
    assert isinstance(params, ParamPlans)
    assert len({id(s) for s in params.slices}) == 2
    # 4 target ranks, each its own block of the experts; the norms' one chunk is read by all
    assert len({id(p.copies) for rp in plan.ranks for p in rp.params}) == 4 + 1


def test_plan_json_is_compact_and_round_trips():
    from reshard_job.plan.model import Plan

    _, plan = planning_peak(2000)
    doc = json.dumps(plan.to_json())
    assert len(doc) < 60 * 4 * 2125  # well under 100 bytes per parameter and target rank
    again = Plan.from_json(json.loads(doc))
    assert [list(rp.params) for rp in again.ranks] == [list(rp.params) for rp in plan.ranks]
    assert again.totals() == plan.totals()


def test_hostile_protobuf_bytes_stay_refused(tmp_path):
    """A dev_matrix of 2^62 entries announced by a packed length in a tiny file."""
    data = b"\x1a\x0c\x0a\x01w\x12\x07\x0a\x05\x0a\x03" + b"\x08" + wire.encode_varint(2**62)[:1]
    (tmp_path / "s.ckpt").write_bytes(data)
    with pytest.raises(ReshardError):
        Topology.from_strategy(read_strategy(tmp_path / "s.ckpt"))
