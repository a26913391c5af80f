"""``python -m reshard_job.audit`` end to end, in subprocesses, for every command with and
without ``--json``; argument edge cases run in-process through ``main(argv)``.

The read-only invocations share one recorded two-hop lineage and run concurrently (they only
read), which keeps this module to a few seconds; the ones that damage files get their own copy.
Edge cases of arguments are exercised in-process, where they cost milliseconds.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import update

from reshard_job import __version__
from reshard_job.audit import main
from reshard_job.lineage import LineageStore
from reshard_job.lineage.models import Run


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


@dataclass
class Recorded:
    root: Path
    url: str
    lineage: object  # conftest.TwoHopLineage
    failed: str
    interrupted: str


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, record_lineage) -> Recorded:
    root = tmp_path_factory.mktemp("audit")
    url = f"sqlite:///{root / 'runs' / 'lineage.db'}"
    with LineageStore(url) as store:
        store.ensure_schema()
        lineage = record_lineage(store, root / "files")
        failed = store.start_run(config={}, overrides=["source.checkpoints=/nowhere"], tool_version="0.1.0",
                                 output_dir=str(root / "failed"), source_devices=8, target_devices=4)
        store.fail_run(failed, "ConfigError: /nowhere: no such directory")
        interrupted = store.start_run(config={}, overrides=[], tool_version="0.1.0", output_dir=str(root / "stopped"),
                                      source_devices=8, target_devices=2)
        store.interrupt_run(interrupted, "SIGTERM")
        with store._writer.begin() as session:  # another user started the failed run
            session.execute(update(Run).where(Run.id == failed).values(user="someone-else"))
    return Recorded(root, url, lineage, failed, interrupted)


@pytest.fixture(scope="module")
def outputs(recorded) -> dict[str, Result]:
    lineage = recorded.lineage
    db = ["--db", recorded.url]
    out_b = os.path.dirname(lineage.final.path.rsplit(os.sep, 1)[0])
    commands = {
        "runs": db + ["runs"],
        "runs_json": db + ["runs", "--json"],
        "show": db + ["show", lineage.run_a[:8]],
        "show_json": db + ["--json", "show", lineage.run_a],
        "trace": db + ["trace", lineage.final.path],
        "trace_json": db + ["trace", lineage.final.path, "--json"],
        "descendants": db + ["trace", "--descendants", lineage.sources[1].path],
        "verify": db + ["verify", lineage.run_b],
        "verify_dir": db + ["verify", out_b, "--json"],
        "graph_svg": db + ["graph", lineage.final.path, "--format", "svg"],
        "unknown_run": db + ["show", "ffffffff-no-such-run"],
        "version": ["--version"],
    }
    results = run_audit_batch(commands, cwd=recorded.root)
    # The same commands in-process, where a subprocess would add nothing but start-up time.
    in_process = {
        "trace_short_digest": db + ["trace", lineage.final.sha256[:12], "--json"],
        "descendants_json": db + ["trace", "--descendants", lineage.sources[1].path, "--json"],
        "trace_dir": db + ["trace", out_b, "--json"],
        "verify_json": db + ["verify", lineage.run_b, "--json"],
        "graph_dot": db + ["graph", lineage.final.sha256[:8]],
        "too_short": db + ["show", lineage.run_a[:7]],
    }
    for name, argv in in_process.items():
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
        results[name] = Result(code, out.getvalue(), err.getvalue())
    return results


def test_runs_table_and_json(outputs, recorded):
    lineage = recorded.lineage
    text = outputs["runs"]
    assert text.code == 0, text.err
    for run_id in (lineage.run_a, lineage.run_b, recorded.failed, recorded.interrupted):
        assert run_id in text.out
    assert "8→4" in text.out and "4→2" in text.out and "failed" in text.out and "interrupted" in text.out
    listed = outputs["runs_json"].json()
    assert [r["id"] for r in listed] == [lineage.run_a, lineage.run_b, recorded.failed, recorded.interrupted]
    assert [r["status"] for r in listed] == ["completed", "completed", "failed", "interrupted"]
    # The stable shape of `runs --json`: these keys, in this order.
    assert list(listed[0]) == ["id", "status", "started_at", "ended_at", "source_devices", "target_devices",
                               "output_dir", "sweep_id", "job_num", "tool_version", "host", "pid", "user", "error"]


def test_show_text_and_json(outputs, recorded):
    lineage = recorded.lineage
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
    lineage = recorded.lineage
    text = outputs["trace"]
    assert text.code == 0, text.err
    assert lineage.run_a in text.out and lineage.run_b in text.out
    assert all(f.path in text.out for f in lineage.sources) and lineage.copied.path in text.out
    assert "8 source checkpoints, 1 strategy" in text.out
    by_short_digest = outputs["trace_short_digest"].json()
    assert by_short_digest["root"]["sha256"] == lineage.final.sha256
    for traced in (outputs["trace_json"].json(), by_short_digest):
        assert [r["run_id"] for r in traced["runs"]] == [lineage.run_b, lineage.run_a]
        ancestors = {a["sha256"] for a in traced["ancestors"]}
        assert {f.sha256 for f in lineage.sources} <= ancestors
        originals = {a["sha256"] for a in traced["original_sources"] if a["kind"] == "source_checkpoint"}
        assert originals == {f.sha256 for f in lineage.sources}


def test_the_digests_and_run_ids_that_are_printed_are_accepted_back(outputs, recorded):
    lineage = recorded.lineage
    printed = outputs["show"].out  # show prints 12-character digests; feed one back
    digest = next(line.split()[-2] for line in printed.splitlines() if lineage.outputs_a[0].path in line)
    assert len(digest) == 12 and lineage.outputs_a[0].sha256.startswith(digest)
    assert main(["--db", recorded.url, "trace", digest, "--json"]) == 0
    short_run = next(line for line in outputs["trace"].out.splitlines() if "produced by run" in line).split()[4]
    assert main(["--db", recorded.url, "show", short_run[:8]]) == 0
    assert outputs["graph_dot"].code == 0 and lineage.run_a in outputs["graph_dot"].out


def test_descendants_cross_both_hops_in_text_and_json(outputs, recorded):
    lineage = recorded.lineage
    text = outputs["descendants"]
    assert text.code == 0, text.err
    assert text.out.splitlines()[0].startswith(lineage.sources[1].path)
    assert f"used by run {lineage.run_a}" in text.out and f"used by run {lineage.run_b}" in text.out
    assert lineage.final.path in text.out and "(final)" in text.out
    built = outputs["descendants_json"].json()
    assert built["direction"] == "descendants" and [r["run_id"] for r in built["runs"]] == [lineage.run_a,
                                                                                             lineage.run_b]
    assert {f.sha256 for f in lineage.outputs_a + lineage.outputs_b} <= {d["sha256"] for d in built["descendants"]}
    finals = {(f["kind"], f["sha256"]) for f in built["final_outputs"]}
    # A's manifest was read by no run; everything else A wrote was converted again by B.
    assert finals == {("manifest", lineage.outputs_a[5].sha256)} | {(f.kind, f.sha256) for f in lineage.outputs_b}
    assert "5 final files: 2 target checkpoints, 1 strategy, 2 manifests" in text.out


def test_an_output_directory_is_traced_and_verified_by_its_manifest(outputs, recorded):
    lineage = recorded.lineage
    traced = outputs["trace_dir"].json()
    assert outputs["trace_dir"].code == 0, outputs["trace_dir"].err
    assert [root["sha256"] for root in traced["roots"]] == [f.sha256 for f in lineage.outputs_b[:3]]
    assert [r["run_id"] for r in traced["runs"]] == [lineage.run_b, lineage.run_a]
    report = outputs["verify_dir"].json()
    assert outputs["verify_dir"].code == 0 and report["intact"] and report["run_id"] == lineage.run_b
    assert sorted(f["path"] for f in report["files"]) == sorted(f.path for f in lineage.outputs_b)


def test_verify_intact_text_and_json(outputs, recorded):
    assert outputs["verify"].code == 0, outputs["verify"].err
    assert "all 4 files intact" in outputs["verify"].out
    report = outputs["verify_json"].json()
    assert outputs["verify_json"].code == 0 and report["intact"] and report["checked"] == 4


def test_graph_on_stdout(outputs, recorded):
    svg = outputs["graph_svg"]
    assert svg.code == 0, svg.err
    assert svg.out.startswith("<svg") and f'id="run-{recorded.lineage.run_b}"' in svg.out
    assert outputs["graph_dot"].out.startswith("digraph lineage {")


def test_unknown_and_too_short_runs_are_one_clear_line(outputs, recorded, capsys):
    expected = ["error: no run with id 'ffffffff-no-such-run' in the lineage database"]
    result = outputs["unknown_run"]
    assert result.code == 2 and result.out == "" and result.err.strip().splitlines() == expected
    assert main(["--db", recorded.url, "show", "ffffffff-no-such-run", "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.strip().splitlines() == expected
    short = outputs["too_short"]
    assert short.code == 2 and short.err.strip().splitlines() == [
        f"error: run id '{recorded.lineage.run_a[:7]}' is too short: give the whole id or a prefix of at least "
        f"8 characters"]


def test_version(outputs):
    assert outputs["version"].code == 0 and outputs["version"].out == f"reshard_job {__version__}\n"
    script = Path(sys.executable).parent / "reshard-audit"
    assert script.exists(), f"{script}: the console script is not installed (pip install -e .)"
    result = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout) == (0, f"reshard_job {__version__}\n")


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


def test_verify_finds_a_file_of_another_size_changed_without_hashing_it(tmp_path):
    """A 5 GiB sparse file in the place of an output is changed by its size alone: no digest taken
    (its reported sha256 stays empty), and a folder in a file's place is named as one."""
    from reshard_job.audit.verify import check_file

    grown = tmp_path / "grown.ckpt"
    with open(grown, "wb") as f:
        f.truncate(5 << 30)
    check = check_file(str(grown), "ab" * 32, 42628)
    assert (check.state, check.actual_size, check.actual_sha256) == ("changed", 5 << 30, None)
    assert check.detail == f"{5 << 30} bytes, recorded 42628"
    (tmp_path / "folder").mkdir()
    check = check_file(str(tmp_path / "folder"), "ab" * 32, 42628)
    assert (check.state, check.detail) == ("changed", "is a directory")


