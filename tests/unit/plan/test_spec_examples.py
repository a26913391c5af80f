"""The worked examples of spec/resharding-semantics.md §10, run on files.

As in the spec's own verification, every source element stores ``16 * (global flat index) +
(source rank)``, so each output element tells where it came from: which global element (the box)
and which source file (the "reads from" column). Replicas therefore differ, which also checks that
we read the replica MindSpore reads.
"""

from __future__ import annotations

from math import prod

import numpy as np
import pytest

from reshard_job import rank_list_for_transform, transform_checkpoint_by_rank, transform_checkpoints
from reshard_job.formats.ckpt import CheckpointReader, CheckpointWriter
from reshard_job.formats.strategy import write_strategy
from reshard_job.core.strategy_model import ParamLayout, StrategyFile, StrategyItem
from reshard_job.core.layout import Layout
from reshard_job.plan.planner import Planner
from reshard_job.core.tensor_meta import TensorMeta
from reshard_job.core.topology import Topology

RANK_CODE = 16


def strategy(path, layouts: dict, stages=(0,)) -> str:
    write_strategy(StrategyFile(layouts, [StrategyItem(f"op{s}", s, ()) for s in stages]), path)
    return str(path)


def write_encoded_sources(root, topo: Topology, shapes: dict[str, tuple]) -> dict[int, str]:
    """Rank g's slice of each parameter holds 16*flat_index + g; global_step holds g: replicas differ on
    purpose, to show which one is read (so conversions here pass verify_replicas=False)."""
    paths = {}
    for g in range(topo.devices):
        stage, local = topo.stage_of_rank(g), topo.local_rank(g)
        path = root / f"rank_{g}" / f"checkpoint_{g}.ckpt"
        with CheckpointWriter(path) as w:
            for name, shape in shapes.items():
                rec = topo.layout(name, stage)
                if rec is None:
                    continue
                box = Layout.from_recorded(rec, len(shape), topo.stage_devices, name).box(local, shape)
                index = np.arange(prod(shape), dtype=np.int32).reshape(shape)
                w.add(name, index[tuple(slice(a, b) for a, b in box)] * RANK_CODE + g)
            w.add("global_step", np.array([g], dtype=np.int32))
        paths[g] = str(path)
    return paths


def decode(path, name):
    with CheckpointReader(path) as r:
        data = r.read(name)
    return data // RANK_CODE, data % RANK_CODE


def check_output(path, name, shape, box, reads: dict[tuple, int]):
    """The output is the global box; each region (a sub-box, in global coordinates) came from one rank."""
    index, rank = decode(path, name)
    full = np.arange(prod(shape), dtype=np.int32).reshape(shape)
    assert np.array_equal(index, full[tuple(slice(a, b) for a, b in box)])
    for region, src in reads.items():
        local = tuple(slice(a - b0, b - b0) for (a, b), (b0, _) in zip(region, box))
        assert (rank[local] == src).all(), (region, np.unique(rank[local]))
    assert set(np.unique(rank)) == set(reads.values())


# ================================================================================ §10.1


def run_10_1(tmp_path, opt):
    src_layout = ParamLayout((2, 4), (1, -1), 1, -1) if opt else ParamLayout((2, 4), (1, -1))
    src = strategy(tmp_path / "src.ckpt", {"layer1.weight": src_layout})
    dst = strategy(tmp_path / "dst.ckpt", {"layer1.weight": ParamLayout((4,), (-1, 0))})
    shape = (784, 512)
    write_encoded_sources(tmp_path / "src", Topology.from_strategy(StrategyFile({"layer1.weight": src_layout})),
                          {"layer1.weight": shape})
    out = transform_checkpoints(tmp_path / "src", tmp_path / "out", "checkpoint_", src, dst, verify_replicas=False)
    return src, dst, shape, out


def test_spec_10_1(tmp_path):
    src, dst, shape, out = run_10_1(tmp_path, opt=False)
    for t in range(4):
        cols = (128 * t, 128 * t + 128)
        check_output(out[t].path, "layer1.weight", shape, ((0, 784), cols),
                     {((0, 392), cols): t, ((392, 784), cols): t + 4})
        assert decode(out[t].path, "global_step")[1].tolist() == [t]  # copied from source rank t mod 8
        assert rank_list_for_transform(t, src, dst) == [t + 4, t]  # = MindSpore's "required"


