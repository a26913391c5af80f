"""What a conversion leaves out is said in one WARNING line, and only what it does leave out."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from reshard_job import rank_list_for_transform, transform_checkpoint_by_rank, transform_checkpoints
from reshard_job.errors import MissingRankError
from reshard_job.core.strategy_model import ParamLayout, StrategyFile, StrategyItem
from reshard_job.formats.strategy import write_strategy

ABSENT = "in no source checkpoint"


def _pipeline(tmp_path, helpers, *, ghost: bool = False):
    """Two stages of two ranks: 'emb' on stage 0, 'head' on stage 1 (and, with `ghost`, a 'ghost'
    on stage 0 that the strategy lays out and no file holds); to two stages of two ranks, the other
    way round within each stage."""
    layouts = {"0-emb": ParamLayout((2,), (0, -1)), "1-head": ParamLayout((2,), (0, -1))}
    src = StrategyFile(dict(layouts, **({"0-ghost": ParamLayout((2,), (0,))} if ghost else {})),
                       [StrategyItem("op0", 0, ()), StrategyItem("op1", 1, ())])
    dst = StrategyFile({"0-emb": ParamLayout((2,), (-1, 0)), "1-head": ParamLayout((2,), (-1, 0))},
                       [StrategyItem("op0", 0, ()), StrategyItem("op1", 1, ())])
    write_strategy(src, tmp_path / "src.ckpt")
    write_strategy(dst, tmp_path / "dst.ckpt")
    tensors = {"emb": np.arange(24, dtype=np.float32).reshape(4, 6), "head": np.ones((4, 2), np.float32)}
    files = helpers.write_sharded(tmp_path / "src", tensors, StrategyFile(layouts, src.items))
    return files, str(tmp_path / "src.ckpt"), str(tmp_path / "dst.ckpt")


def _absent_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and ABSENT in r.getMessage()]


def test_one_rank_given_the_files_it_reads_warns_about_nothing(tmp_path, helpers, caplog):
    """Target rank 1 (of stage 0) is given the source's stage 0 files only: the parameters of stage
    1 are not 'left out of the outputs', it never reads them (a WARNING per call said so)."""
    files, src, dst = _pipeline(tmp_path, helpers)
    given = {g: files[g] for g in rank_list_for_transform(1, src, dst)}
    assert all(g < 2 for g in given)  # stage 0's files only: 'head' lives on stage 1
    with caplog.at_level(logging.WARNING, logger="reshard_job"):
        transform_checkpoint_by_rank(1, given, str(tmp_path / "one.ckpt"), src, dst)
    assert _absent_lines(caplog) == []


def test_a_parameter_the_files_of_its_stage_lack_is_named(tmp_path, helpers, caplog):
    files, src, dst = _pipeline(tmp_path, helpers, ghost=True)
    with caplog.at_level(logging.WARNING, logger="reshard_job"):
        transform_checkpoints(tmp_path / "src", tmp_path / "out", "checkpoint_", src, dst)
    assert _absent_lines(caplog) == ["1 parameter(s) of the source strategy are in no source checkpoint and will "
                                     "not be in the outputs: 'ghost'"]


def test_a_conversion_refused_for_missing_files_says_only_that(tmp_path, helpers, caplog):
    """The files of stage 1 are gone: the refusal names them, and no WARNING before it says their
    parameters 'will not be in the outputs' (the run writes nothing at all)."""
    files, src, dst = _pipeline(tmp_path, helpers)
    for g in (2, 3):
        os.remove(files[g])
        os.rmdir(os.path.dirname(files[g]))
    with caplog.at_level(logging.WARNING, logger="reshard_job"):
        with pytest.raises(MissingRankError, match="missing source checkpoints .*rank 2 .*rank 3"):
            transform_checkpoints(tmp_path / "src", tmp_path / "out", "checkpoint_", src, dst)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
