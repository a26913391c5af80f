"""End-to-end tests of ``python -m reshard_job``: the app runs as its own process, as users run it (forked from a
pre-imported interpreter, the ``app`` fixture, where start-up is not the point of the test)."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from reshard_job import transform_checkpoints
from reshard_job.sources.demo import global_tensors
from reshard_job.formats.ckpt import CheckpointReader

GOLDEN = Path(__file__).parents[2] / "golden"


def run_app(cwd: Path, *args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "RESHARD_JOB_FULL_ERROR")}
    return subprocess.run([sys.executable, "-m", "reshard_job", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def output_dir_from(stdout: str) -> Path:
    for line in stdout.splitlines():
        if line.startswith("completed") and "outputs in" in line:
            return Path(line.split("outputs in", 1)[1].strip())
    raise AssertionError(f"no output dir in:\n{stdout}")


def tensors_of(path: Path) -> dict[str, bytes]:
    with CheckpointReader(path) as r:
        return {n: r.read_raw(n) for n in r.names()}


def merge_to_one(out_dir: Path, dst: Path) -> dict[str, np.ndarray]:
    """Convert an output directory back to one full checkpoint with our API and read it."""
    strategy = out_dir / "strategy.ckpt"
    transform_checkpoints(out_dir, dst, "full_", str(strategy) if strategy.exists() else None, None)
    with CheckpointReader(dst / "rank_0" / "full_0.ckpt") as r:
        return {n: r.read(n) for n in r.names()}


def test_no_argument_demo_converts_8_to_4_and_records_lineage(tmp_path):
    res = run_app(tmp_path)
    assert res.returncode == 0, res.stderr
    out = output_dir_from(res.stdout)
    assert out.is_relative_to(tmp_path / "runs")
    files = sorted(out.glob("rank_*/checkpoint_*.ckpt"))
    assert [f.parent.name for f in files] == ["rank_0", "rank_1", "rank_2", "rank_3"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["target"]["devices"] == 4 and manifest["source"]["devices"] == 8
    for f in manifest["target"]["files"]:
        assert hashlib.sha256(Path(f["path"]).read_bytes()).hexdigest() == f["sha256"]
    # the lineage record is where the output says
    db = tmp_path / "runs" / "lineage.db"
    with sqlite3.connect(db) as con:
        statuses = [r[0] for r in con.execute("select status from runs")]
    assert statuses == ["completed"]
    assert manifest["run_id"] in res.stdout
    # the demo sources are the user's, built once in the cache folder (the session's, under tests)
    demo = Path(os.environ["RESHARD_JOB_CACHE_DIR"]) / "demo" / "mlp_784-512-512-10_8ranks"
    assert not (tmp_path / "runs" / "demo").exists()
    assert {Path(f["path"]).parent.parent for f in manifest["source"]["files"]} == {demo}
    assert f"built once in the user's cache folder and reused: {demo}" in res.stderr + res.stdout
    # the 4 outputs hold the demo network, resharded: merging them back gives the original tensors
    merged = merge_to_one(out, tmp_path / "merged")
    for name, want in global_tensors().items():
        np.testing.assert_array_equal(merged[name], want, err_msg=name)


def test_the_lineage_database_named_by_the_environment_is_used_and_named(tmp_path, app, monkeypatch):
    db = tmp_path / "team" / "lineage.db"
    monkeypatch.setenv("RESHARD_JOB_LINEAGE_URL", str(db))  # a plain path: the SQLite file there
    res = app(tmp_path, "output.dir=out")
    assert res.returncode == 0, res.stderr
    assert not (tmp_path / "runs" / "lineage.db").exists()
    with sqlite3.connect(db) as con:
        assert [r[0] for r in con.execute("select status from runs")] == ["completed"]
    result = json.loads(next((tmp_path / "runs").rglob("result.json")).read_text())
    assert result["lineage_url"] == f"sqlite:///{db}"
    assert str(db) in res.stdout
    monkeypatch.setenv("RESHARD_JOB_LINEAGE_URL", f"sqlite:///{tmp_path / 'other.db'}")
    res = app(tmp_path, "output.dir=out2", f"lineage.url=sqlite:///{db}")  # the command line wins
    assert res.returncode == 0 and not (tmp_path / "other.db").exists()


@pytest.mark.parametrize("scenario,src,dst", [
    ("S1_mlp_tutorial_8to4", "src_strategy.ckpt", "dst_strategy.ckpt"),
    ("S3_pipeline2x4opt_to_4", "src_strategy_dir", "dst_strategy.ckpt"),
])
def test_golden_scenario_through_the_cli_matches_mindspore(tmp_path, app, scenario, src, dst):
    d = GOLDEN / scenario
    res = app(tmp_path, f"source.checkpoints={d / 'src_checkpoints'}", f"source.strategy={d / src}",
              "target=strategy", f"target.strategy={d / dst}", "output.dir=out", "job.workers=2")
    assert res.returncode == 0, res.stderr
    manifest = json.loads((d / "manifest.json").read_text())
    cats = manifest["verification"]["transform_checkpoints"]["categories"]
    for rank, params in manifest["expected"].items():
        got = tensors_of(tmp_path / "out" / f"rank_{rank}" / f"checkpoint_{rank}.ckpt")
        for name, info in params.items():
            if cats[rank][name].startswith("quirk"):
                assert name not in got  # omitted by default (MindSpore copies a wrong-layout slice)
                continue
            assert hashlib.sha256(got[name]).hexdigest() == info["sha256"], (rank, name)
    assert (tmp_path / "out" / "strategy.ckpt").read_bytes() == (d / dst).read_bytes()


def test_without_fingerprints_a_second_job_on_sources_whose_digests_are_kept_converts(tmp_path, app):
    # the second job reads no source to hash it (its digests are kept): the fingerprints' taps are
    # made only for a conversion that runs, and with job.fingerprints=false there are none to make
    d = GOLDEN / "S1_mlp_tutorial_8to4"
    args = [f"source.checkpoints={d / 'src_checkpoints'}", f"source.strategy={d / 'src_strategy.ckpt'}",
            "target=strategy", f"target.strategy={d / 'dst_strategy.ckpt'}", "job.fingerprints=false"]
    for out in ("first", "second"):
        res = app(tmp_path, *args, f"output.dir={out}")
        assert res.returncode == 0, res.stderr
        manifest = json.loads((tmp_path / out / "manifest.json").read_text())
        assert "fingerprints" not in manifest
    golden = json.loads((d / "manifest.json").read_text())
    got = tensors_of(tmp_path / "second" / "rank_0" / "checkpoint_0.ckpt")
    for name, info in golden["expected"]["0"].items():
        if name in got:
            assert hashlib.sha256(got[name]).hexdigest() == info["sha256"], name


@pytest.mark.slow  # four conversions and four merges; sweeps are also run by tests/e2e/lineage
def test_sweep_over_four_card_counts_merges_back_to_the_source(tmp_path):
    res = run_app(tmp_path, "-m", "target.devices=1,2,4,8", "hydra.sweep.dir=sweep", timeout=300)
    assert res.returncode == 0, res.stderr
    assert "Sweep summary (4 job(s), 0 failed)" in res.stdout
    want = global_tensors()
    for job, devices in enumerate([1, 2, 4, 8]):
        out = tmp_path / "sweep" / str(job) / "output"
        assert len(list(out.glob("rank_*/*.ckpt"))) == devices
        merged = merge_to_one(out, tmp_path / f"merged{job}")
        assert set(merged) == set(want)
        for name in want:
            np.testing.assert_array_equal(merged[name], want[name], err_msg=f"{devices} devices: {name}")
    with sqlite3.connect(tmp_path / "runs" / "lineage.db") as con:
        rows = sorted(con.execute("select job_num, status, target_devices from runs"))
    assert rows == [(0, "completed", 1), (1, "completed", 2), (2, "completed", 4), (3, "completed", 8)]


def test_plan_mode_writes_nothing_but_the_plan(tmp_path, app):
    res = app(tmp_path, "job.mode=plan", "output.dir=out", "hydra.run.dir=rundir")
    assert res.returncode == 0, res.stderr
    assert "target rank" in res.stdout and "Predicted peak memory" in res.stdout
    text = (tmp_path / "rundir" / "plan.json").read_text()
    plan = json.loads(text)
    assert text == json.dumps(plan, indent=1)  # written a piece at a time, as json.dumps writes it whole
    assert [r["target_rank"] for r in plan["ranks"]] == [0, 1, 2, 3]
    assert all(r["source_ranks"] for r in plan["ranks"])
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / "runs" / "lineage.db").exists()


def test_relative_paths_resolve_against_the_launch_directory(tmp_path, app):
    d = GOLDEN / "S1_mlp_tutorial_8to4"
    work = tmp_path / "work"
    work.mkdir()
    os.symlink(d / "src_checkpoints", work / "ckpts")
    res = app(work, "source.checkpoints=ckpts", f"source.strategy={d / 'src_strategy.ckpt'}", "target=single",
              "output.dir=merged", "lineage.url=sqlite:///db/lineage.db")
    assert res.returncode == 0, res.stderr
    assert (work / "merged" / "rank_0" / "checkpoint_0.ckpt").exists()
    assert (work / "db" / "lineage.db").exists()


@pytest.mark.parametrize("args,expected", [
    (["source.checkpoints=/nonexistent/ckpts"], "source checkpoint directory not found: /nonexistent/ckpts"),
    (["target=nope"], "Could not find 'target/nope'"),
    (["target.layout.rules=[{match: 'layer1\\.weight', dims: [null, tp]}]"], "unknown axis 'tp'"),
    (["target.devices=3"], "'layer1.weight': dimension 1 of size 512 is not divisible by mp = 3"),
    (["target.layout.mesh={dp: 2, mp: 4}"], "has 8 devices but target.devices is 4"),
    (["job.workers=abc"], "job.workers"),
])
def test_user_errors_exit_nonzero_with_one_line(tmp_path, args, expected):
    res = run_app(tmp_path, *args, "output.dir=out")
    assert res.returncode != 0
    lines = [ln for ln in res.stderr.splitlines() if ln.strip() and "[INFO]" not in ln and "[WARNING]" not in ln]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("reshard_job: error: ") and expected in lines[0], lines[0]
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "out").exists()


def test_a_misspelt_key_gets_the_same_suggestion_with_or_without_plus(tmp_path, app):
    """Hydra refuses ``target.devcies=4`` itself, settle refuses ``+target.devcies=4``: one line each,
    the same one, naming the closest key."""
    for override in ("target.devcies=4", "+target.devcies=4"):
        res = app(tmp_path, override, "job.mode=plan")
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        lines = [ln for ln in res.stderr.splitlines() if ln.strip() and "[INFO]" not in ln]
        assert lines == ["reshard_job: error: unknown configuration key target.devcies; did you mean "
                         "target.devices?"], (override, res.stderr)
    res = app(tmp_path, "devcies=4", "job.mode=plan")
    assert res.returncode == 2 and "unknown configuration key devcies (known keys: job, " in res.stderr


@pytest.mark.parametrize("key", ["job.max_memory", "target.max_shard_size"])
def test_both_size_keys_take_the_same_spellings_on_the_command_line(tmp_path, app, key):
    for text in ("512M", "512MiB", "5GB", "1.5GiB"):
        res = app(tmp_path, "target=hf_export", f"{key}={text}", "job.mode=plan")
        assert res.returncode == 0, (text, res.stderr)
    res = app(tmp_path, "target=hf_export", f"{key}=12Mo", "job.mode=plan")
    assert res.returncode == 2 and f"reshard_job: error: {key}" in res.stderr, res.stderr


def test_full_traceback_only_with_hydra_full_error(tmp_path):
    env = dict(os.environ, HYDRA_FULL_ERROR="1")
    env.pop("RESHARD_JOB_FULL_ERROR", None)
    res = subprocess.run([sys.executable, "-m", "reshard_job", "source.checkpoints=/nonexistent"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "Traceback" in res.stderr and "ConfigError" in res.stderr


def test_help_and_cfg_job_work_as_in_hydra(tmp_path, app):
    res = app(tmp_path, "--help")
    assert res.returncode == 0 and "target: demo_mlp, hf_export, megatron, single, strategy" in res.stdout
    res = app(tmp_path, "--cfg", "job", "target.devices=8")
    assert res.returncode == 0
    assert "devices: 8" in res.stdout and "mp: ${target.devices}" in res.stdout
    res = app(tmp_path, "--cfg", "job", "--resolve", "target.devices=8")
    assert "mp: 8" in res.stdout


def test_safetensors_output_and_safetensors_source_round_trip(tmp_path, app):
    res = app(tmp_path, "target.format=safetensors", "output.dir=st")
    assert res.returncode == 0, res.stderr
    files = sorted((tmp_path / "st").glob("rank_*/checkpoint_*.safetensors"))
    assert len(files) == 4
    from safetensors.numpy import load_file

    assert load_file(files[0])  # the safetensors library reads our files
    res = app(tmp_path, "source.checkpoints=st", "source.strategy=st/strategy.ckpt", "target=single",
              "output.dir=back")
    assert res.returncode == 0, res.stderr
    merged = tensors_of(tmp_path / "back" / "rank_0" / "checkpoint_0.ckpt")
    for name, want in global_tensors().items():
        assert merged[name] == want.tobytes(), name


def test_source_select_latest_step_beats_mindspores_lexicographic_rule(tmp_path, app):
    d = GOLDEN / "S1_mlp_tutorial_8to4"
    src = tmp_path / "ckpts"
    for rank_dir in sorted((d / "src_checkpoints").iterdir()):
        r = rank_dir.name.split("_")[1]
        (src / rank_dir.name).mkdir(parents=True)
        (src / rank_dir.name / "net-10_100.ckpt").write_bytes((rank_dir / f"checkpoint_{r}.ckpt").read_bytes())
        (src / rank_dir.name / "net-9_100.ckpt").write_bytes(b"an older step, unreadable\n")  # sorts last
    common = [f"source.checkpoints={src}", f"source.strategy={d / 'src_strategy.ckpt'}", "target=strategy",
              f"target.strategy={d / 'dst_strategy.ckpt'}"]
    res = app(tmp_path, *common, "source.select=last", "output.dir=last")
    assert res.returncode != 0 and "net-9_" in res.stderr  # MindSpore's rule takes the -9_ file
    res = app(tmp_path, *common, "output.dir=latest")  # the default: the newest step
    assert res.returncode == 0, res.stderr
    manifest = json.loads((d / "manifest.json").read_text())
    got = tensors_of(tmp_path / "latest" / "rank_0" / "checkpoint_0.ckpt")
    for name, info in manifest["expected"]["0"].items():
        assert hashlib.sha256(got[name]).hexdigest() == info["sha256"], name
    res = app(tmp_path, *common, "source.select=net-10_*.ckpt", "output.dir=glob")
    assert res.returncode == 0, res.stderr


def test_a_strategy_file_on_the_command_line_wins_over_the_default_presets_layout(tmp_path, app):
    d = GOLDEN / "S2_block_mp4dp2opt_to_mp4"
    res = app(tmp_path, f"source.checkpoints={d / 'src_checkpoints'}", f"source.strategy={d / 'src_strategy.ckpt'}",
              f"target.strategy={d / 'dst_strategy.ckpt'}", "output.dir=out")
    assert res.returncode == 0, res.stderr
    assert len(list((tmp_path / "out").glob("rank_*/checkpoint_*.ckpt"))) == 4
    # given explicitly, a disagreeing device count or a layout is still an error
    res = app(tmp_path, f"source.checkpoints={d / 'src_checkpoints'}", f"source.strategy={d / 'src_strategy.ckpt'}",
              f"target.strategy={d / 'dst_strategy.ckpt'}", "target.devices=8", "output.dir=out2")
    assert res.returncode != 0 and "target.devices=8 but target.strategy" in res.stderr
    res = app(tmp_path, f"source.checkpoints={d / 'src_checkpoints'}", f"source.strategy={d / 'src_strategy.ckpt'}",
              f"target.strategy={d / 'dst_strategy.ckpt'}", "target.layout.optimizer_shard=mp", "output.dir=out3")
    assert res.returncode != 0 and "not both" in res.stderr


def test_one_target_device_from_the_default_preset_does_not_warn_about_its_rules(tmp_path, app):
    """`target.devices=1` for a real checkpoint keeps the default preset's (the demo's) rules: on one
    device every layout is the whole tensor, so rules that match nothing change nothing, and the
    four WARNING lines saying so were noise. On more devices they mean "everything replicated"."""
    d = GOLDEN / "S2_block_mp4dp2opt_to_mp4"
    source = [f"source.checkpoints={d / 'src_checkpoints'}", f"source.strategy={d / 'src_strategy.ckpt'}"]
    res = app(tmp_path, *source, "target.devices=1", "output.dir=one")
    assert res.returncode == 0, res.stderr
    assert "WARNING" not in res.stderr and len(list((tmp_path / "one").glob("rank_*/*.ckpt"))) == 1
    res = app(tmp_path, *source, "target.devices=2", "output.dir=two")
    assert res.returncode == 0, res.stderr
    warned = [line for line in res.stderr.splitlines() if "WARNING" in line]
    assert len(warned) == 1 and "4 target.layout.rules match no parameter of this checkpoint: " \
        "target.layout.rules[0] (match 'layer1\\\\.weight')" in warned[0], warned


def test_jobs_started_together_get_run_directories_of_their_own(tmp_path, app):
    """Run directories are named to the microsecond: two jobs started in the same second from one
    folder (a script launching conversions side by side) kept one result.json and one log."""
    import re

    for _ in range(2):
        res = app(tmp_path, "job.mode=plan", "output.dir=out")
        assert res.returncode == 0, res.stderr
    dirs = sorted(p.name for p in (tmp_path / "runs").glob("*/*") if p.is_dir())
    assert len(dirs) == 2 and all(re.fullmatch(r"\d\d-\d\d-\d\d-\d{6}", d) for d in dirs), dirs
    assert all(any((tmp_path / "runs").glob(f"*/{d}/plan.json")) for d in dirs)
