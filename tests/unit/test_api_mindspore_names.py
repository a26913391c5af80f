"""The ``mindspore.parallel`` names of MindSpore 2.5+ (``convert_checkpoints``,
``convert_checkpoint_by_rank``, ``rank_list_for_convert``) and ``transform_checkpoints`` with
MindSpore's positional ``process_num``, ``output_format``: called as a MindSpore user calls them,
they write the very bytes the existing functions write (golden S1, MLP 8 -> 4 ranks)."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

import reshard_job
from reshard_job import api

S1 = Path(__file__).resolve().parents[1] / "golden" / "S1_mlp_tutorial_8to4"
SRC, SRC_STRATEGY, DST_STRATEGY = S1 / "src_checkpoints", str(S1 / "src_strategy.ckpt"), str(S1 / "dst_strategy.ckpt")

# MindSpore 2.5+'s own signatures (mindspore/parallel/checkpoint_convert.py, checkpoint_transform.py)
MINDSPORE_PARAMETERS = {
    "convert_checkpoints": ["src_checkpoints_dir", "dst_checkpoints_dir", "ckpt_prefix", "src_strategy_file",
                            "dst_strategy_file", "process_num", "output_format"],
    "transform_checkpoints": ["src_checkpoints_dir", "dst_checkpoints_dir", "ckpt_prefix", "src_strategy_file",
                              "dst_strategy_file", "process_num", "output_format"],
    "convert_checkpoint_by_rank": ["rank_id", "checkpoint_files_map", "save_checkpoint_file_name",
                                   "src_strategy_file", "dst_strategy_file"],
    "rank_list_for_convert": ["rank_id", "src_strategy_file", "dst_strategy_file"],
}


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, dict[str, bytes]]:
    """What the existing functions write, in each output format."""
    out = {}
    for fmt in ("ckpt", "safetensors"):
        folder = tmp_path_factory.mktemp(f"reference_{fmt}")
        api.transform_checkpoints(SRC, folder, "checkpoint_", SRC_STRATEGY, DST_STRATEGY, output_format=fmt)
        out[fmt] = _files(folder)
    assert len(out["ckpt"]) == len(out["safetensors"]) == 4
    return out


@pytest.mark.parametrize("name", sorted(MINDSPORE_PARAMETERS))
def test_the_names_take_mindspores_parameters_in_mindspores_order(name):
    function = getattr(reshard_job, name)
    positional = [p.name for p in inspect.signature(function).parameters.values()
                  if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional == MINDSPORE_PARAMETERS[name]
    assert name in reshard_job.__all__ and name in api.__all__


def test_the_convert_names_are_the_transform_functions():
    assert reshard_job.convert_checkpoints is api.transform_checkpoints
    assert reshard_job.convert_checkpoint_by_rank is api.transform_checkpoint_by_rank
    assert reshard_job.rank_list_for_convert is api.rank_list_for_transform


@pytest.mark.parametrize("fmt", ["ckpt", "safetensors"])
def test_positional_process_num_and_output_format_write_the_same_bytes(fmt, reference, tmp_path):
    reshard_job.transform_checkpoints(str(SRC), str(tmp_path / "t"), "checkpoint_", SRC_STRATEGY, DST_STRATEGY, 1, fmt)
    reshard_job.convert_checkpoints(str(SRC), str(tmp_path / "c"), "checkpoint_", SRC_STRATEGY, DST_STRATEGY, 2, fmt)
    assert _files(tmp_path / "t") == reference[fmt]
    assert _files(tmp_path / "c") == reference[fmt]


def test_convert_checkpoints_by_keyword_writes_the_same_bytes(reference, tmp_path):
    reshard_job.convert_checkpoints(src_checkpoints_dir=str(SRC), dst_checkpoints_dir=str(tmp_path / "k"),
                                    ckpt_prefix="checkpoint_", src_strategy_file=SRC_STRATEGY,
                                    dst_strategy_file=DST_STRATEGY, process_num=1, output_format="safetensors")
    assert _files(tmp_path / "k") == reference["safetensors"]


def test_a_bad_output_format_by_position_is_refused_as_by_keyword(tmp_path):
    with pytest.raises(reshard_job.ReshardError, match="output_format must be 'ckpt', 'safetensors'"):
        reshard_job.convert_checkpoints(str(SRC), str(tmp_path / "x"), "checkpoint_", SRC_STRATEGY, DST_STRATEGY, 1,
                                        "npz")
    assert not (tmp_path / "x").exists()


def test_rank_by_rank_with_the_convert_names_writes_the_same_bytes(reference, tmp_path):
    for rank in range(4):
        ranks = reshard_job.rank_list_for_convert(rank, SRC_STRATEGY, DST_STRATEGY)
        assert ranks == reshard_job.rank_list_for_transform(rank, SRC_STRATEGY, DST_STRATEGY)
        files = {r: str(SRC / f"rank_{r}" / f"checkpoint_{r}.ckpt") for r in ranks}
        positional = tmp_path / "p" / f"rank_{rank}" / f"checkpoint_{rank}.ckpt"
        positional.parent.mkdir(parents=True)
        reshard_job.convert_checkpoint_by_rank(rank, files, str(positional), SRC_STRATEGY, DST_STRATEGY)
        keyword = tmp_path / "k" / f"rank_{rank}" / f"checkpoint_{rank}.ckpt"
        keyword.parent.mkdir(parents=True)
        reshard_job.convert_checkpoint_by_rank(rank_id=rank, checkpoint_files_map=files,
                                               save_checkpoint_file_name=str(keyword),
                                               src_strategy_file=SRC_STRATEGY, dst_strategy_file=DST_STRATEGY)
        want = reference["ckpt"][f"rank_{rank}/checkpoint_{rank}.ckpt"]
        assert positional.read_bytes() == want and keyword.read_bytes() == want


def test_the_strategies_may_also_be_given_as_src_strategy_and_dst_strategy(reference, tmp_path):
    """``convert_checkpoints(src, dst, prefix, src_strategy=..., dst_strategy=...)``: the spelling
    some callers use for MindSpore's ``src_strategy_file``/``dst_strategy_file``."""
    reshard_job.convert_checkpoints(SRC, tmp_path / "out", "checkpoint_", src_strategy=SRC_STRATEGY,
                                    dst_strategy=DST_STRATEGY)
    assert _files(tmp_path / "out") == reference["ckpt"]
    with pytest.raises(TypeError, match="not both"):
        reshard_job.convert_checkpoints(SRC, tmp_path / "again", "checkpoint_", SRC_STRATEGY, src_strategy=SRC_STRATEGY)
