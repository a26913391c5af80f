"""Lineage recorded by the real batch job (``python -m reshard_job``), queried with the audit CLI.

Covers the issue's acceptance: a two-hop conversion traced back to every original source file,
verify on intact and tampered outputs, and parallel sweep jobs sharing one database, on SQLite and
on a real PostgreSQL server.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

GOLDEN = Path(__file__).parents[2] / "golden"
S2 = GOLDEN / "S2_block_mp4dp2opt_to_mp4"


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "RESHARD_JOB_FULL_ERROR",
                                                               "RESHARD_LINEAGE_URL")}


@pytest.fixture
def job(app):
    """``python -m reshard_job`` as its own process (forked by the e2e `app` launcher), expected to succeed."""
    def run(cwd: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
        res = app(cwd, *args, timeout=timeout, env=_env())
        assert res.returncode == 0, res.stderr
        return res

    return run


def audit(cwd: Path, db: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "reshard_job.audit", "--db", db, *args], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=120)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# PostgreSQL end to end is slow-only: the store and audit run on a real server in tests/unit/lineage and tests/unit/audit
@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=[pytest.mark.postgres, pytest.mark.slow])])
def lineage_url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'lineage.db'}"
    return request.getfixturevalue("postgres_url")


def test_two_hop_conversion_traces_back_to_all_eight_sources(tmp_path, lineage_url, capsys, job):
    # hop 1: 8 ranks (mp4 x dp2, optimizer parallel) -> 4 ranks (mp4), MindSpore strategies
    job(tmp_path, f"source.checkpoints={S2 / 'src_checkpoints'}", f"source.strategy={S2 / 'src_strategy.ckpt'}",
        "target=strategy", f"target.strategy={S2 / 'dst_strategy.ckpt'}", "output.dir=hop1",
        f"lineage.url='{lineage_url}'", "job.workers=2")
    # the output is copied elsewhere, then converted again 4 -> 2 (declarative layout)
    shutil.copytree(tmp_path / "hop1", tmp_path / "moved", ignore=shutil.ignore_patterns(".reshard_job"))
    job(tmp_path, "source.checkpoints=moved", "source.strategy=moved/strategy.ckpt", "target.devices=2",
        "target.layout={mesh: {mp: 2}, rules: [{match: '.*', dims: []}]}", "output.dir=hop2",
        f"lineage.url='{lineage_url}'")
    final = tmp_path / "hop2" / "rank_1" / "checkpoint_1.ckpt"
    res = audit(tmp_path, lineage_url, "trace", str(final), "--json")
    assert res.returncode == 0, res.stderr
    tree = json.loads(res.stdout)
    originals = {(o["path"], o["sha256"]) for o in tree["original_sources"] if o["kind"] == "source_checkpoint"}
    want = {(str(p), sha256(p)) for p in sorted((S2 / "src_checkpoints").glob("rank_*/*.ckpt"))}
    assert len(want) == 8 and want <= originals
    assert len(tree["runs"]) == 2
    # every hop's intermediate file is in the ancestry by content, whatever path it now has
    hop1_digests = {sha256(p) for p in (tmp_path / "hop1").glob("rank_*/*.ckpt")}
    assert hop1_digests <= {a["sha256"] for a in tree["ancestors"]}
    text = audit(tmp_path, lineage_url, "trace", str(final))
    assert text.returncode == 0 and "src_strategy.ckpt" in text.stdout and "8→4" in text.stdout
    # The whole output directory, by its manifest; forwards from one original source; a picture.
    # (In-process: the subprocess above already showed the command line works.)
    from reshard_job.audit import main

    assert main(["--db", lineage_url, "trace", str(tmp_path / "hop2"), "--json"]) == 0
    by_directory = json.loads(capsys.readouterr().out)
    assert want <= {(o["path"], o["sha256"]) for o in by_directory["original_sources"]}
    source = sorted((S2 / "src_checkpoints").glob("rank_*/*.ckpt"))[0]
    assert main(["--db", lineage_url, "trace", "--descendants", str(source), "--json"]) == 0
    built = json.loads(capsys.readouterr().out)
    assert len(built["runs"]) == 2 and sha256(final) in {d["sha256"] for d in built["descendants"]}
    assert main(["--db", lineage_url, "verify", str(tmp_path / "hop2")]) == 0
    assert "all 4 files intact" in capsys.readouterr().out
    assert main(["--db", lineage_url, "graph", str(final), "--output", str(tmp_path / "lineage.svg")]) == 0
    assert (tmp_path / "lineage.svg").read_text().count('class="node run completed') == 2


def test_verify_passes_on_intact_outputs_and_names_a_flipped_byte(tmp_path, lineage_url, job):
    res = job(tmp_path, f"source.checkpoints={S2 / 'src_checkpoints'}", f"source.strategy={S2 / 'src_strategy.ckpt'}",
              "target=strategy", f"target.strategy={S2 / 'dst_strategy.ckpt'}", "output.dir=out",
              f"lineage.url='{lineage_url}'")
    run_id = json.loads((tmp_path / "out" / "manifest.json").read_text())["run_id"]
    assert run_id in res.stdout
    ok = audit(tmp_path, lineage_url, "verify", run_id)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    victim = tmp_path / "out" / "rank_2" / "checkpoint_2.ckpt"
    os.chmod(victim, 0o644)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    bad = audit(tmp_path, lineage_url, "verify", run_id)
    assert bad.returncode != 0
    assert str(victim) in bad.stdout + bad.stderr
    by_path = audit(tmp_path, lineage_url, "verify", str(victim))
    assert by_path.returncode != 0 and str(victim) in by_path.stdout + by_path.stderr
    intact = audit(tmp_path, lineage_url, "verify", str(tmp_path / "out" / "rank_0" / "checkpoint_0.ckpt"))
    assert intact.returncode == 0


def test_four_sweep_jobs_in_parallel_share_one_database(tmp_path, lineage_url, job):
    res = job(tmp_path, "-m", "target.devices=1,2,4,8", "hydra/launcher=joblib", "hydra.launcher.n_jobs=4",
              "hydra.sweep.dir=sweep", f"lineage.url='{lineage_url}'", "job.workers=1")
    assert "Sweep summary (4 job(s), 0 failed)" in res.stdout
    assert "locked" not in res.stderr.lower()
    runs = audit(tmp_path, lineage_url, "runs", "--json")
    assert runs.returncode == 0, runs.stderr
    listed = json.loads(runs.stdout)
    rows = listed["runs"] if isinstance(listed, dict) else listed
    assert sorted((r["status"], r["target_devices"]) for r in rows) == [
        ("completed", 1), ("completed", 2), ("completed", 4), ("completed", 8)]
    assert len({r["sweep_id"] for r in rows}) == 1


@pytest.mark.slow
def test_the_given_target_strategy_is_an_input_and_its_copy_beside_the_outputs_a_copy(tmp_path, job):
    url = f"sqlite:///{tmp_path / 'lineage.db'}"
    given = S2 / "dst_strategy.ckpt"
    args = (f"source.checkpoints={S2 / 'src_checkpoints'}", f"source.strategy={S2 / 'src_strategy.ckpt'}",
            "target=strategy", f"target.strategy={given}", "output.dir=out", f"lineage.url='{url}'")
    job(tmp_path, *args)
    job(tmp_path, *args)  # the same job again: nothing to do, and recorded the same way
    runs = json.loads(audit(tmp_path, url, "runs", "--json").stdout)
    assert len(runs) == 2
    for run in runs:
        shown = json.loads(audit(tmp_path, url, "show", run["id"], "--json").stdout)
        inputs = {f["path"]: f for f in shown["inputs"]}
        outputs = {f["path"]: f for f in shown["outputs"]}
        assert inputs[str(given)]["sha256"] == sha256(given) and not inputs[str(given)].get("copied")
        copy = outputs[str(tmp_path / "out" / "strategy.ckpt")]
        assert copy["sha256"] == sha256(given) and copy["copied"] is True
        assert not any(f.get("copied") for path, f in outputs.items() if path != copy["path"])


@pytest.mark.slow
def test_a_run_stopped_after_its_manifest_verifies_complete_not_recorded_until_rerun(tmp_path, job):
    import sqlite3

    db = tmp_path / "lineage.db"
    url = f"sqlite:///{db}"
    args = (f"source.checkpoints={S2 / 'src_checkpoints'}", f"source.strategy={S2 / 'src_strategy.ckpt'}",
            "target=strategy", f"target.strategy={S2 / 'dst_strategy.ckpt'}", "output.dir=out", f"lineage.url='{url}'")
    job(tmp_path, *args)
    run_id = json.loads((tmp_path / "out" / "manifest.json").read_text())["run_id"]
    # What Ctrl-C just after manifest.json was published leaves: the run recorded as interrupted, with
    # its inputs and plan but no outputs (the job records its outputs only with its completion).
    with sqlite3.connect(db) as connection:
        connection.execute("UPDATE runs SET status = 'interrupted', error = 'SIGINT' WHERE id = ?", (run_id,))
        connection.execute("DELETE FROM events WHERE run_id = ? AND direction = 'output'", (run_id,))

    stopped = audit(tmp_path, url, "verify", "out")
    assert stopped.returncode == 3, stopped.stdout + stopped.stderr
    assert "complete, not recorded: rerun to record" in stopped.stdout
    assert f"run {run_id} that wrote it is interrupted" in stopped.stdout
    victim = tmp_path / "out" / "rank_1" / "checkpoint_1.ckpt"
    original = victim.read_bytes()
    os.chmod(victim, 0o644)
    victim.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    damaged = audit(tmp_path, url, "verify", "out")  # damage is damage, recorded or not
    assert damaged.returncode == 1 and "complete, not recorded" not in damaged.stdout
    victim.write_bytes(original)

    rerun = job(tmp_path, *args)  # the same job again: nothing to convert, and now recorded
    assert "already" in rerun.stdout + rerun.stderr
    recorded = audit(tmp_path, url, "verify", "out")
    assert recorded.returncode == 0, recorded.stdout + recorded.stderr
    assert "intact" in recorded.stdout


@pytest.mark.slow
def test_a_model_trained_from_a_conversion_traces_back_to_its_sources(tmp_path, lineage_url, job):
    job(tmp_path, f"source.checkpoints={S2 / 'src_checkpoints'}", f"source.strategy={S2 / 'src_strategy.ckpt'}",
        "target=strategy", f"target.strategy={S2 / 'dst_strategy.ckpt'}", "output.dir=out",
        f"lineage.url='{lineage_url}'")
    model = tmp_path / "finetuned" / "model.safetensors"
    model.parent.mkdir()
    model.write_bytes(b"weights after fine-tuning")
    recorded = audit(tmp_path, lineage_url, "record", "--consumer", "finetune", "--inputs", "out",
                     "--outputs", str(model), "--json")
    assert recorded.returncode == 0, recorded.stderr
    sources = sorted((S2 / "src_checkpoints").glob("rank_*/*.ckpt"))
    back = json.loads(audit(tmp_path, lineage_url, "trace", str(model), "--json").stdout)
    assert {(o["path"], o["sha256"]) for o in back["original_sources"] if o["kind"] == "source_checkpoint"} == \
        {(str(p), sha256(p)) for p in sources}
    forward = json.loads(audit(tmp_path, lineage_url, "trace", "--descendants", str(sources[5]), "--json").stdout)
    assert json.loads(recorded.stdout)["run_id"] in {run["run_id"] for run in forward["runs"]}
    assert [f["path"] for f in forward["final_outputs"]] == [str(model)]
