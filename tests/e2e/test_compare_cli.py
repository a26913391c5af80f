"""``python -m reshard_job.audit compare`` on the job's own outputs: one model converted into three
layouts and formats is equal pairwise and to its source, by the fingerprints the manifests recorded
and by reading the files again; a byte changed in a source copy, or in an output after its manifest
was written, is found and named. The job runs in subprocesses, as users run it; the audit runs
in-process except where its exit status and stderr as a program are the point."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from itertools import combinations
from pathlib import Path

import pytest

from reshard_job.audit import main
from reshard_job.core.fingerprint import ALGORITHM
from reshard_job.formats.ckpt.reader import CheckpointReader

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
S2 = GOLDEN / "S2_block_mp4dp2opt_to_mp4"
M1A = GOLDEN / "M1a_mf_llama_dp2mp2os_bf16_to_mp4"
S2_SOURCE = [f"source.checkpoints={S2 / 'src_checkpoints'}", f"source.strategy={S2 / 'src_strategy.ckpt'}"]
S2_PARAMETERS = 53

# output name -> the job's overrides: S2's model as 4 .ckpt ranks (MindSpore's target strategy), as
# 2 safetensors ranks (a declarative layout), as an export for inference keeping everything; and a
# MindFormers save exported for inference (weights only, as exports are by default)
JOBS = {
    "ckpt4": [*S2_SOURCE, f"target.strategy={S2 / 'dst_strategy.ckpt'}"],
    "safetensors2": [*S2_SOURCE, "target=megatron", "target.devices=2", "target.layout.mesh={dp:1,mp:2}",
                     "target.format=safetensors"],
    "export": [*S2_SOURCE, "target=hf_export", "target.include=all", "target.max_shard_size=40KB"],
    "mindformers_export": [f"source.checkpoints={M1A / 'src_mindformers'}", "target=hf_export"],
}


def _environment() -> dict[str, str]:
    drop = ("HYDRA_FULL_ERROR", "RESHARD_JOB_FULL_ERROR", "RESHARD_LINEAGE_URL", "RESHARD_JOB_LINEAGE_URL")
    return {k: v for k, v in os.environ.items() if k not in drop}


def run_jobs(cwd: Path, jobs: dict[str, list[str]], *extra: str) -> dict[str, Path]:
    """Run the jobs side by side into cwd/<name>; their output directories."""
    processes = {name: subprocess.Popen([sys.executable, "-m", "reshard_job", *args, f"output.dir={cwd / name}",
                                         *extra], cwd=cwd, env=_environment(), stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True) for name, args in jobs.items()}
    for name, process in processes.items():
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, f"{name}: {err[-3000:]}"
    return {name: cwd / name for name in jobs}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, Path]:
    return run_jobs(tmp_path_factory.mktemp("converted"), JOBS, "lineage.enabled=false")


@dataclass
class Result:
    code: int
    out: str
    err: str

    @property
    def lines(self) -> list[str]:
        return self.out.splitlines()

    def json(self) -> dict:
        return json.loads(self.out)


@pytest.fixture
def audit(capsys, tmp_path, monkeypatch):
    """``python -m reshard_job.audit [--db URL] compare ...`` in-process."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RESHARD_LINEAGE_URL", raising=False)

    def run(*argv, db: str | None = None) -> Result:
        code = main([*(["--db", db] if db else []), "compare", *map(str, argv)])
        captured = capsys.readouterr()
        return Result(code, captured.out, captured.err)

    return run


def source_side(path: Path = S2 / "src_checkpoints") -> list:
    return [path, "--a-strategy", S2 / "src_strategy.ckpt"]


