"""Errors of the planning stage: missing source files, strategies and checkpoints that disagree,
invalid layouts. Each is a ReshardError whose message names the rank or parameter at fault, and
nothing is written when the plan fails."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from reshard_job import rank_list_for_transform, transform_checkpoint_by_rank, transform_checkpoints
from reshard_job.errors import LayoutError, MissingRankError, PlanError, ReshardError
from reshard_job.formats.ckpt import CheckpointWriter
from reshard_job.formats.strategy import write_strategy
from reshard_job.core.strategy_model import ParamLayout, StrategyFile, StrategyItem


def copy_sources(scenario, dst: Path, drop=()) -> Path:
    shutil.copytree(scenario.src_checkpoints, dst)
    for r in drop:
        shutil.rmtree(dst / f"rank_{r}")
    return dst


def scenario(scenarios, prefix):
    return next(s for s in scenarios if s.name.startswith(prefix))


def files_under(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()] if path.exists() else []


# ================================================================================ missing ranks


def test_missing_ranks_are_all_listed_before_anything_is_written(all_golden_scenarios, tmp_path):
    sc = scenario(all_golden_scenarios, "S2_")  # every target rank reads every source rank
    src = copy_sources(sc, tmp_path / "src", drop=(1, 5))
    out = tmp_path / "out"
    with pytest.raises(MissingRankError) as ei:
        transform_checkpoints(src, out, "checkpoint_", sc.src_strategy, sc.dst_strategy)
    err = ei.value
    assert isinstance(err, PlanError) and isinstance(err, ReshardError)
    assert err.missing == {1: [0, 1, 2, 3], 5: [0, 1, 2, 3]}
    assert "rank 1 (needed by target ranks 0-3)" in str(err)
    assert "rank 5 (needed by target ranks 0-3)" in str(err)
    assert files_under(out) == []


def test_missing_rank_needed_by_some_targets_only(all_golden_scenarios, tmp_path):
    sc = scenario(all_golden_scenarios, "S1_")  # targets 1 and 3 read [3, 1]; 0 and 2 read [2, 0]
    src = copy_sources(sc, tmp_path / "src", drop=(3,))
    with pytest.raises(MissingRankError) as ei:
        transform_checkpoints(src, tmp_path / "out", "checkpoint_", sc.src_strategy, sc.dst_strategy)
    assert ei.value.missing == {3: [1, 3]}
    assert "needed by target ranks 1, 3" in str(ei.value)
    assert files_under(tmp_path / "out") == []


def test_unneeded_missing_rank_is_not_an_error(all_golden_scenarios, tmp_path, helpers):
    """MindSpore asks for ranks 4-7 too (replicas it never reads); we do not need them."""
    sc = scenario(all_golden_scenarios, "S1_")
    src = copy_sources(sc, tmp_path / "src", drop=(4, 5, 6, 7))
    out = transform_checkpoints(src, tmp_path / "out", "checkpoint_", sc.src_strategy, sc.dst_strategy)
    for rank, written in out.items():
        assert written.tensors == sc.checked(rank)


def test_missing_pipeline_stage(all_golden_scenarios, tmp_path):
    sc = scenario(all_golden_scenarios, "S3_")
    src = copy_sources(sc, tmp_path / "src", drop=(4, 5, 6, 7))
    for strategy in sc.src_strategy_variants:
        with pytest.raises(MissingRankError) as ei:
            transform_checkpoints(src, tmp_path / "out", "checkpoint_", strategy, sc.dst_strategy)
        assert set(ei.value.missing) == {4, 5, 6, 7}
        assert all(targets == [0, 1, 2, 3] for targets in ei.value.missing.values())
        assert files_under(tmp_path / "out") == []


def test_transform_by_rank_without_a_needed_file(all_golden_scenarios, tmp_path):
    sc = scenario(all_golden_scenarios, "S1_")
    files = {0: str(sc.src_file(0))}  # rank 0 also needs rank 2
    with pytest.raises(MissingRankError) as ei:
        transform_checkpoint_by_rank(0, files, str(tmp_path / "r0.ckpt"), sc.src_strategy, sc.dst_strategy)
    assert ei.value.missing == {2: [0]}
    assert not (tmp_path / "r0.ckpt").exists()


def test_target_rank_out_of_range(all_golden_scenarios, tmp_path):
    sc = scenario(all_golden_scenarios, "S1_")
    files = {r: str(sc.src_file(r)) for r in sc.src_ranks}
    with pytest.raises(PlanError, match="target rank 4"):
        transform_checkpoint_by_rank(4, files, str(tmp_path / "r4.ckpt"), sc.src_strategy, sc.dst_strategy)
    with pytest.raises(PlanError, match="target rank 9"):
        rank_list_for_transform(9, sc.src_strategy, sc.dst_strategy)
    with pytest.raises(TypeError):
        rank_list_for_transform("0", sc.src_strategy, sc.dst_strategy)


# ================================================================================ disagreements


def strategy(path: Path, layouts: dict) -> str:
    write_strategy(StrategyFile(layouts, [StrategyItem("op", 0, ())]), path)
    return str(path)


def write_ranks(root: Path, per_rank: dict[int, dict[str, tuple]]):
    """per_rank: rank -> name -> (array, dtype name or None)."""
    for rank, entries in per_rank.items():
        with CheckpointWriter(root / f"rank_{rank}" / f"checkpoint_{rank}.ckpt") as w:
            for name, (array, dt) in entries.items():
                w.add(name, array, dt)


def two_rank_case(tmp_path, rank1: dict, layout=ParamLayout((2,), (0, -1))):
    src = strategy(tmp_path / "src.ckpt", {"blk.w": layout})
    base = {"blk.w": (np.zeros((4, 3), np.float32), None), "step": (np.array(1), None)}
    write_ranks(tmp_path / "src", {0: base, 1: {**base, **rank1}})
    return src


def assert_plan_error(tmp_path, src, dst, cls, *needles):
    with pytest.raises(cls) as ei:
        transform_checkpoints(tmp_path / "src", tmp_path / "out", "checkpoint_", src, dst)
    for needle in needles:
        assert needle in str(ei.value)
    assert files_under(tmp_path / "out") == []
    return ei.value


def test_dtype_differs_across_ranks(tmp_path):
    src = two_rank_case(tmp_path, {"blk.w": (np.zeros((4, 3), np.float16), None)})
    assert_plan_error(tmp_path, src, None, PlanError, "'blk.w'", "dtype", "Float32", "Float16")


def test_bf16_and_uint16_are_different_dtypes(tmp_path):
    src = two_rank_case(tmp_path, {"blk.w": (np.zeros((4, 3), np.uint16), "BFloat16")})
    base = {"blk.w": (np.zeros((4, 3), np.uint16), "UInt16")}
    write_ranks(tmp_path / "src", {0: base})
    assert_plan_error(tmp_path, src, None, PlanError, "'blk.w'", "BFloat16", "UInt16")


def test_shape_differs_across_ranks(tmp_path):
    src = two_rank_case(tmp_path, {"blk.w": (np.zeros((5, 3), np.float32), None)})
    assert_plan_error(tmp_path, src, None, PlanError, "'blk.w'", "shape")


def test_parameter_missing_from_one_rank(tmp_path):
    src = strategy(tmp_path / "src.ckpt", {"blk.w": ParamLayout((2,), (0, -1)), "blk.b": ParamLayout((2,), (0,))})
    write_ranks(tmp_path / "src", {
        0: {"blk.w": (np.zeros((4, 3), np.float32), None), "blk.b": (np.zeros(2, np.float32), None)},
        1: {"blk.w": (np.zeros((4, 3), np.float32), None)},
    })
    assert_plan_error(tmp_path, src, None, PlanError, "'blk.b'", "rank", "1")


def test_local_shape_is_not_a_slice_of_the_strategys_shape(tmp_path):
    """A JSON strategy records the global shape: [4,3] slices over 2 ranks make [8,3], not [8,4]."""
    src = tmp_path / "src.json"
    write_strategy(StrategyFile({"blk.w": ParamLayout((2,), (0, -1), tensor_shape=(8, 4))},
                                [StrategyItem("op", 0, ())]), src)
    write_ranks(tmp_path / "src", {r: {"blk.w": (np.zeros((4, 3), np.float32), None)} for r in (0, 1)})
    assert_plan_error(tmp_path, str(src), None, PlanError, "'blk.w'", "[8, 3]", "[8, 4]")


def test_tensor_map_length_differs_from_the_tensor_rank(tmp_path):
    src = two_rank_case(tmp_path, {}, layout=ParamLayout((2,), (0, -1, -1)))
    assert_plan_error(tmp_path, src, None, LayoutError, "'blk.w'", "3 entries", "2 dimension")


def test_target_tensor_map_length_differs(tmp_path):
    src = two_rank_case(tmp_path, {})
    dst = strategy(tmp_path / "dst.ckpt", {"blk.w": ParamLayout((4,), (0,))})
    assert_plan_error(tmp_path, src, dst, LayoutError, "'blk.w'", "1 entries")


def test_indivisible_target_dimension(tmp_path):
    src = two_rank_case(tmp_path, {})  # global [8, 3]
    dst = strategy(tmp_path / "dst.ckpt", {"blk.w": ParamLayout((2,), (-1, 0))})
    assert_plan_error(tmp_path, src, dst, LayoutError, "'blk.w'", "dimension 1 of size 3", "2 equal parts")


def test_indivisible_optimizer_shard(tmp_path):
    src = two_rank_case(tmp_path, {})  # global [8, 3]
    dst = strategy(tmp_path / "dst.ckpt", {"blk.w": ParamLayout((2, 3), (1, -1), 1, -1)})  # 8 rows into 2*3
    assert_plan_error(tmp_path, src, dst, LayoutError, "'blk.w'", "dimension 0 of size 8", "6 equal parts")


def test_invalid_source_layout(tmp_path):
    src = two_rank_case(tmp_path, {}, layout=ParamLayout((2,), (1, -1)))
    assert_plan_error(tmp_path, src, None, LayoutError, "'blk.w'", "device axis 1")


def test_device_matrices_that_do_not_divide(tmp_path):
    src = strategy(tmp_path / "src.ckpt", {"a": ParamLayout((4,), (0,)), "b": ParamLayout((3,), (0,))})
    write_ranks(tmp_path / "src", {r: {"a": (np.zeros(1, np.float32), None)} for r in range(4)})
    err = assert_plan_error(tmp_path, src, None, LayoutError, "src.ckpt")
    assert "[3" in str(err) or "3]" in str(err)


def test_str_entry_cannot_be_laid_out(tmp_path):
    src = strategy(tmp_path / "src.ckpt", {"note": ParamLayout((2,), ())})
    for r in (0, 1):
        with CheckpointWriter(tmp_path / "src" / f"rank_{r}" / f"checkpoint_{r}.ckpt") as w:
            w.add("w", np.zeros(2, np.float32))
            w.add_str("note", "hello")
    assert_plan_error(tmp_path, src, None, PlanError, "'note'", "str")


def test_errors_from_corrupt_sources_name_the_file(all_golden_scenarios, tmp_path):
    sc = scenario(all_golden_scenarios, "S1_")
    src = copy_sources(sc, tmp_path / "src")
    bad = src / "rank_2" / "checkpoint_2.ckpt"
    data = bad.read_bytes()
    bad.chmod(0o644)
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(ReshardError) as ei:
        transform_checkpoints(src, tmp_path / "out", "checkpoint_", sc.src_strategy, sc.dst_strategy)
    assert str(bad) in str(ei.value)
    assert files_under(tmp_path / "out") == []