@pytest.mark.parametrize("manifest", ["a FIFO", "nested 200,000 deep"])
def test_a_manifest_that_is_a_fifo_or_nested_too_deep_is_one_line(tmp_path, capsys, record_lineage, manifest):
    """A FIFO in manifest.json's place blocked verify and trace for ever; a manifest of 200,000
    nested lists was a RecursionError traceback. Both are one line, exit 2."""
    url = f"sqlite:///{tmp_path / 'runs' / 'lineage.db'}"
    with LineageStore(url) as store:
        store.ensure_schema()
        lineage = record_lineage(store, tmp_path / "files")
    out = tmp_path / "out"
    shutil.copytree(Path(lineage.outputs_b[-1].path).parent, out)
    (out / "manifest.json").unlink()
    if manifest == "a FIFO":
        os.mkfifo(out / "manifest.json")
    else:
        (out / "manifest.json").write_text('{"a": ' + "[" * 200_000 + "]" * 200_000 + "}")
    for command in ("verify", "trace"):
        assert main(["--db", url, command, str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"error: {out / 'manifest.json'}: "), err
        if manifest != "a FIFO":
            assert err.rstrip().endswith("not a reshard_job manifest (nested too deeply to be a manifest)"), err


def test_a_moved_output_directory_still_verifies_and_an_edited_manifest_is_caught(tmp_path, capsys,
                                                                                  record_lineage):
    url = f"sqlite:///{tmp_path / 'runs' / 'lineage.db'}"
    with LineageStore(url) as store:
        store.ensure_schema()
        lineage = record_lineage(store, tmp_path / "files")
    moved = tmp_path / "archive" / "out_b"
    shutil.copytree(Path(lineage.outputs_b[-1].path).parent, moved)
    assert main(["--db", url, "verify", str(moved), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["intact"] and report["run_id"] == lineage.run_b and report["checked"] == 4
    assert {f["path"] for f in report["files"]} == {str(moved / "rank_0" / "checkpoint_0.ckpt"),
                                                    str(moved / "rank_1" / "checkpoint_1.ckpt"),
                                                    str(moved / "strategy.ckpt"), str(moved / "manifest.json")}

    # Edit a checkpoint and make the manifest agree: the files match it, but nobody recorded it.
    checkpoint = moved / "rank_1" / "checkpoint_1.ckpt"
    checkpoint.write_bytes(b"edited")
    manifest = json.loads((moved / "manifest.json").read_text())
    manifest["target"]["files"][1].update(size=6, sha256=hashlib.sha256(b"edited").hexdigest())
    (moved / "manifest.json").write_text(json.dumps(manifest))
    assert main(["--db", url, "verify", str(moved)]) == 1
    captured = capsys.readouterr()
    assert f"UNRECORDED {moved / 'manifest.json'}" in captured.out
    assert "manifest.json unrecorded" in captured.err

    assert main(["--db", url, "verify", str(tmp_path)]) == 2
    assert "no manifest.json" in capsys.readouterr().err


# -- in-process: argument handling ---------------------------------------------------------------

def test_trace_by_sha256_and_default_database_from_environment(recorded, capsys, monkeypatch):
    lineage = recorded.lineage
    monkeypatch.setenv("RESHARD_JOB_LINEAGE_URL", recorded.url)
    assert main(["trace", lineage.final.sha256, "--json"]) == 0
    traced = json.loads(capsys.readouterr().out)
    assert traced["query"]["sha256"] == lineage.final.sha256
    assert {f.sha256 for f in lineage.sources} <= {a["sha256"] for a in traced["ancestors"]}
    monkeypatch.delenv("RESHARD_JOB_LINEAGE_URL")
    monkeypatch.setenv("RESHARD_LINEAGE_URL", recorded.url)  # the name earlier versions read
    assert main(["trace", lineage.final.sha256, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["query"]["sha256"] == lineage.final.sha256
    monkeypatch.delenv("RESHARD_LINEAGE_URL")
    monkeypatch.chdir(recorded.root)  # the default is runs/lineage.db under the current directory
    assert main(["runs", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 4


def _listed(capsys) -> list[str]:
    return [run["id"] for run in json.loads(capsys.readouterr().out)]


def test_filters_by_status_date_output_sweep_and_user(recorded, capsys):
    url, lineage = recorded.url, recorded.lineage
    runs = ["--db", url, "runs", "--json"]
    assert main(runs + ["--status", "failed"]) == 0 and _listed(capsys) == [recorded.failed]
    assert main(runs + ["--status", "interrupted"]) == 0 and _listed(capsys) == [recorded.interrupted]
    assert main(runs + ["--since", "2999-01-01"]) == 0 and _listed(capsys) == []
    assert main(["--db", url, "runs", "--until", "2000-01-01"]) == 0
    assert capsys.readouterr().out.strip() == "no runs"
    assert main(["runs", "--db", url, "--until", "2999-12-31", "--json"]) == 0 and len(_listed(capsys)) == 4
    out_b = Path(lineage.final.path).parent.parent
    assert main(runs + ["--output-dir", str(out_b)]) == 0 and _listed(capsys) == [lineage.run_b]
    assert main(runs + ["--output-dir", str(out_b.parent)]) == 0 and _listed(capsys) == [lineage.run_a, lineage.run_b]
    assert main(runs + ["--output-dir", lineage.final.path]) == 0 and _listed(capsys) == [lineage.run_b]
    assert main(runs + ["--sweep", "sweep-1"]) == 0 and _listed(capsys) == [lineage.run_b]
    assert main(runs + ["--user", "someone-else"]) == 0 and _listed(capsys) == [recorded.failed]
    assert main(runs + ["--status", "completed", "--limit", "1"]) == 0 and _listed(capsys) == [lineage.run_b]


def test_bad_dates_and_missing_databases_are_one_line_errors(recorded, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--db", recorded.url, "runs", "--since", "yesterday"])
    assert exit_info.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1
    assert main(["--db", f"sqlite:///{tmp_path / 'absent.db'}", "runs"]) == 2
    err = capsys.readouterr().err
    assert "no lineage database at" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "absent.db").exists()


def _two_contents_sharing_an_8_character_digest_prefix() -> tuple[bytes, bytes]:
    # A birthday search: about 80 000 hashes find a pair, in well under a second.
    seen: dict[str, bytes] = {}
    for index in range(2_000_000):
        data = f"content {index}".encode()
        prefix = hashlib.sha256(data).hexdigest()[:8]
        if prefix in seen:
            return seen[prefix], data
        seen[prefix] = data
    raise AssertionError("no shared prefix found")


def test_prefixes_must_be_unique_and_long_enough(tmp_path, capsys, make_file):
    url = f"sqlite:///{tmp_path / 'lineage.db'}"
    first, second = _two_contents_sharing_an_8_character_digest_prefix()
    shared = hashlib.sha256(first).hexdigest()[:8]
    with LineageStore(url) as store:
        store.ensure_schema()
        files = [make_file(tmp_path / name, data, "source_checkpoint", 0)
                 for name, data in (("first.ckpt", first), ("second.ckpt", second), ("third.ckpt", b"third"))]
        third = files[2].sha256
        for run_id in ("abcdef12-1", "abcdef12-2", f"{third[:8]}-run"):
            run = store.start_run(config={}, overrides=[], tool_version="0.1.0", output_dir="/x", source_devices=1,
                                  target_devices=1, run_id=run_id)
            store.record_inputs(run, files)

    def error(*argv: str) -> str:
        assert main(["--db", url, *argv]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and len(captured.err.strip().splitlines()) == 1
        return captured.err

    assert "matches 2 runs (abcdef12-1, abcdef12-2)" in error("show", "abcdef12")
    assert "too short" in error("show", "abc")
    assert f"'{shared}' matches 2 records (sha256 {shared}" in error("trace", shared)
    both = error("graph", third[:8])  # a run id and a content start alike: refused, not guessed
    assert f"run {third[:8]}-run" in both and f"sha256 {third[:16]}" in both
    assert main(["--db", url, "trace", third[:9], "--json"]) == 0  # one more character decides
    assert json.loads(capsys.readouterr().out)["root"]["sha256"] == third
    assert main(["--db", url, "trace", hashlib.sha256(first).hexdigest()[:10], "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["root"]["path"] == files[0].path


def test_a_database_without_schema_is_refused_not_migrated(tmp_path, capsys):
    import sqlite3

    path = tmp_path / "empty.db"
    sqlite3.connect(path).close()
    assert main(["--db", f"sqlite:///{path}", "runs"]) == 2
    assert "not a lineage database" in capsys.readouterr().err
    with sqlite3.connect(path) as connection:
        assert connection.execute("SELECT name FROM sqlite_master").fetchall() == []


def test_a_closed_pipe_stops_the_audit_quietly(tmp_path):
    """``audit runs | head -1`` must stop like a Unix tool: no BrokenPipeError, status 141."""
    import datetime as dt

    from sqlalchemy import insert

    url = f"sqlite:///{tmp_path / 'lineage.db'}"
    with LineageStore(url) as store:
        store.ensure_schema()
        start = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
        rows = [dict(id=f"run-{n:06d}", status="completed", started_at=start + dt.timedelta(seconds=n),
                     tool_version="0.1.0", host="host", pid=1, overrides=[], config={},
                     output_dir=f"/data/converted/{n:06d}") for n in range(3000)]
        with store.engine.begin() as connection:
            connection.execute(insert(Run), rows)  # more output than a pipe usually buffers
    audit = [sys.executable, "-m", "reshard_job.audit", "--db", url]

    # Deterministic: the reader is gone before the audit writes a byte.
    for command in (["runs", "--json"], ["show", "run-000007"]):
        read_end, write_end = os.pipe()
        os.close(read_end)
        try:
            result = subprocess.run(audit + command, stdout=write_end, stderr=subprocess.PIPE, text=True,
                                    timeout=120, env=_environment())
        finally:
            os.close(write_end)
        assert (result.returncode, result.stderr) == (141, ""), command

    # As users meet it; whether the write fails depends on timing and the pipe's size, never the stderr.
    script = (f'"{sys.executable}" -m reshard_job.audit --db "{url}" runs 2>"{tmp_path / "err"}" | head -1; '
              f'echo "${{PIPESTATUS[0]}}" >"{tmp_path / "status"}"')
    for _ in range(3):
        result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120,
                                env=_environment())
        assert result.stdout.startswith("RUN ID ") and result.stdout.count("\n") == 1
        assert (tmp_path / "err").read_text() == ""
        assert (tmp_path / "status").read_text().strip() in ("0", "141")


HOPS = 300


@pytest.fixture(scope="module")
def chain_of_conversions(tmp_path_factory):
    """A lineage database of HOPS successive conversions, each reading the last one's output (built
    once for the commands below: 300 committed runs take a while on a slow disk)."""
    from reshard_job.lineage import LineageStore
    from lineage_fixtures import write_file

    root = tmp_path_factory.mktemp("chain")
    url = f"sqlite:///{root / 'chain.db'}"
    store = LineageStore(url)
    store.ensure_schema()
    files = [write_file(root / "hop_0.ckpt", b"hop 0", "source_checkpoint", 0)]
    for hop in range(1, HOPS + 1):
        run = store.start_run(config={}, overrides=[], tool_version="0.1.0", output_dir=str(root),
                              source_devices=1, target_devices=1)
        store.record_inputs(run, [files[-1]])
        files.append(write_file(root / f"hop_{hop}.ckpt", f"hop {hop}".encode(), "target_checkpoint", 0))
        store.complete_run(run, outputs=[files[-1]], plan={"ranks": []})
    store.close()
    return url, files


@pytest.mark.parametrize("command", [["trace", "LAST"], ["trace", "LAST", "--json"], ["trace", "FIRST", "--descendants"],
                                     ["trace", "FIRST", "--descendants", "--json"], ["graph", "LAST", "--format", "dot"],
                                     ["graph", "FIRST", "--descendants", "--format", "svg"]])
def test_a_chain_of_hundreds_of_conversions_is_an_ordinary_input(chain_of_conversions, command, capsys):
    """300 successive conversions, each reading the last one's output: the walk reaches the first
    file from the last (and back) without running out of interpreter stack."""
    url, files = chain_of_conversions
    argv = [{"FIRST": files[0].path, "LAST": files[-1].path}.get(a, a) for a in command]
    assert main(["--db", url, *argv]) == 0
    out = capsys.readouterr().out
    far_end = files[0] if "LAST" in command else files[-1]
    assert far_end.sha256 in out or os.path.basename(far_end.path) in out, out[-2000:]
    if command[0] == "trace" and "--json" not in command:  # indented a level per hop up to a point only
        from reshard_job.audit.render import FOLD_AT

        assert max(map(len, out.splitlines())) < FOLD_AT + 300 and "drawn from the left margin again" in out
        assert len(out) < 1000 * HOPS  # (indented at every level: 1.1 MB here, 48 MB for 2,000 hops)
    if "--json" in command:  # nested a level per hop: parsed with room for the nesting
        assert len(out) < 4000 * HOPS and "\n" not in out.strip()  # one line: not indented 600 levels deep
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(20_000)
        try:
            assert json.dumps(json.loads(out)).count('"run_id"') >= HOPS
        finally:
            sys.setrecursionlimit(limit)


def _obey_permission_bits():
    """preexec_fn: root without CAP_DAC_OVERRIDE/READ_SEARCH, so a 0444 file is read-only to it."""
    if os.geteuid() != 0:
        return None
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def drop() -> None:
        for cap in (1, 2):
            if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")

    return drop


def test_a_read_only_copy_of_the_database_is_audited(tmp_path, make_file):
    """An auditor's read-only copy (file 0444 in a 0555 folder, WAL mode): every command reads it, and
    nothing is written beside it."""
    from reshard_job.lineage import LineageStore

    db = tmp_path / "given" / "lineage.db"
    store = LineageStore(f"sqlite:///{db}")
    store.ensure_schema()
    source = make_file(tmp_path / "src.ckpt", b"source", "source_checkpoint", 0)
    run = store.start_run(config={}, overrides=[], tool_version="0.1.0", output_dir=str(tmp_path),
                          source_devices=1, target_devices=1)
    store.record_inputs(run, [source])
    output = make_file(tmp_path / "out.ckpt", b"output", "target_checkpoint", 0)
    store.complete_run(run, outputs=[output], plan={"ranks": []})
    store.close()
    for extra in db.parent.glob("lineage.db-*"):
        extra.unlink()
    db.chmod(0o444)
    db.parent.chmod(0o555)
    try:
        before = sorted(p.name for p in db.parent.iterdir())
        for args in (["runs"], ["show", run[:8]], ["trace", output.path], ["trace", source.path, "--descendants"]):
            res = subprocess.run([sys.executable, "-m", "reshard_job.audit", "--db", f"sqlite:///{db}", *args],
                                 capture_output=True, text=True, cwd=tmp_path, preexec_fn=_obey_permission_bits(),
                                 env=_environment())
            assert res.returncode == 0, (args, res.stderr)
            assert run[:8] in res.stdout or os.path.basename(source.path) in res.stdout, res.stdout
        assert sorted(p.name for p in db.parent.iterdir()) == before
    finally:
        db.parent.chmod(0o755)


def test_control_characters_from_the_database_and_arguments_are_shown_not_obeyed(tmp_path, make_file, capsys):
    """A recorded path, error or argument holding terminal escapes (set title, clear screen) reaches
    the terminal as visible text; JSON escapes them as JSON does."""
    from reshard_job.lineage import LineageStore

    url = f"sqlite:///{tmp_path / 'esc.db'}"
    store = LineageStore(url)
    store.ensure_schema()
    hostile = tmp_path / "\x1b]0;owned\x07\x1b[2J"
    source = make_file(hostile / "src.ckpt", b"source", "source_checkpoint", 0)
    run = store.start_run(config={}, overrides=["a=\x1b[31mred"], tool_version="0.1.0", output_dir=str(hostile),
                          source_devices=1, target_devices=1)
    store.record_inputs(run, [source])
    store.fail_run(run, "boom \x1b[2J\x9b")
    store.close()
    for argv in (["runs"], ["show", run[:8]], ["trace", source.path, "--descendants"],
                 ["trace", str(tmp_path / "\x1b[2Jnothing")], ["show", run[:8], "--json"]):
        main(["--db", url, *argv])
        out, err = capsys.readouterr()
        assert "\x1b" not in out + err and "\x9b" not in out + err and "\x07" not in out + err, (argv, out, err)
        assert "\\x1b" in out + err or "\\u001b" in out + err, (argv, out, err)


def test_an_error_naming_a_path_with_a_newline_is_one_line(tmp_path, capsys):
    """The audit's error line names a folder whose name holds a newline and ESC as \\x0a and
    \\x1b: a script reading stderr's one line gets the whole message."""
    from reshard_job.lineage import LineageStore

    url = f"sqlite:///{tmp_path / 'l.db'}"
    store = LineageStore(url)
    store.ensure_schema()
    store.close()
    hostile = tmp_path / "nl\x1b[31m\ndir"
    hostile.mkdir()
    for argv in (["verify", str(hostile)], ["trace", str(hostile)], ["compare", str(hostile), str(tmp_path)]):
        assert main(["--db", url, *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "nl\\x1b[31m\\x0adir" in err, (argv, err)


@pytest.mark.parametrize("url", ["s3://user:pwSECRET@bkt/out", "s3://TOKENSECRET@bkt/out"])
def test_the_audits_error_line_never_shows_a_urls_credentials(tmp_path, capsys, monkeypatch, url):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    assert main(["--db", f"sqlite:///{tmp_path / 'l.db'}", "compare", url, str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert "SECRET" not in captured.out + captured.err and "s3://***@bkt/out" in captured.err


def test_rows_that_do_not_parse_are_shown_not_fatal(tmp_path, capsys):
    """A run row edited by hand (a config that is not JSON, a start time that is not a time) is
    listed and shown as unreadable; the other runs are unaffected."""
    import sqlite3

    from reshard_job.lineage import LineageStore

    db = tmp_path / "damaged.db"
    store = LineageStore(f"sqlite:///{db}")
    store.ensure_schema()
    runs = []
    for _ in range(3):
        runs.append(store.start_run(config={"fine": 1}, overrides=[], tool_version="0.1.0", output_dir=str(tmp_path),
                                    source_devices=1, target_devices=1))
        store.fail_run(runs[-1], "x")
    store.close()
    with sqlite3.connect(db) as con:
        con.execute("UPDATE runs SET config = '{not json' WHERE id = ?", (runs[0],))
        con.execute("UPDATE runs SET started_at = 'yesterday-ish' WHERE id = ?", (runs[1],))
    assert main(["--db", f"sqlite:///{db}", "runs"]) == 0
    listed = capsys.readouterr().out
    assert all(run in listed for run in runs) and "0001-01-01" in listed
    assert main(["--db", f"sqlite:///{db}", "show", runs[0]]) == 0
    assert '"unreadable": "{not json"' in capsys.readouterr().out
    assert main(["--db", f"sqlite:///{db}", "show", runs[2], "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config"] == {"fine": 1}


def test_a_status_no_version_writes_and_source_ranks_of_mixed_types_are_shown_not_fatal(tmp_path, capsys):
    """A run's status edited past the CHECK constraint, a rank map row whose source ranks are JSON
    of mixed types: every command that shows them says what the row holds."""
    import sqlite3

    from reshard_job.lineage import LineageStore

    db = tmp_path / "damaged.db"
    store = LineageStore(f"sqlite:///{db}")
    store.ensure_schema()
    run = store.start_run(config={}, overrides=[], tool_version="0.1.0", output_dir=str(tmp_path),
                          source_devices=2, target_devices=1)
    store.complete_run(run, outputs=[], plan={"ranks": [{"target_rank": 0, "source_ranks": [0, 1]}]})
    store.close()
    with sqlite3.connect(db) as con:
        con.execute("PRAGMA ignore_check_constraints = ON")
        con.execute("UPDATE runs SET status = 'weird' WHERE id = ?", (run,))
        con.execute("UPDATE run_ranks SET source_ranks = '[1, \"x\"]'")
        assert con.execute("SELECT count(*) FROM run_ranks").fetchone()[0] == 1
    url = f"sqlite:///{db}"
    for argv in (["runs"], ["runs", "--json"], ["show", run], ["show", run, "--json"], ["openlineage"]):
        assert main(["--db", url, *argv]) == 0, argv
        out = capsys.readouterr().out
        assert "weird (unknown status)" in out or "OTHER" in out, (argv, out)
    main(["--db", url, "show", run])
    assert "unreadable: [1, 'x']" in capsys.readouterr().out


def test_json_is_indented_unless_it_nests_deeper_than_people_read():
    """The ancestry of 2,000 conversions nests 4,000 levels: indented, its text grew with the square
    of the depth (32 MB for 500 hops, over a minute for 2,000); it is printed on one line then."""
    from reshard_job.audit.cli import DEEP_JSON, json_text

    shallow = {"a": [{"b": 1}]}
    assert json_text(shallow) == json.dumps(shallow, indent=2)
    deep = {"next": []}
    for _ in range(DEEP_JSON):
        deep = {"next": [deep]}
    text = json_text(deep)
    assert "\n" not in text and json.loads(text) == deep
    assert len(text) < 20 * DEEP_JSON


def test_a_database_of_a_newer_schema_is_named_by_its_file(tmp_path, capsys):
    import sqlite3

    from reshard_job.lineage import LineageStore

    db = tmp_path / "newer.db"
    store = LineageStore(f"sqlite:///{db}")
    store.ensure_schema()
    store.close()
    with sqlite3.connect(db) as con:
        con.execute("UPDATE alembic_version SET version_num = '9999'")
    assert main(["--db", f"sqlite:///{db}", "runs"]) == 2
    assert f"sqlite:///{db} has schema revision 9999, newer than this tool knows" in capsys.readouterr().err
