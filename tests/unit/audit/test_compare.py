"""``audit compare`` on checkpoints MindSpore and MindFormers wrote (tests/golden): the same model in
two layouts is equal parameter by parameter, a changed byte names its parameter and only it, and
what cannot be compared is refused in one line naming the side. In-process (``main(argv)``), on
real files; the job's own outputs are compared in tests/e2e/test_compare_cli.py."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from reshard_job.audit import main
from reshard_job.core.fingerprint import ALGORITHM
from reshard_job.formats.ckpt.reader import CheckpointReader

GOLDEN = Path(__file__).resolve().parents[2] / "golden"


@dataclass
class Result:
    code: int
    out: str
    err: str

    @property
    def lines(self) -> list[str]:
        return self.out.splitlines()


@pytest.fixture
def audit(capsys, tmp_path, monkeypatch):
    """Run ``python -m reshard_job.audit compare ...`` in-process, in an empty directory (no database)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RESHARD_LINEAGE_URL", raising=False)

    def run(*argv: str) -> Result:
        code = main(["compare", *map(str, argv)])
        captured = capsys.readouterr()
        return Result(code, captured.out, captured.err)

    return run


def golden(name: str) -> tuple[dict, Path]:
    d = GOLDEN / name
    return json.loads((d / "manifest.json").read_text()), d


def source_and_expected(name: str, strategy_key: str = "strategy_file") -> list[str]:
    """The audit arguments for: the scenario's source (with its strategy) vs MindSpore's output."""
    manifest, d = golden(name)
    args = [d / "src_checkpoints", d / "expected"]
    src = manifest["src"].get(strategy_key) or manifest["src"].get("strategy_dir")
    dst = manifest["dst"]["strategy_file"]
    if src:
        args += ["--a-strategy", d / src]
    if dst:
        args += ["--b-strategy", d / dst]
    return args


@pytest.mark.parametrize("name,strategy_key", [
    ("S1_mlp_tutorial_8to4", "strategy_file"),
    ("S2_block_mp4dp2opt_to_mp4", "strategy_file"),
    ("S5a_merge_8to1", "strategy_file"),
    ("S5b_split_1to8", "strategy_file"),
    ("S5c_merge_pipeline2x4_to1", "strategy_dir"),  # per-stage strategy files
    ("S5c_merge_pipeline2x4_to1", "merged_strategy_file"),  # the same, merged by MindSpore
])
def test_a_golden_source_equals_what_mindspore_made_of_it(audit, name, strategy_key):
    manifest, _ = golden(name)
    result = audit(*source_and_expected(name, strategy_key))
    assert (result.code, result.err) == (0, "")
    assert result.lines == [f"equal: {len(manifest['params'])} parameters ({ALGORITHM})"]


def test_mindspores_pipeline_output_is_refused_for_its_accu_grads_and_equal_in_every_weight(audit):
    """S3: MindSpore copies each pipeline stage's accu_grads.* unconverted into target rank 0 (a
    quirk its golden manifest flags, 30 of them); every weight is equal."""
    name = "S3_pipeline2x4opt_to_4"
    manifest, _ = golden(name)
    categories = manifest["verification"]["transform_checkpoints"]["categories"]
    quirks = sorted({n for rank in categories.values() for n, c in rank.items() if c == "quirk_src_only_passthrough"})
    assert len(quirks) == 30

    # target rank 0 holds each accu_grads as copied from its stage; ranks 1-3, which the strategy
    # says hold the same data, hold it otherwise: MindSpore's output is refused as inconsistent
    result = audit(*source_and_expected(name))
    assert result.code == 2 and "'accu_grads." in result.err and "differs between source ranks" in result.err

    weights = audit(*source_and_expected(name), "--weights")
    assert weights.code == 0
    # 122 = 30 weights + their adam_m, adam_v and accu_grads + global_step and learning_rate
    assert weights.lines == [f"equal: 30 weights ({ALGORITHM})"]


@pytest.mark.parametrize("name", ["M1a_mf_llama_dp2mp2os_bf16_to_mp4", "M1b_mf_llama_pp2dp2mp2os2_to_mp4"])
def test_a_mindformers_save_equals_what_mindformers_loaded_from_it(audit, name):
    manifest, d = golden(name)
    result = audit(d / "src_mindformers", d / "expected", "--b-strategy", d / "dst_strategy.ckpt")
    assert (result.code, result.lines) == (0, [f"equal: {len(manifest['params'])} parameters ({ALGORITHM})"])


