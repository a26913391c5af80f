"""Rank lists of redundancy-removed saves, where each slice is stored by one of its replicas only.

Strategies cannot tell such a save from a complete one, so a list computed from them alone may name
files that lack the slices. Given the save (``src_checkpoints_dir``, or a MindFormers folder whose
metadata.json records where each shard is stored), ``rank_list_for_transform`` lists the ranks
whose files hold what the conversion reads, and those files alone convert the rank.
"""

from __future__ import annotations

import pytest

from mf_save import dedup_params, dedup_writer, write_mf_save  # tests/mf_save.py
from reshard_job import rank_list_for_transform, transform_checkpoint_by_rank, transform_checkpoints
from reshard_job.api import mindformers_rank_files
from reshard_job.core.strategy_model import ParamLayout, StrategyFile, StrategyItem
from reshard_job.errors import PlanError
from reshard_job.formats.strategy import write_strategy

from .test_practical_layouts import remove_redundancy


def s1(all_golden_scenarios):
    return next(s for s in all_golden_scenarios if s.name.startswith("S1_"))


@pytest.mark.parametrize("keep", ["last", "spread"])
def test_given_the_save_the_list_names_the_files_holding_the_slices(tmp_path, all_golden_scenarios, keep):
    """S1 (MindSpore's files) with each slice kept on one replica: the list from strategies alone
    misses the holders; the list from the save converts each rank to MindSpore's own tensors."""
    sc = s1(all_golden_scenarios)
    files = remove_redundancy(sc.src_checkpoints, tmp_path / "src", sc.src_strategy, keep)
    for rank in sc.dst_ranks:
        alone = rank_list_for_transform(rank, sc.src_strategy, sc.dst_strategy)
        given = rank_list_for_transform(rank, sc.src_strategy, sc.dst_strategy, src_checkpoints_dir=tmp_path / "src")
        assert given == sorted(given, reverse=True) and all(type(r) is int for r in given)
        assert not set(given) <= set(alone), (rank, given, alone)
        written = transform_checkpoint_by_rank(rank, {r: files[r] for r in given}, str(tmp_path / f"r{rank}.ckpt"),
                                               sc.src_strategy, sc.dst_strategy)
        assert dict(written.tensors) == sc.checked(rank, "by_rank")
        # minimal=False adds MindSpore's list (what its own converter requires) to the holders
        full = rank_list_for_transform(rank, sc.src_strategy, sc.dst_strategy, src_checkpoints_dir=tmp_path / "src",
                                       minimal=False)
        assert set(full) == set(given) | set(sc.rank_list(rank))
    # rank 0 from strategies alone: [2, 0], whose files hold none of the laid-out parameters (kept on 5 and 7)
    if keep == "last":
        assert rank_list_for_transform(0, sc.src_strategy, sc.dst_strategy) == [2, 0]
        with pytest.raises(PlanError, match="is in the source checkpoints"):
            transform_checkpoint_by_rank(0, {r: files[r] for r in (2, 0)}, str(tmp_path / "alone.ckpt"),
                                         sc.src_strategy, sc.dst_strategy)


def test_a_complete_save_gives_the_list_of_the_strategies(all_golden_scenarios):
    sc = s1(all_golden_scenarios)
    for rank in sc.dst_ranks:
        assert (rank_list_for_transform(rank, sc.src_strategy, sc.dst_strategy, src_checkpoints_dir=sc.src_checkpoints)
                == rank_list_for_transform(rank, sc.src_strategy, sc.dst_strategy))


def test_mindformers_metadata_records_where_each_shard_is_stored(tmp_path):
    """A MindFormers redundancy-removed save (each shard stored by one rank of its group) given as
    the source strategy: its metadata.json says which rank stored what, so the list names those
    ranks, and their files alone give the rank of the full conversion, byte for byte."""
    folder = write_mf_save(tmp_path / "mf", dedup_params(), stored_by=dedup_writer, world=4)
    dst = str(tmp_path / "dst.ckpt")
    write_strategy(StrategyFile({"model.wq.weight": ParamLayout((2,), (0, -1)),
                                 "model.wo.weight": ParamLayout((2,), (-1, 0)),
                                 "model.norm.weight": ParamLayout((2,), (-1,))}, [StrategyItem("op", 0, ())]), dst)
    full = transform_checkpoints(tmp_path / "mf", tmp_path / "out", "c_", None, dst)
    every = mindformers_rank_files(tmp_path / "mf")
    for meta in (str(folder / "metadata.json"), str(folder)):
        for rank in (0, 1):
            needed = rank_list_for_transform(rank, meta, dst)
            assert set(needed) <= set(every)
            one = transform_checkpoint_by_rank(rank, {r: every[r] for r in needed}, str(tmp_path / f"m{rank}.ckpt"),
                                               str(folder / "metadata.json"), dst)
            assert one.sha256 == full[rank].sha256
    # model.wo.weight's column block 0 is stored by rank 2 only (dedup_writer), which a list from
    # the layouts alone (MindSpore's replica: rank 0) would not name
    assert 2 in rank_list_for_transform(0, str(folder), dst)


def test_the_save_as_source_without_strategies(tmp_path, all_golden_scenarios):
    """A MindFormers save given as checkpoints alone, and a single unsharded source (S5b): without a
    target strategy there is one target rank; MindSpore's list without a source strategy is [0]."""
    write_mf_save(tmp_path / "mf", dedup_params(), stored_by=dedup_writer, world=4)
    assert rank_list_for_transform(0, None, None, src_checkpoints_dir=tmp_path / "mf") == [3, 2, 1, 0]
    with pytest.raises(PlanError, match=r"^target rank 1 is outside 0\.\.0 \(without a target strategy"):
        rank_list_for_transform(1, None, None, src_checkpoints_dir=tmp_path / "mf")
    sc = next(s for s in all_golden_scenarios if s.name.startswith("S5b_"))
    for minimal in (True, False):
        assert rank_list_for_transform(5, None, sc.dst_strategy, src_checkpoints_dir=sc.src_checkpoints,
                                       minimal=minimal) == [0]
