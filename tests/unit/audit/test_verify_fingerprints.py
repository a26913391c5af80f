"""``audit verify`` and ``audit show`` on a run's per-parameter fingerprints: outputs against sources
in the database, the database against the run's manifest, older runs without any.

Synthetic runs (recorded through the store, on SQLite and on PostgreSQL) cover each case; the
built-in demo job, run for real, shows the whole chain from the conversion to the audit's exit status.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import delete, update

from reshard_job.audit import main
from reshard_job.audit.queries import fingerprint_summary
from reshard_job.audit.verify import verify
from reshard_job.lineage import LineageStore
from reshard_job.lineage.models import RunFingerprint

ALGORITHM = "poslin64x2-v1"
SOURCE = {"layer1.bias": "1" * 32, "layer1.weight": "2" * 32, "layer2.weight": "3" * 32,
          "adam_m.layer1.weight": "4" * 32}
WRITTEN = {name: SOURCE[name] for name in ("layer1.bias", "layer1.weight", "layer2.weight")}  # weights only


@dataclass
class FingerprintedRun:
    run_id: str
    out: Path
    manifest: Path


def _record_run(store, root: Path, make_file, make_plan, *, target=WRITTEN, section=True) -> FingerprintedRun:
    """A completed run as the job records it: fingerprints first, then outputs and a manifest listing them."""
    out = root / "out"
    run_id = store.start_run(config={}, overrides=[], tool_version="0.1.0", output_dir=str(out),
                             source_devices=8, target_devices=2)
    source = make_file(root / "src" / "rank_0" / "checkpoint_0.ckpt", b"src", "source_checkpoint", 0)
    store.record_inputs(run_id, [source])
    store.record_fingerprints(run_id, ALGORITHM, SOURCE, target)
    checkpoints = [make_file(out / f"rank_{r}" / f"checkpoint_{r}.ckpt", f"out {r}".encode() * 32,
                             "target_checkpoint", r) for r in range(2)]
    manifest = {"manifest_version": 1, "run_id": run_id,
                "target": {"devices": 2, "files": [{"rank": f.rank, "path": f.path, "size": f.size, "sha256": f.sha256}
                                                   for f in checkpoints]}}
    if section:
        manifest["fingerprints"] = {"algorithm": ALGORITHM, "source": SOURCE, "target": target or {}}
        if target is None:
            manifest["fingerprints"]["target_unchecked"] = "job.ranks wrote some target ranks only"
    written = make_file(out / "manifest.json", json.dumps(manifest, indent=1).encode(), "manifest")
    store.complete_run(run_id, outputs=checkpoints + [written], plan=make_plan(8, 2))
    return FingerprintedRun(run_id, out, out / "manifest.json")


def _verified(store, ref: str) -> dict:
    with store.read_session() as session:
        return verify(session, ref).to_json()


def _set_digest(store, run_id: str, side: str, name: str, digest: str) -> None:
    with store._writer.begin() as session:
        session.execute(update(RunFingerprint).where(RunFingerprint.run_id == run_id, RunFingerprint.side == side,
                                                     RunFingerprint.name == name).values(digest=digest))


def test_equal_fingerprints_and_an_agreeing_manifest_pass(store, tmp_path, make_file, make_plan):
    run = _record_run(store, tmp_path, make_file, make_plan)
    report = _verified(store, run.run_id)
    check = report["fingerprints"]
    assert report["intact"] and check["ok"] and check["equal"] and check["mismatches"] == []
    assert (check["algorithm"], check["source"], check["target"]) == (ALGORITHM, 4, 3)
    assert check["manifests"] == [{"path": str(run.manifest), "state": "agrees", "differ": []}]
    by_directory = _verified(store, str(run.out))  # the directory names its run: checked the same way
    assert by_directory["run_id"] == run.run_id and by_directory["fingerprints"]["manifests"][0]["state"] == "agrees"


def test_a_tampered_output_fingerprint_fails_naming_the_parameter(store, tmp_path, make_file, make_plan):
    run = _record_run(store, tmp_path, make_file, make_plan)
    _set_digest(store, run.run_id, "target", "layer1.weight", "f" * 32)
    report = _verified(store, run.run_id)
    assert not report["intact"] and report["ok"] == report["checked"]  # every file is fine: the record is not
    check = report["fingerprints"]
    assert check["mismatches"] == [{"name": "layer1.weight", "target": "f" * 32, "source": "2" * 32}]
    assert check["manifests"][0]["state"] == "disagrees" and check["manifests"][0]["differ"] == ["layer1.weight"]


def test_an_output_without_a_source_fingerprint_fails(store, tmp_path, make_file, make_plan):
    run = _record_run(store, tmp_path, make_file, make_plan)
    with store._writer.begin() as session:
        session.execute(delete(RunFingerprint).where(RunFingerprint.run_id == run.run_id,
                                                     RunFingerprint.side == "source",
                                                     RunFingerprint.name == "layer2.weight"))
    check = _verified(store, run.run_id)["fingerprints"]
    assert not check["ok"] and check["mismatches"] == [{"name": "layer2.weight", "target": "3" * 32, "source": None}]


def test_a_manifest_listing_other_fingerprints_than_recorded_fails(store, tmp_path, make_file, make_plan):
    run = _record_run(store, tmp_path, make_file, make_plan)
    manifest = json.loads(run.manifest.read_text())
    manifest["fingerprints"]["source"]["layer2.weight"] = "9" * 32
    manifest["fingerprints"]["target"]["layer2.weight"] = "9" * 32
    run.manifest.write_text(json.dumps(manifest))
    report = _verified(store, run.run_id)
    assert not report["intact"] and report["fingerprints"]["equal"]  # the database itself is consistent
    assert [(f["path"], f["state"]) for f in report["files"] if f["state"] != "ok"] == [(str(run.manifest), "changed")]
    assert report["fingerprints"]["manifests"] == [{"path": str(run.manifest), "state": "disagrees",
                                                    "differ": ["layer2.weight"]}]


def test_a_manifest_naming_another_algorithm_fails_in_one_line(store, tmp_path, make_file, make_plan, capsys):
    run = _record_run(store, tmp_path, make_file, make_plan)
    manifest = json.loads(run.manifest.read_text())
    manifest["fingerprints"]["algorithm"] = "other-v9"
    run.manifest.write_text(json.dumps(manifest))
    assert main(["--db", store.url.render_as_string(hide_password=False), "verify", run.run_id]) == 1
    captured = capsys.readouterr()
    assert f"fingerprints in {run.manifest}: listed otherwise than recorded (algorithm 'other-v9', recorded " \
           f"'{ALGORITHM}')" in captured.out
    assert captured.out.splitlines()[0].endswith("1 changed; fingerprints disagree")
    assert (f"the recorded fingerprints disagree with {run.manifest} (algorithm 'other-v9', recorded '{ALGORITHM}')"
            in captured.err)


def test_source_only_and_older_runs_are_said_not_failed(store, tmp_path, make_file, make_plan, two_hop, capsys):
    sources_only = _record_run(store, tmp_path / "partial", make_file, make_plan, target=None)
    report = _verified(store, sources_only.run_id)
    assert report["intact"] and (report["fingerprints"]["source"], report["fingerprints"]["target"]) == (4, 0)
    assert report["fingerprints"]["manifests"][0]["state"] == "agrees"
    older = _verified(store, two_hop.run_a)  # recorded before fingerprints existed
    assert older["intact"] and (older["fingerprints"]["source"], older["fingerprints"]["target"]) == (0, 0)
    assert older["fingerprints"]["manifests"] == []
    url = store.url.render_as_string(hide_password=False)
    assert main(["--db", url, "verify", two_hop.run_a]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if "fingerprints" in line] == [
        "  fingerprints: none recorded (a run from before fingerprints were kept)"]
    assert main(["--db", url, "verify", sources_only.run_id]) == 0
    assert f"  fingerprints: 4 source, outputs not read back ({ALGORITHM})" in capsys.readouterr().out


def test_summary_is_computed_in_the_database(store, tmp_path, make_file, make_plan):
    run = _record_run(store, tmp_path, make_file, make_plan)
    with store.read_session() as session:
        summary = fingerprint_summary(session, run.run_id)
    # The optimizer state fingerprinted in the sources but not written is not a difference.
    assert (summary.algorithm, summary.source, summary.target, summary.equal) == (ALGORITHM, 4, 3, True)


def test_show_counts_the_fingerprints(store, tmp_path, make_file, make_plan, capsys):
    run = _record_run(store, tmp_path, make_file, make_plan)
    url = store.url.render_as_string(hide_password=False)
    assert main(["--db", url, "show", run.run_id]) == 0
    assert f"  fingerprints 4 source, 3 target, all equal ({ALGORITHM})\n" in capsys.readouterr().out
    _set_digest(store, run.run_id, "target", "layer1.bias", "0" * 32)
    assert main(["--db", url, "show", run.run_id, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["id"] == run.run_id and shown["fingerprints"]["equal"] is False
    assert [m["name"] for m in shown["fingerprints"]["mismatches"]] == ["layer1.bias"]


# -- the real job --------------------------------------------------------------------------------

def _environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "RESHARD_JOB_FULL_ERROR",
                                                               "RESHARD_LINEAGE_URL")}


def _audit(cwd: Path, database: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "reshard_job.audit", "--db", str(database), *argv], cwd=cwd,
                          env=_environment(), capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The built-in demo conversion (8 -> 4 ranks), run once as a user runs it, with lineage on."""
    root = tmp_path_factory.mktemp("demo")
    done = subprocess.run([sys.executable, "-m", "reshard_job", "output.dir=tmp/out"], cwd=root, env=_environment(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = json.loads((root / "tmp" / "out" / "manifest.json").read_text())
    return root, manifest


def test_the_demo_job_records_its_fingerprints_and_verify_passes(demo):
    root, manifest = demo
    run_id, section = manifest["run_id"], manifest["fingerprints"]
    count = len(section["target"])
    assert count > 0 and section["source"].keys() >= section["target"].keys()
    with LineageStore(f"sqlite:///{root / 'runs' / 'lineage.db'}", read_only=True) as store:
        assert store.fingerprints(run_id) == {"algorithm": section["algorithm"], "source": section["source"],
                                              "target": section["target"]}
    verified = _audit(root, root / "runs" / "lineage.db", "verify", run_id)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert f"fingerprints: {len(section['source'])} source, {count} target, all equal ({section['algorithm']})" \
        in verified.stdout
    assert f"fingerprints in {root / 'tmp' / 'out' / 'manifest.json'}: the same as recorded" in verified.stdout


def test_a_tampered_fingerprint_in_the_demos_database_fails_verify_by_name(demo, tmp_path):
    root, manifest = demo
    run_id = manifest["run_id"]
    victim = sorted(manifest["fingerprints"]["target"])[-1]
    copy = tmp_path / "lineage.db"
    with closing(sqlite3.connect(root / "runs" / "lineage.db")) as original, closing(sqlite3.connect(copy)) as target:
        original.backup(target)
    with closing(sqlite3.connect(copy)) as database, database:
        changed = database.execute("UPDATE run_fingerprints SET digest = ? WHERE run_id = ? AND side = 'target' "
                                   "AND name = ?", ("0" * 32, run_id, victim)).rowcount
    assert changed == 1
    failed = _audit(tmp_path, copy, "verify", run_id)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert f"DIFFERS    {victim}  (output 000000000000, source " in failed.stdout
    assert failed.stderr.startswith("verify failed: ") and f"parameter {victim!r} fingerprint differs" in failed.stderr
    as_json = _audit(tmp_path, copy, "verify", run_id, "--json")
    report = json.loads(as_json.stdout)
    assert as_json.returncode == 1 and not report["intact"]
    assert [m["name"] for m in report["fingerprints"]["mismatches"]] == [victim]
    assert report["fingerprints"]["manifests"][0]["differ"] == [victim]
