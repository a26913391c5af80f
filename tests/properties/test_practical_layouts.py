"""The layouts MindFormers users have: checkpoints saved with redundancy removed, mixture-of-experts
weights (expert parallel combined with data and model parallel, optimizer parallel), pipelines whose
stages hold different numbers of layers, parameters shared by two stages, and JSON strategy files
whose multi-axis maps are recorded flattened.

Conversions are checked against the independent reference slicer (``reference.py``) through the
round-trip machinery of ``test_roundtrip_properties``, and against MindSpore's own outputs where a
golden scenario applies.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard_job import transform_checkpoint_by_rank, transform_checkpoints
from reshard_job.errors import LayoutError, PlanError
from reshard_job.sources.open_files import SourceFiles
from reshard_job.formats.ckpt import CheckpointReader, CheckpointWriter
from reshard_job.formats.strategy import read_strategy, write_strategy
from reshard_job.core.strategy_model import ParamLayout, StrategyFile, StrategyItem
from reshard_job.core.layout import Layout, unflatten
from reshard_job.plan.planner import Planner
from reshard_job.core.tensor_meta import TensorMeta
from reshard_job.sources.rank_folders import discover, load_strategy
from reshard_job.core.topology import Topology

from .reference import reference_box
from .test_roundtrip_properties import Case, Side, convert_there_and_back

GOLDEN = Path(__file__).parents[1] / "golden"


# ================================================================================ redundancy removed


def remove_redundancy(src: Path, dst: Path, strategy: str, keep: str) -> dict[int, str]:
    """Copy a checkpoint set keeping each distinct slice of a laid-out parameter on one rank only,
    as MindSpore's ``save_checkpoint(..., remove_redundancy=True)`` does: among the ranks holding
    the same block (across the stages sharing it) only one keeps it (`keep`: the lowest rank, the
    highest, or a different one per block). Whole tensors (global_step) stay everywhere, so that no
    file is empty."""
    topo = load_strategy(strategy).topology
    files = discover(src).files
    with SourceFiles(files) as sources:
        index = sources.index()
    F = topo.stage_devices
    keeper: dict[tuple[str, object], list[int]] = {}
    for rank in sorted(index):
        for name, meta in index[rank].items():
            if name in topo:
                rec = topo.layout(name, rank // F)
                block = Layout.from_recorded(rec, len(meta.shape), F, name).block(rank % F)
            else:
                block = None
            keeper.setdefault((name, block), []).append(rank)
    chosen = {}
    for i, (key, ranks) in enumerate(keeper.items()):
        chosen[key] = {"first": ranks[0], "last": ranks[-1], "spread": ranks[i % len(ranks)]}[keep]
    out = {}
    for rank, path in files.items():
        target = dst / f"rank_{rank}" / Path(path).name
        with CheckpointReader(path) as r, CheckpointWriter(target) as w:
            for name in r.names():
                meta = index[rank][name]
                block = (Layout.from_recorded(topo.layout(name, rank // F), len(meta.shape), F, name).block(rank % F)
                         if name in topo else None)
                if name not in topo or chosen[(name, block)] == rank:
                    w.add(name, r.read(name), r.entries[name].dtype)
        out[rank] = str(target)
    return out


@pytest.mark.parametrize("keep", ["first", "last", "spread"])
def test_redundancy_removed_saves_give_mindspores_tensors(tmp_path, all_golden_scenarios, keep):
    """MindSpore's own source files (S1: every weight on 2 or 8 replicas), each slice kept on one
    replica only: the conversion reads each block from whichever rank holds it and gives the very
    tensors MindSpore wrote from the full save. (The other goldens shard every parameter over all
    replicas with optimizer parallel: nothing to remove.)"""
    sc = next(s for s in all_golden_scenarios if s.name.startswith("S1_"))
    files = remove_redundancy(sc.src_checkpoints, tmp_path / "src", sc.src_strategy_variants[-1], keep)
    dropped = sum(1 for r, p in files.items()
                  for n in CheckpointReader(sc.src_file(r)).names() if n not in CheckpointReader(p).names())
    assert dropped > 20  # replicas were removed
    out = transform_checkpoints(tmp_path / "src", tmp_path / "out", "checkpoint_", sc.src_strategy, sc.dst_strategy)
    for rank, written in out.items():
        assert dict(written.tensors) == sc.checked(rank), rank


def test_with_every_replica_present_mindspores_replica_is_read(all_golden_scenarios):
    """A complete save plans exactly as before: from MindSpore's replica (target rank r reads
    source ranks of the chunk of r mod F)."""
    sc = next(s for s in all_golden_scenarios if s.name.startswith("S1_"))
    plan, sources = build(sc.src_checkpoints, sc.src_strategy, sc.dst_strategy)
    assert plan.source_ranks == [0, 1, 2, 3]


def build(src, strategy, dst):
    from reshard_job.api import build_plan

    plan, sources = build_plan(src, strategy, dst)
    sources.close()
    return plan, sources


def test_a_block_no_rank_holds_is_refused_naming_it(tmp_path, all_golden_scenarios):
    sc = next(s for s in all_golden_scenarios if s.name.startswith("S3_"))
    files = remove_redundancy(sc.src_checkpoints, tmp_path / "src", sc.src_strategy_merged, "first")
    name = "layers.1.attention.wq.weight"  # stage 1, rows split in two by mp, optimizer-sharded
    holder = next(r for r, p in files.items() if name in CheckpointReader(p).names())
    with CheckpointReader(files[holder]) as r:
        items = [(n, r.read(n), r.entries[n].dtype) for n in r.names() if n != name]
    Path(files[holder]).unlink()
    with CheckpointWriter(files[holder]) as w:
        for n, a, dt in items:
            w.add(n, a, dt)
    with pytest.raises(PlanError) as ei:
        transform_checkpoints(tmp_path / "src", tmp_path / "out", "checkpoint_", sc.src_strategy, sc.dst_strategy)
    msg = str(ei.value)
    assert f"parameter '{name}': no source rank holds its block [" in msg and "should" in msg, msg
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*.ckpt"))


def test_by_rank_with_a_replica_that_lacks_a_block_and_no_other_file(tmp_path, all_golden_scenarios):
    """Given only the files rank_list_for_transform names, a redundancy-removed save may keep a
    block elsewhere: the error says which block is in none of the files given."""
    sc = next(s for s in all_golden_scenarios if s.name.startswith("S1_"))
    files = remove_redundancy(sc.src_checkpoints, tmp_path / "src", sc.src_strategy, "last")
    # rank 0 reads ranks [2, 0]; the save kept their blocks on ranks 5 (columns 0-15) and 7 (16-31)
    with pytest.raises(PlanError, match=r"'layer1.weight': no source file at hand holds its block \[0:784, 16:32\]"):
        transform_checkpoint_by_rank(0, {g: files[g] for g in (0, 2, 5)}, str(tmp_path / "r0.ckpt"), sc.src_strategy,
                                     sc.dst_strategy)
    written = transform_checkpoint_by_rank(0, {g: files[g] for g in (0, 2, 5, 7)}, str(tmp_path / "r0.ckpt"),
                                           sc.src_strategy, sc.dst_strategy)
    assert dict(written.tensors) == sc.checked(0)


# ================================================================================ experts, stages


def moe_side(dev, stages=1, **layouts) -> Side:
    """layouts: name -> ParamLayout (every stage) or {stage: ParamLayout}."""
    return Side(tuple(dev), stages, {n: (lay if isinstance(lay, dict) else {s: lay for s in range(stages)})
                                     for n, lay in layouts.items()})


# 8 ranks = dp 2 x ep 2 x mp 2 (axes 2, 1, 0); experts [E=8, hidden=12, ffn=16]
DP_EP_MP = (2, 2, 2)
EXPERT_LAYOUTS = {
    # experts split by ep, ffn by mp, optimizer-sharded over dp
    "moe.experts.w1": ParamLayout(DP_EP_MP, (1, -1, 0), 4, -1),
    # experts split by dp x ep (expert parallel spanning data parallel), hidden by mp
    "moe.experts.w2": ParamLayout(DP_EP_MP, ((2, 1), 0, -1)),
    # router [hidden, E] replicated, optimizer-sharded over every replica
    "moe.router.weight": ParamLayout(DP_EP_MP, (-1, -1), 1, -1),
}
EXPERT_SHAPES = {"moe.experts.w1": (8, 12, 16), "moe.experts.w2": (8, 16, 12), "moe.router.weight": (24, 8)}


@pytest.mark.parametrize("target", ["ep4", "mp4", "ep2mp3", "single"])
@pytest.mark.parametrize("dt", ["BFloat16", "Float32"])
def test_mixture_of_experts(helpers, target, dt):
    src = moe_side(DP_EP_MP, **EXPERT_LAYOUTS)
    dst = {
        "ep4": moe_side((4,), **{"moe.experts.w1": ParamLayout((4,), (0, -1, -1)),
                                 "moe.experts.w2": ParamLayout((4,), (0, -1, -1)),
                                 "moe.router.weight": ParamLayout((4,), (-1, -1), 1, -1)}),
        "mp4": moe_side((4,), **{"moe.experts.w1": ParamLayout((4,), (-1, -1, 0)),
                                 "moe.experts.w2": ParamLayout((4,), (-1, 0, -1)),
                                 "moe.router.weight": ParamLayout((4,), (0, -1))}),
        # 6 ranks, not a multiple of 8: ep 2 x mp 3, with a multi-axis expert dimension
        "ep2mp3": moe_side((2, 3), **{"moe.experts.w1": ParamLayout((2, 3), (1, -1, 0)),
                                      "moe.experts.w2": ParamLayout((2, 3), ((1,), -1, 0)),
                                      "moe.router.weight": ParamLayout((2, 3), (0, -1), 1, 2)}),
        "single": Side(None),
    }[target]
    shapes = dict(EXPERT_SHAPES)
    if target == "ep2mp3":
        shapes = {"moe.experts.w1": (8, 12, 48), "moe.experts.w2": (8, 48, 12), "moe.router.weight": (24, 8)}
    for as_json in (False, True):
        case = Case(src, dst, shapes, {n: dt for n in shapes}, seed=11, json=as_json)
        convert_there_and_back(case, helpers, back=dst.dev is not None)


def uneven_pipeline(dev=(2, 2)) -> Side:
    """2 stages of 4 ranks holding 3 and 2 layers (MindFormers' pipeline offset), and an embedding
    shared by the first and the last stage (one layout)."""
    mp = ParamLayout(dev, (0, -1), 2, -1)
    layouts = {"embedding": {0: ParamLayout(dev, (0, -1)), 1: ParamLayout(dev, (0, -1))}}
    for layer in range(5):
        layouts[f"layers.{layer}.w"] = {0 if layer < 3 else 1: mp}
    layouts["head.norm"] = {1: ParamLayout(dev, (-1,), 1, -1)}
    return Side(dev, 2, layouts)


def uneven_shapes() -> dict[str, tuple[int, ...]]:
    return {"embedding": (16, 8), **{f"layers.{i}.w": (8, 12) for i in range(5)}, "head.norm": (8,)}


@pytest.mark.parametrize("as_dir", [False, True])
def test_uneven_pipeline_stages_with_a_shared_embedding(helpers, as_dir):
    src = uneven_pipeline()
    dst = moe_side((4,), **{"embedding": ParamLayout((4,), (0, -1)),
                            **{f"layers.{i}.w": ParamLayout((4,), (-1, 0)) for i in range(5)},
                            "head.norm": ParamLayout((4,), (0,))})
    shapes = uneven_shapes()
    case = Case(src, dst, shapes, {n: "Float16" for n in shapes}, seed=5, as_dir=as_dir)
    convert_there_and_back(case, helpers)


def test_a_shared_parameter_is_read_once_and_its_copies_compared(helpers, tmp_path):
    src = uneven_pipeline()
    shapes = uneven_shapes()
    case = Case(src, Side(None), shapes, {n: "Float32" for n in shapes}, seed=2)
    files = helpers.write_sharded(tmp_path / "src", case.tensors(), src.strategy())
    topo = Topology.from_strategy(src.strategy())
    with SourceFiles(files) as sources:
        index = sources.index()
    plan = Planner(topo, None, index).plan()
    emb = next(p for p in plan.ranks[0].params if p.name == "embedding")
    assert {c.source_rank for c in emb.copies} <= {0, 1, 2, 3}  # from the lowest stage only
    # both stages' copies of each block must hold the same bytes: rows split by the inner axis
    assert plan.identical["embedding"] == ((0, 2, 4, 6), (1, 3, 5, 7))
    # a redundancy-removed save that kept the embedding in the last stage only reads it there
    kept = {g: {n: m for n, m in index[g].items() if not (n == "embedding" and g < 4)} for g in index}
    plan = Planner(topo, None, kept).plan()
    emb = next(p for p in plan.ranks[0].params if p.name == "embedding")
    assert {c.source_rank for c in emb.copies} <= {4, 5, 6, 7}


# ================================================================================ JSON multi-axis maps


def test_json_records_a_multi_axis_layout_flattened_and_it_folds_back(tmp_path):
    """The brief's example: a [32, 64] weight laid out (("dp", "mp"), None) on dev [2, 1, 4] is
    recorded by MindSpore's JSON writer as tensor_map [2, 0, -1], tensor_shape [2, 16, 64]."""
    nested = ParamLayout((2, 1, 4), ((2, 0), -1), tensor_shape=(32, 64))
    write_strategy(StrategyFile({"w": nested}, [StrategyItem("op", 0, ())]), tmp_path / "s.json")
    doc = json.loads((tmp_path / "s.json").read_text())["parallel_layout_item"]["w"]
    assert (doc["dev_matrix"], doc["tensor_map"], doc["tensor_shape"]) == ([2, 1, 4], [2, 0, -1], [2, 16, 64])
    flat = read_strategy(tmp_path / "s.json").layouts["w"]
    assert flat.tensor_map == (2, 0, -1)
    folded = unflatten(flat, 2, local_shape=(4, 64))
    assert folded.tensor_map == ((2, 0), -1) and folded.tensor_shape == (32, 64)
    assert Layout.from_recorded(flat, 2) == Layout.from_recorded(ParamLayout((2, 1, 4), ((2, 0), -1)), 2)
    # planned against a checkpoint: each of the 8 ranks holds 4 rows, [2, 0] read as one dimension
    topo = load_strategy(tmp_path / "s.json").topology
    index = {r: {"w": TensorMeta("Float32", (4, 64))} for r in range(8)}
    plan = Planner(topo, None, index).plan()
    assert plan.ranks[0].params[0].global_shape == (32, 64)
    rows = sorted((c.source_rank, c.target_box[0]) for c in plan.ranks[0].params[0].copies)
    assert rows == [(q, ((q // 4) * 16 + (q % 4) * 4, (q // 4) * 16 + (q % 4) * 4 + 4)) for q in range(8)]


def test_a_folding_the_tensor_cannot_tell_is_refused():
    """[2, 2, 8] over axes [1, 0, 2] of dev [4, 2, 2] folds into [[1, 0], 2] ([4, 8]) or
    [1, [0, 2]] ([2, 16]); both give every rank a [1, 2] slice, so the checkpoint cannot tell."""
    flat = ParamLayout((4, 2, 2), (1, 0, 2), tensor_shape=(2, 2, 8))
    with pytest.raises(LayoutError, match="folds into 2 dimension\\(s\\) in 2 ways"):
        unflatten(flat, 2, local_shape=(1, 2), name="w")
    assert unflatten(flat, 2, global_shape=(4, 8), name="w").tensor_map == ((1, 0), 2)  # known shape: no doubt
    with pytest.raises(LayoutError, match="does not fold into the 2 dimension"):
        unflatten(flat, 2, local_shape=(3, 3), name="w")


@settings(deadline=None, max_examples=60)
@given(data=st.data())
def test_flattening_then_folding_gives_the_same_blocks(data):
    from .reference import dev_matrices, divisors, param_layouts

    dev = data.draw(dev_matrices())
    ndim = data.draw(st.integers(1, 3))
    pl = data.draw(param_layouts(dev, ndim))
    shape = tuple(d * data.draw(st.integers(1, 3)) for d in divisors(pl))
    nested = ParamLayout(pl.dev_matrix, tuple(e if isinstance(e, tuple) else (e,) for e in pl.tensor_map),
                         pl.opt_shard_step, pl.opt_shard_size, tensor_shape=shape)
    flat = nested.flattened()
    truth = Layout.from_recorded(pl, ndim)
    local = truth.local_shape(shape)
    try:
        folded = unflatten(flat, ndim, local_shape=local)
    except LayoutError as e:
        assert "ways that fit the tensor" in str(e)  # genuinely ambiguous from the local shape alone
        folded = unflatten(flat, ndim, global_shape=shape)
    assert folded.tensor_shape == shape
    assert Layout.from_recorded(folded, ndim).blocks_key == truth.blocks_key
    for q in range(truth.devices):
        want = reference_box(pl.dev_matrix, pl.tensor_map, pl.opt_shard_step, pl.opt_shard_size, shape, q)
        assert Layout.from_recorded(folded, ndim).box(q, shape) == want