def flip_one_bit(checkpoint: Path, name: str) -> None:
    """Flip the lowest bit of one byte in the middle of tensor `name`'s stored bytes."""
    with CheckpointReader(checkpoint) as reader:
        _, _, offset, length = reader.whole_span(name)
    data = bytearray(checkpoint.read_bytes())
    data[offset + length // 2] ^= 0x01
    checkpoint.chmod(0o644)
    checkpoint.write_bytes(bytes(data))


def test_one_flipped_bit_names_its_parameter_and_no_other(audit, tmp_path):
    _, d = golden("S2_block_mp4dp2opt_to_mp4")
    copy = tmp_path / "copy"
    shutil.copytree(d / "src_checkpoints", copy)
    flip_one_bit(copy / "rank_5" / "checkpoint_5.ckpt", "layers.0.ffn.w2.weight")
    strategy = d / "src_strategy.ckpt"
    result = audit(d / "src_checkpoints", copy, "--a-strategy", strategy, "--b-strategy", strategy)
    assert result.code == 1
    assert result.lines == ["differs    layers.0.ffn.w2.weight",
                            f"different: 1 of 53 parameters differ, 0 only in A, 0 only in B ({ALGORITHM})"]


def test_parameters_on_one_side_only_are_listed_by_side(audit, tmp_path, helpers):
    common = np.arange(12, dtype=np.float32).reshape(3, 4)
    helpers.write_sharded(tmp_path / "a", {"w": common, "adam_m.w": common, "only_a": np.ones(2, np.int32)})
    helpers.write_sharded(tmp_path / "b", {"w": common, "only_b": np.ones(2, np.int32), "global_step": np.int32(3)})
    result = audit(tmp_path / "a", tmp_path / "b")
    assert result.code == 1
    assert result.lines == ["only in A  adam_m.w", "only in A  only_a", "only in B  global_step", "only in B  only_b",
                            f"different: 0 of 1 parameters differ, 2 only in A, 2 only in B ({ALGORITHM})"]
    # training state left out on both sides, as an export for inference leaves it out
    weights = audit(tmp_path / "a", tmp_path / "b", "--weights", "--json")
    assert weights.code == 1 and json.loads(weights.out)["only_a"] == ["only_a"]


def test_control_characters_in_names_are_shown_escaped_one_name_a_line(audit, tmp_path, helpers):
    name = "evil\x1b[2J\nname\t"
    helpers.write_sharded(tmp_path / "a", {name: np.zeros(4, np.float32)})
    helpers.write_sharded(tmp_path / "b", {name: np.ones(4, np.float32)})
    result = audit(tmp_path / "a", tmp_path / "b")
    assert result.code == 1
    assert result.lines[0] == "differs    evil\\x1b[2J\\x0aname\\x09"
    assert len(result.lines) == 2 and "\x1b" not in result.out
    assert json.loads(audit(tmp_path / "a", tmp_path / "b", "--json").out)["differ"] == [name]


def test_json_report_shape(audit):
    result = audit(*source_and_expected("S2_block_mp4dp2opt_to_mp4"), "--json")
    report = json.loads(result.out)
    assert result.code == 0
    assert {"equal", "algorithm", "differ", "only_a", "only_b"} <= report.keys()
    assert (report["equal"], report["algorithm"], report["differ"], report["only_a"], report["only_b"]) == \
        (True, ALGORITHM, [], [], [])
    assert report["a"]["read"] == report["b"]["read"] == "files"  # golden folders have no record of ours


def one_line_error(result: Result, side: str) -> str:
    assert result.code == 2 and result.out == ""
    assert result.err.count("\n") == 1 and "Traceback" not in result.err, result.err
    assert result.err.startswith(f"error: {side}: "), result.err
    return result.err


def test_a_missing_path_is_an_error_naming_its_side(audit, tmp_path):
    _, d = golden("S5b_split_1to8")
    assert str(tmp_path / "nowhere") in one_line_error(audit(d / "src_checkpoints", tmp_path / "nowhere"), "B")
    assert "no such file or directory" in one_line_error(audit(tmp_path / "nowhere", d / "src_checkpoints"), "A")
    assert "nor a run id" in one_line_error(audit("0123456789abcdef", d / "src_checkpoints"), "A")


def test_sharded_folders_without_their_strategy_are_refused_with_the_flag_to_give(audit):
    _, d = golden("S2_block_mp4dp2opt_to_mp4")
    err = one_line_error(audit(d / "expected", d / "src_checkpoints"), "A")
    assert "--a-strategy" in err


def test_a_single_checkpoint_file_is_a_whole_model(audit):
    _, d = golden("S5a_merge_8to1")
    got = audit(d / "src_checkpoints", d / "expected" / "rank_0" / "checkpoint_0.ckpt",
                "--a-strategy", d / "src_strategy.ckpt", "--json")
    assert got.code == 0, got.err
    assert json.loads(got.out)["equal"] is True


def test_a_folder_whose_replicas_disagree_is_refused_naming_the_parameter(audit, tmp_path):
    """The plan fingerprints one copy of a replicated block; the other copies are compared with it."""
    _, d = golden("S1_mlp_tutorial_8to4")
    copy = tmp_path / "copy"
    shutil.copytree(d / "src_checkpoints", copy)
    flip_one_bit(copy / "rank_2" / "checkpoint_2.ckpt", "layer3.bias")  # not the copy the plan fingerprints
    strategy = d / "src_strategy.ckpt"
    err = one_line_error(audit(copy, d / "src_checkpoints", "--a-strategy", strategy, "--b-strategy", strategy), "A")
    assert "'layer3.bias'" in err and "differs between source ranks" in err


def test_a_side_refused_after_a_note_about_it_is_its_one_error_line(audit, tmp_path):
    """A folder whose manifest.json is a folder (so its record is not used: a note) and that holds no
    checkpoint: the error alone, not the note before it."""
    (tmp_path / "odd" / "manifest.json").mkdir(parents=True)
    _, d = golden("S5b_split_1to8")
    one_line_error(audit(tmp_path / "odd", d / "src_checkpoints"), "A")