def test_spec_10_1_with_optimizer_sharding(tmp_path):
    src, dst, shape, out = run_10_1(tmp_path, opt=True)
    for t in range(4):
        cols = (128 * t, 128 * t + 128)
        reads = {((392 * (q // 4) + 98 * (q % 4), 392 * (q // 4) + 98 * (q % 4) + 98), cols): q for q in range(8)}
        check_output(out[t].path, "layer1.weight", shape, ((0, 784), cols), reads)
        assert rank_list_for_transform(t, src, dst) == [7, 6, 5, 4, 3, 2, 1, 0]


# ================================================================================ §10.2


@pytest.mark.parametrize("opt_size", [-1, 2])
def test_spec_10_2_tutorial(tmp_path, opt_size):
    src_layout = ParamLayout((2, 1, 2, 2), (2, 1))
    dst_layout = ParamLayout((2, 2, 1), (1, 0), 2, opt_size)
    src = strategy(tmp_path / "src.ckpt", {"layer1.weight": src_layout})
    dst = strategy(tmp_path / "dst.ckpt", {"layer1.weight": dst_layout})
    shape = (784, 512)
    paths = write_encoded_sources(tmp_path / "src", Topology.from_strategy(StrategyFile({"layer1.weight": src_layout})),
                                  {"layer1.weight": shape})
    out = transform_checkpoints(tmp_path / "src", tmp_path / "out", "checkpoint_", src, dst, verify_replicas=False)
    table = {0: ((0, 196), (0, 2), [2, 0]), 1: ((392, 588), (1, 3), [3, 1]),
             2: ((196, 392), (0, 2), [2, 0]), 3: ((588, 784), (1, 3), [3, 1])}
    for t, (rows, (left, right), required) in table.items():
        check_output(out[t].path, "layer1.weight", shape, (rows, (0, 512)),
                     {(rows, (0, 256)): left, (rows, (256, 512)): right})
        with CheckpointReader(out[t].path) as r:
            assert r.entries["layer1.weight"].shape == (196, 512)
        assert out[t].path.endswith(f"rank_{t}/checkpoint_{t}.ckpt")
        assert rank_list_for_transform(t, src, dst) == required
        # the per-rank API, given exactly those files
        one = transform_checkpoint_by_rank(t, {r: paths[r] for r in required}, str(tmp_path / f"one{t}.ckpt"), src, dst,
                                           verify_replicas=False)
        assert one.sha256 == out[t].sha256


# ================================================================================ §10.3


def test_spec_10_3_pipeline_to_flat(tmp_path):
    stage_layouts = {"0-layer1.weight": ParamLayout((2, 2), (-1, 0), 2, -1),
                     "1-layer2.weight": ParamLayout((2, 2), (0, -1), 2, -1)}
    src = strategy(tmp_path / "src_merged.ckpt", stage_layouts, stages=(0, 1))
    dst = strategy(tmp_path / "dst.ckpt", {"layer1.weight": ParamLayout((4,), (0, -1)),
                                           "layer2.weight": ParamLayout((4,), (-1, 0))})
    shapes = {"layer1.weight": (784, 512), "layer2.weight": (512, 512)}
    src_topo = Topology.from_strategy(StrategyFile(stage_layouts))
    assert (src_topo.stage_devices, src_topo.num_stages) == (4, 2)
    write_encoded_sources(tmp_path / "src", src_topo, shapes)
    out = transform_checkpoints(tmp_path / "src", tmp_path / "out", "checkpoint_", src, dst, verify_replicas=False)
    layer1_reads = {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3)}
    for t in range(4):
        rows = (196 * t, 196 * t + 196)
        a, b = layer1_reads[t]
        # rows [0,392) are held by local ranks 0 (cols <256) and 1 (cols >=256) of stage 0, etc.
        check_output(out[t].path, "layer1.weight", shapes["layer1.weight"], (rows, (0, 512)),
                     {(rows, (0, 256)): a, (rows, (256, 512)): b})
        cols = (128 * t, 128 * t + 128)
        check_output(out[t].path, "layer2.weight", shapes["layer2.weight"], ((0, 512), cols),
                     {((0, 128), cols): 4, ((128, 256), cols): 6, ((256, 384), cols): 5, ((384, 512), cols): 7})
        # global_step: from source local rank t mod 4 of the lowest stage, i.e. global rank t
        assert decode(out[t].path, "global_step")[1].tolist() == [t]
        ours = rank_list_for_transform(t, src, dst)
        assert ours == sorted({a, b, 4, 5, 6, 7, t}, reverse=True)
        assert set(ours) <= set(range(8))  # MindSpore requires all of [7, ..., 0]


def test_spec_10_plan_reads_without_files():
    """The same "reads from" columns straight from the planner, on an index of shapes only."""
    src = Topology.from_strategy(StrategyFile({"w": ParamLayout((2, 1, 2, 2), (2, 1))}))
    dst = Topology.from_strategy(StrategyFile({"w": ParamLayout((2, 2, 1), (1, 0), 2, -1)}))
    index = {g: {"w": TensorMeta("Float32", (784, 256), nbytes=784 * 256 * 4)} for g in range(8)}
    plan = Planner(src, dst, index).plan()
    assert [rp.source_ranks for rp in plan.ranks] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    copies = plan.rank(1).params[0].copies
    assert [(c.source_rank, c.source_box, c.target_box) for c in copies] == [
        (1, ((392, 588), (0, 256)), ((0, 196), (0, 256))),
        (3, ((392, 588), (0, 256)), ((0, 196), (256, 512))),
    ]
