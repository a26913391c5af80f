"""``python -m reshard_job.audit`` end to end, in subprocesses, for every command with and
without ``--json``; argument edge cases run in-process through ``main(argv)``.

The read-only invocations share one recorded two-hop lineage and run concurrently (they only
read), which keeps this module to a few seconds; the ones that damage files get their own copy.
Edge cases of arguments are exercised in-process, where they cost milliseconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest

from reshard_job.audit import main
from reshard_job.lineage import LineageStore


@dataclass
class Result:
    code: int
    out: str
    err: str

    def json(self):
        return json.loads(self.out)


def _environment(**extra: str) -> dict[str, str]:
    environment = {k: v for k, v in os.environ.items() if k != "RESHARD_LINEAGE_URL"}
    environment.update(extra)
    return environment


def run_audit_batch(commands: dict[str, list[str]], cwd, env=None) -> dict[str, Result]:
    processes = {
        name: subprocess.Popen([sys.executable, "-m", "reshard_job.audit", *argv], cwd=cwd, env=env or _environment(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, argv in commands.items()
    }
    results = {}
    for name, process in processes.items():
        out, err = process.communicate(timeout=120)
        results[name] = Result(process.returncode, out, err)
    return results


def run_audit(*argv: str, cwd, env=None) -> Result:
    return run_audit_batch({"only": list(argv)}, cwd, env)["only"]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, record_lineage):
    root = tmp_path_factory.mktemp("audit")
    url = f"sqlite:///{root / 'runs' / 'lineage.db'}"
    with LineageStore(url) as store:
        store.ensure_schema()
        lineage = record_lineage(store, root / "files")
        failed = store.start_run(config={}, overrides=["source.checkpoints=/nowhere"], tool_version="0.1.0",
                                 output_dir=str(root / "failed"), source_devices=8, target_devices=4)
        store.fail_run(failed, "ConfigError: /nowhere: no such directory")
    return root, url, lineage, failed


@pytest.fixture(scope="module")
def outputs(recorded) -> dict[str, Result]:
    root, url, lineage, failed = recorded
    db = ["--db", url]
    commands = {
        "runs": db + ["runs"],
        "runs_json": db + ["runs", "--json"],
        "show": db + ["show", lineage.run_a[:8]],
        "show_json": db + ["--json", "show", lineage.run_a],
        "trace": db + ["trace", lineage.final.path],
        "trace_json": db + ["trace", lineage.final.path, "--json"],
        "verify": db + ["verify", lineage.run_b],
        "verify_json": db + ["verify", lineage.run_b, "--json"],
        "unknown_run": db + ["show", "ffffffff-no-such-run"],
    }
    return run_audit_batch(commands, cwd=root)


def test_runs_table_and_json(outputs, recorded):
    _, _, lineage, failed = recorded
    text = outputs["runs"]
    assert text.code == 0, text.err
    assert lineage.run_a in text.out and lineage.run_b in text.out and failed in text.out
    assert "8→4" in text.out and "4→2" in text.out and "failed" in text.out
    listed = outputs["runs_json"].json()
    assert [r["id"] for r in listed] == [lineage.run_a, lineage.run_b, failed]
    assert [r["status"] for r in listed] == ["completed", "completed", "failed"]


def test_show_text_and_json(outputs, recorded):
    _, _, lineage, _ = recorded
    text = outputs["show"]
    assert text.code == 0, text.err
    assert f"run {lineage.run_a}" in text.out
    assert "target.devices=4" in text.out and "rank map (4 target ranks)" in text.out
    assert all(f.path in text.out for f in lineage.sources + lineage.outputs_a)
    details = outputs["show_json"].json()
    assert details["id"] == lineage.run_a and details["config"]["target"] == {"devices": 4}
    assert [r["source_ranks"] for r in details["rank_map"]] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert {f["sha256"] for f in details["inputs"]} == {f.sha256 for f in lineage.sources + [lineage.source_strategy]}
    assert len(details["outputs"]) == 6 and details["plan"]["version"] == 1


def test_trace_text_and_json(outputs, recorded):
    _, _, lineage, _ = recorded
    text = outputs["trace"]
    assert text.code == 0, text.err
    assert lineage.run_a in text.out and lineage.run_b in text.out
    assert all(f.path in text.out for f in lineage.sources) and lineage.copied.path in text.out
    assert "8 source checkpoints" in text.out
    by_sha256 = outputs["trace_json"].json()
    assert by_sha256["root"]["sha256"] == lineage.final.sha256
    for traced in (outputs["trace_json"].json(), by_sha256):
        assert [r["run_id"] for r in traced["runs"]] == [lineage.run_b, lineage.run_a]
        ancestors = {a["sha256"] for a in traced["ancestors"]}
        assert {f.sha256 for f in lineage.sources} <= ancestors
        originals = {a["sha256"] for a in traced["original_sources"] if a["kind"] == "source_checkpoint"}
        assert originals == {f.sha256 for f in lineage.sources}


def test_verify_intact_text_and_json(outputs, recorded):
    _, _, lineage, _ = recorded
    assert outputs["verify"].code == 0, outputs["verify"].err
    assert "all 4 files intact" in outputs["verify"].out
    report = outputs["verify_json"].json()
    assert outputs["verify_json"].code == 0 and report["intact"] and report["checked"] == 4


def test_unknown_run_is_one_clear_line(outputs, recorded, capsys):
    expected = ["error: no run with id 'ffffffff-no-such-run' in the lineage database"]
    result = outputs["unknown_run"]
    assert result.code == 2 and result.out == "" and result.err.strip().splitlines() == expected
    assert main(["--db", recorded[1], "show", "ffffffff-no-such-run", "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.strip().splitlines() == expected


def test_verify_names_changed_and_missing_files(tmp_path, capsys, record_lineage):
    url = f"sqlite:///{tmp_path / 'runs' / 'lineage.db'}"
    with LineageStore(url) as store:
        store.ensure_schema()
        lineage = record_lineage(store, tmp_path / "files")
    changed, missing = lineage.outputs_a[1], lineage.outputs_a[5]
    with open(changed.path, "r+b") as f:
        f.seek(7)
        byte = f.read(1)
        f.seek(7)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.remove(missing.path)

    results = run_audit_batch({
        "text": ["--db", url, "verify", lineage.run_a],
        "json": ["--db", url, "verify", lineage.run_a, "--json"],
    }, cwd=tmp_path)
    text = results["text"]
    assert text.code == 1
    assert f"CHANGED    {changed.path}" in text.out and f"MISSING    {missing.path}" in text.out
    assert changed.path in text.err and missing.path in text.err
    report = results["json"].json()
    assert results["json"].code == 1 and not report["intact"]
    assert {(f["path"], f["state"]) for f in report["files"] if f["state"] != "ok"} == {
        (changed.path, "changed"), (missing.path, "missing")}
    assert main(["--db", url, "verify", changed.path]) == 1
    assert changed.path in capsys.readouterr().out
    assert main(["--db", url, "verify", lineage.outputs_a[0].path]) == 0
    assert "all 1 file intact" in capsys.readouterr().out


# -- in-process: argument handling ---------------------------------------------------------------

def test_trace_by_sha256_and_default_database_from_environment(recorded, capsys, monkeypatch):
    root, url, lineage, _ = recorded
    monkeypatch.setenv("RESHARD_LINEAGE_URL", url)
    assert main(["trace", lineage.final.sha256, "--json"]) == 0
    traced = json.loads(capsys.readouterr().out)
    assert traced["query"]["sha256"] == lineage.final.sha256
    assert {f.sha256 for f in lineage.sources} <= {a["sha256"] for a in traced["ancestors"]}
    monkeypatch.delenv("RESHARD_LINEAGE_URL")
    monkeypatch.chdir(root)  # the default is runs/lineage.db under the current directory
    assert main(["runs", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 3


def test_filters_by_status_and_date(recorded, capsys):
    _, url, lineage, failed = recorded
    assert main(["--db", url, "runs", "--status", "failed", "--json"]) == 0
    assert [r["id"] for r in json.loads(capsys.readouterr().out)] == [failed]
    assert main(["--db", url, "runs", "--since", "2999-01-01", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []
    assert main(["--db", url, "runs", "--until", "2000-01-01"]) == 0
    assert capsys.readouterr().out.strip() == "no runs"
    assert main(["runs", "--db", url, "--until", "2999-12-31", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 3


def test_bad_dates_and_missing_databases_are_one_line_errors(recorded, tmp_path, capsys):
    _, url, _, _ = recorded
    with pytest.raises(SystemExit) as exit_info:
        main(["--db", url, "runs", "--since", "yesterday"])
    assert exit_info.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1
    assert main(["--db", f"sqlite:///{tmp_path / 'absent.db'}", "runs"]) == 2
    err = capsys.readouterr().err
    assert "no lineage database at" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "absent.db").exists()


def test_an_ambiguous_prefix_names_the_candidates(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'lineage.db'}"
    with LineageStore(url) as store:
        store.ensure_schema()
        for run_id in ("abc-1", "abc-2"):
            store.start_run(config={}, overrides=[], tool_version="0.1.0", output_dir="/x", source_devices=1,
                            target_devices=1, run_id=run_id)
    assert main(["--db", url, "show", "abc"]) == 2
    assert "matches 2 runs (abc-1, abc-2)" in capsys.readouterr().err


def test_a_database_without_schema_is_refused_not_migrated(tmp_path, capsys):
    import sqlite3

    path = tmp_path / "empty.db"
    sqlite3.connect(path).close()
    assert main(["--db", f"sqlite:///{path}", "runs"]) == 2
    assert "not a lineage database" in capsys.readouterr().err
    with sqlite3.connect(path) as connection:
        assert connection.execute("SELECT name FROM sqlite_master").fetchall() == []
