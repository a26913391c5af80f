"""A MindFormers save whose ``opt-`` files were deleted (to keep only the weights): the weights
still convert and export, exactly as from the whole save; a conversion that needs anything of an
absent file is refused in one line naming it, and a parameter only part of whose shards are
there is refused whatever the selection (its part would pass for the whole tensor)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from reshard_job.formats.mindformers_metadata import MindFormersFormatError
from reshard_job.sources.mindformers_save import load_mindformers

M1A = Path(__file__).parents[2] / "golden" / "M1a_mf_llama_dp2mp2os_bf16_to_mp4"
ITERATION = "iteration_00000020"


@pytest.fixture
def run_app(app):
    return lambda cwd, *args: app(cwd, *args, "job.progress=false", "lineage.enabled=false", timeout=180)


def _save(tmp_path: Path, *deleted: str) -> Path:
    root = tmp_path / "mf"
    shutil.copytree(M1A / "src_mindformers", root)
    for pattern in deleted:
        for f in (root / ITERATION).glob(pattern):
            f.unlink()
    return root


def _digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*.ckpt")) + sorted(folder.glob("*.safetensors"))}


def _target(*extra: str) -> list[str]:
    return ["target=strategy", f"target.strategy={M1A / 'dst_strategy.ckpt'}", *extra]


def test_the_weights_of_a_save_without_its_opt_files_convert_as_from_the_whole_save(tmp_path, run_app):
    whole = run_app(tmp_path, f"source.checkpoints={M1A / 'src_mindformers'}", *_target("target.include=weights"),
                    "output.dir=whole")
    assert whole.returncode == 0, whole.stderr
    root = _save(tmp_path, "llama-opt-*")
    res = run_app(tmp_path, f"source.checkpoints={root}", *_target("target.include=weights"), "output.dir=out")
    assert res.returncode == 0, res.stderr
    assert _digests(tmp_path / "out") == _digests(tmp_path / "whole")  # rank files and strategy.ckpt
    assert sum(k.startswith("rank_") for k in _digests(tmp_path / "out")) == 4
    warning = [ln for ln in res.stderr.splitlines() if "WARNING" in ln]
    assert len(warning) == 1 and "4 file(s) of the save are absent" in warning[0] and "42 parameter(s)" in warning[0]
    selection = json.loads((tmp_path / "out" / "manifest.json").read_text())["selection"]
    assert selection["left_out"] == 42 and selection["left_out_first"][0] == "adam_m.lm_head.weight"
    # the same selection said with patterns
    res = run_app(tmp_path, f"source.checkpoints={root}", *_target("target.exclude=[adam_m.*,adam_v.*]"),
                  "output.dir=excluded")
    assert res.returncode == 0, res.stderr
    assert _digests(tmp_path / "excluded") == _digests(tmp_path / "out")


def test_an_export_of_a_save_without_its_opt_files_lists_them_as_not_exported(tmp_path, run_app):
    whole = run_app(tmp_path, f"source.checkpoints={M1A / 'src_mindformers'}", "target=hf_export", "output.dir=whole")
    assert whole.returncode == 0, whole.stderr
    root = _save(tmp_path, "llama-opt-*")
    res = run_app(tmp_path, f"source.checkpoints={root}", "target=hf_export", "output.dir=out")
    assert res.returncode == 0, res.stderr
    assert _digests(tmp_path / "out") == _digests(tmp_path / "whole") and _digests(tmp_path / "out")
    omitted = json.loads((tmp_path / "out" / "manifest.json").read_text())["plan"]["omitted"]
    absent = [o["name"] for o in omitted if "absent from the save" in o["reason"]]
    assert len(absent) == 42 and all(n.startswith(("adam_m.", "adam_v.")) for n in absent)


@pytest.mark.parametrize("deleted, args, named", [
    ("llama-opt-*", (), "llama-opt-0000000-0000004.safetensors"),  # every parameter asked for
    ("llama-opt-*", ("target.exclude=[adam_m.*]",), "llama-opt-0000000-0000004.safetensors"),  # adam_v still
    ("llama-model-0000002-*", ("target.include=weights",), "llama-model-0000002-0000004.safetensors"),  # part of weights
    ("llama-opt-0000001-*", ("target.include=weights",), "llama-opt-0000001-0000004.safetensors"),  # part of adam_*
])
def test_a_conversion_needing_what_an_absent_file_holds_is_refused_in_one_line(tmp_path, run_app, deleted, args, named):
    root = _save(tmp_path, deleted)
    res = run_app(tmp_path, f"source.checkpoints={root}", *_target(*args), "output.dir=out")
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert str(root / ITERATION / named) in res.stderr and "file not found" in res.stderr
    assert not (tmp_path / "out").exists()
    if not args:  # only optimizer states are missing: the way out is said
        assert "target.include=weights converts the weights without them" in res.stderr


def test_only_the_job_leaves_out_what_absent_files_hold(tmp_path):
    """The save as the API and the audit load it is refused as before: they would read part of a model."""
    root = _save(tmp_path, "llama-opt-*")
    with pytest.raises(MindFormersFormatError, match="llama-opt-0000000-0000004.safetensors: file not found"):
        load_mindformers(root)
    save = load_mindformers(root, absent_files_ok=True)
    assert len(save.params) == 21 and len(save.unavailable) == 42 and len(save.absent_files) == 4
    assert not any(n.startswith("adam_") for files in save.file_tensors.values() for n in files)