def flip_one_bit(checkpoint: Path, name: str) -> None:
    """Flip the lowest bit of one byte in the middle of tensor `name`'s stored bytes (size unchanged)."""
    with CheckpointReader(checkpoint) as reader:
        _, _, offset, length = reader.whole_span(name)
    data = bytearray(checkpoint.read_bytes())
    data[offset + length // 2] ^= 0x01
    checkpoint.chmod(0o644)  # the job publishes its outputs read-only
    checkpoint.write_bytes(bytes(data))


EQUAL = f"equal: {S2_PARAMETERS} parameters ({ALGORITHM})"


def test_an_output_equals_its_source_by_its_recorded_fingerprints_until_a_source_byte_changes(audit, outputs,
                                                                                              tmp_path):
    result = audit(*source_side(), outputs["ckpt4"], "--json")
    assert result.code == 0, result.err
    report = result.json()
    assert report["equal"] and report["compared"] == S2_PARAMETERS
    assert report["b"]["read"] == "recorded" and report["b"]["from"] == str(outputs["ckpt4"] / "manifest.json")
    assert audit(*source_side(), outputs["ckpt4"]).lines == [EQUAL]

    copy = tmp_path / "source_copy"
    shutil.copytree(S2 / "src_checkpoints", copy)
    flip_one_bit(copy / "rank_0" / "checkpoint_0.ckpt", "layers.0.attention.wq.weight")
    changed = audit(*source_side(copy), outputs["ckpt4"])
    assert changed.code == 1
    assert changed.lines == ["differs    layers.0.attention.wq.weight", f"different: 1 of {S2_PARAMETERS} parameters "
                             f"differ, 0 only in A, 0 only in B ({ALGORITHM})"]


def _read_from_files(outputs: dict[str, Path], root: Path, name: str) -> list:
    """Audit arguments reading output `name` from its files: a copy without its manifest (rank folders
    then with the strategy the job wrote beside them)."""
    copy = root / name
    shutil.copytree(outputs[name], copy, ignore=shutil.ignore_patterns("manifest.json", ".reshard_job"))
    strategy = copy / "strategy.ckpt"
    return [copy, "--a-strategy", strategy] if strategy.exists() else [copy]


def test_three_layouts_and_formats_of_one_model_are_equal_pairwise(audit, outputs, tmp_path):
    names = ["ckpt4", "safetensors2", "export"]
    for a, b in combinations(names, 2):
        recorded = audit(outputs[a], outputs[b], "--json")
        assert (recorded.code, recorded.json()["equal"]) == (0, True), (a, b, recorded.out, recorded.err)
        assert recorded.json()["a"]["read"] == recorded.json()["b"]["read"] == "recorded"
    read_again = {name: _read_from_files(outputs, tmp_path, name) for name in names}
    for a, b in combinations(names, 2):
        b_args = [read_again[b][0]] + (["--b-strategy", read_again[b][2]] if len(read_again[b]) > 1 else [])
        result = audit(*read_again[a], *b_args, "--json")
        assert (result.code, result.err) == (0, ""), (a, b)
        assert result.json()["a"]["read"] == result.json()["b"]["read"] == "files"
        assert result.json()["compared"] == S2_PARAMETERS


def test_a_mindformers_save_equals_its_export_in_weights(audit, outputs):
    result = audit(M1A / "src_mindformers", outputs["mindformers_export"], "--weights")
    assert (result.code, result.lines) == (0, [f"equal: 21 weights ({ALGORITHM})"])
    everything = audit(M1A / "src_mindformers", outputs["mindformers_export"], "--json")
    assert everything.code == 1
    report = everything.json()
    assert report["differ"] == [] and report["only_b"] == [] and report["compared"] == 21
    assert len(report["only_a"]) == 44  # adam_m.* and adam_v.* of 21 weights, global_step, learning_rate
    counters = ("global_step", "learning_rate")
    assert all(n.startswith(("adam_m.", "adam_v.")) for n in report["only_a"] if n not in counters)


def test_an_output_file_changed_after_its_manifest_is_read_again_not_trusted(audit, outputs, tmp_path):
    assert audit(*source_side(), outputs["ckpt4"], "--json").json()["b"]["read"] == "recorded"
    moved = tmp_path / "moved"
    shutil.copytree(outputs["ckpt4"], moved)
    flip_one_bit(moved / "rank_2" / "checkpoint_2.ckpt", "layers.0.ffn.w1.weight")
    result = audit(*source_side(), moved, "--json")
    assert result.code == 1
    report = result.json()
    assert report["differ"] == ["layers.0.ffn.w1.weight"] and report["b"]["read"] == "files"
    assert "was changed after the manifest was written" in report["b"]["note"]
    assert result.err.startswith("note: B: ") and result.err.count("\n") == 1  # the reason, also on stderr


def _restamped(path: Path, times: os.stat_result) -> None:
    os.utime(path, ns=(times.st_atime_ns, times.st_mtime_ns))


@pytest.mark.parametrize("how", ["modification time put back", "manifest touched", "an older conversion's file"])
def test_a_change_that_keeps_size_and_modification_time_is_not_trusted(audit, tmp_path, how):
    """File times are anyone's to set: a byte flipped with its modification time put back, a
    manifest touched after the change, or a file of the same size copied with its (older) times
    from a conversion of another model are all seen by the files' change times against the time
    the manifest records it was written, and the files are read."""
    out = run_jobs(tmp_path, {"out": JOBS["ckpt4"]}, "lineage.enabled=false")["out"]
    rank_file = out / "rank_1" / "checkpoint_1.ckpt"
    assert audit(*source_side(), out, "--json").json()["b"]["read"] == "recorded"
    if how == "an older conversion's file":
        other = tmp_path / "other"
        shutil.copytree(S2 / "src_checkpoints", other)
        for checkpoint in other.glob("rank_*/*.ckpt"):  # another model: every slice of wq changed alike
            flip_one_bit(checkpoint, "layers.0.attention.wq.weight")
        older = run_jobs(tmp_path, {"older": [f"source.checkpoints={other}", *S2_SOURCE[1:],
                                              *JOBS["ckpt4"][2:]]}, "lineage.enabled=false")["older"]
        hour_ago = (out / "manifest.json").stat().st_mtime_ns - 3600 * 10**9
        os.utime(older / "rank_1" / "checkpoint_1.ckpt", ns=(hour_ago, hour_ago))  # converted an hour before
        rank_file.chmod(0o644)
        rank_file.unlink()
        shutil.copy2(older / "rank_1" / "checkpoint_1.ckpt", rank_file)  # same size, its own older times
        assert rank_file.stat().st_mtime_ns < (out / "manifest.json").stat().st_mtime_ns
    else:
        times = rank_file.stat()
        flip_one_bit(rank_file, "layers.0.attention.wq.weight")
        if how == "modification time put back":
            _restamped(rank_file, times)
        else:
            (out / "manifest.json").touch()
    result = audit(*source_side(), out, "--json")
    report = result.json()
    assert (result.code, report["b"]["read"]) == (1, "files"), report
    assert "layers.0.attention.wq.weight" in report["differ"]
    assert "rank_1/checkpoint_1.ckpt was changed after the manifest was written" in report["b"]["note"]


def _with_record(outputs: dict[str, Path], root: Path, name: str, **changes) -> Path:
    """A copy of output `name` whose manifest's fingerprints section has `changes`, rewritten after
    its files were copied (so its record would otherwise be used)."""
    copy = root / name
    shutil.copytree(outputs[name], copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["fingerprints"].update(changes)
    manifest["created_at"] = datetime.now(timezone.utc).isoformat()  # written after its (copied) files
    (copy / "manifest.json").chmod(0o644)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def test_records_of_another_algorithm_or_without_the_outputs_are_not_compared(audit, outputs, tmp_path):
    other = "other-v0"
    old_a = _with_record(outputs, tmp_path / "a", "ckpt4", algorithm=other)
    old_b = _with_record(outputs, tmp_path / "b", "export", algorithm=other)
    both_old = audit(old_a, old_b, "--json").json()  # alike: the records are compared as they are
    assert (both_old["equal"], both_old["algorithm"], both_old["a"]["read"], both_old["b"]["read"]) == \
        (True, other, "recorded", "recorded")

    mixed = audit(old_a, outputs["export"], "--json")
    report = mixed.json()
    assert (mixed.code, report["algorithm"], report["a"]["read"], report["b"]["read"]) == \
        (0, ALGORITHM, "files", "recorded")
    assert f"recorded with {other}" in report["a"]["note"]

    unchecked = _with_record(outputs, tmp_path / "c", "safetensors2", target={}, target_unchecked="job.ranks wrote "
                             "some target ranks only")
    report = audit(unchecked, outputs["ckpt4"], "--json").json()
    assert report["equal"] and report["a"]["read"] == "files" and "not read back" in report["a"]["note"]


def test_the_program_exits_0_1_2_with_one_line_errors(outputs, tmp_path):
    def program(*argv) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "reshard_job.audit", "compare", *map(str, argv)], cwd=tmp_path,
                              env=_environment(), capture_output=True, text=True, timeout=120)

    equal = program(*source_side(), outputs["export"])
    assert (equal.returncode, equal.stdout, equal.stderr) == (0, EQUAL + "\n", "")
    differ = program(M1A / "src_mindformers", outputs["mindformers_export"])
    assert differ.returncode == 1 and differ.stdout.endswith("44 only in A, 0 only in B (poslin64x2-v1)\n")
    missing = program(tmp_path / "nowhere", outputs["export"])
    assert (missing.returncode, missing.stdout) == (2, "")
    assert missing.stderr == f"error: A: {tmp_path / 'nowhere'}: no such file or directory\n"


def test_a_run_id_names_the_output_directory_that_run_wrote(audit, tmp_path):
    """Last: the only test needing the lineage database."""
    database = f"lineage.url=sqlite:///{tmp_path / 'lineage.db'}"
    out = run_jobs(tmp_path, {"recorded": JOBS["ckpt4"]}, database)["recorded"]
    run_id = json.loads((out / "manifest.json").read_text())["run_id"]
    db = str(tmp_path / "lineage.db")
    for ref in (run_id, run_id[:8]):
        result = audit(ref, *source_side()[:1], "--b-strategy", S2 / "src_strategy.ckpt", "--json", db=db)
        assert result.code == 0, result.err
        assert result.json()["a"] == {"ref": ref, "read": "recorded", "from": str(out / "manifest.json")}
    unknown = audit("ffffffff", out, db=db)
    assert unknown.code == 2 and unknown.err.startswith("error: A: ffffffff: no such file or directory, nor a run id")
    out.rename(tmp_path / "elsewhere")
    gone = audit(run_id[:8], tmp_path / "elsewhere", db=db)
    assert gone.code == 2 and gone.err == f"error: A: run {run_id} wrote into {out}, which is no longer there\n"
