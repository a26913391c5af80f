"""Interrupted, repeated and redone conversions.

A conversion killed with SIGKILL leaves a journal of the target files it finished (each renamed
into place after it was complete) and no manifest; the next identical run marks the killed run
abandoned in the lineage database, keeps the journaled files that still verify, redoes the rest
and produces exactly what an uninterrupted run produces. A completed directory is left alone by
an identical rerun; ``job.resume=false`` redoes everything.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from reliability_helpers import (app_command, app_env, copy_s1, lineage_runs, log_lines, s1_args, snapshot,
                                 temp_files)

RANK_FILES = "rank_*/checkpoint_*.ckpt"


def _db(cwd: Path) -> Path:
    return cwd / "runs" / "lineage.db"


def _journaled(out: Path) -> list[dict]:
    try:
        lines = (out / ".reshard_job" / "journal.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    entries = []
    for line in lines[1:]:
        try:
            entries.append(json.loads(line))
        except ValueError:
            pass  # a line being written
    return entries


def _identity(paths) -> dict[str, tuple[int, int]]:
    """(inode, mtime) per file: unchanged means not rewritten (a rewrite renames a new inode into place)."""
    return {str(p): (os.stat(p).st_ino, os.stat(p).st_mtime_ns) for p in paths}


def _outputs(out: Path) -> dict[str, bytes]:
    names = sorted(out.glob(RANK_FILES)) + [out / "strategy.ckpt"]
    return {str(p.relative_to(out)): p.read_bytes() for p in names}


def _kill_after_first_file(cwd: Path, args: list[str], out: Path) -> int:
    """Start the job, SIGKILL it as soon as one target file is journaled; return how many were."""
    proc = subprocess.Popen(app_command(*args), cwd=cwd, env=app_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not _journaled(out):
            assert proc.poll() is None, "the job ended before any file landed"
            assert time.monotonic() < deadline, "no target file landed in time"
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()  # reaped: the next run must see the process gone, not a zombie
    assert proc.returncode == -signal.SIGKILL
    return len(_journaled(out))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, big_source, app) -> Path:
    """The big source converted without interruption."""
    cwd = tmp_path_factory.mktemp("reference")
    res = app(cwd, *big_source.args(cwd / "out", "job.workers=2"))
    assert res.returncode == 0, res.stderr
    return cwd / "out"


@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_kill_9_then_resume_gives_the_uninterrupted_result(tmp_path, big_source, app, reference, workers):
    before = snapshot(big_source.root)

    out = tmp_path / "out"
    args = big_source.args(out, f"job.workers={workers}")
    done = _kill_after_first_file(tmp_path, args, out)
    assert 1 <= done < 4, "the job must be killed mid-way (a larger source would make this reliable)"
    assert not (out / "manifest.json").exists()
    kept = [out / e["path"] for e in _journaled(out)]
    kept_identity = _identity(kept)
    killed_run = lineage_runs(_db(tmp_path))[-1]
    assert killed_run["status"] == "started" and killed_run["outputs"] == []

    res = app(tmp_path, *args)
    assert res.returncode == 0, res.stderr
    logs = "\n".join(log_lines(res.stdout + res.stderr))
    assert f"resuming: keeping {len(kept)} target file(s) that verify" in logs
    assert "marked 1 run(s) left 'started' by killed processes as abandoned" in logs
    assert _identity(kept) == kept_identity  # finished files were kept, not rewritten
    assert _outputs(out) == _outputs(reference)  # byte-identical to the uninterrupted run
    assert temp_files(out) == []
    manifest = json.loads((out / "manifest.json").read_text())
    ref_manifest = json.loads((reference / "manifest.json").read_text())
    assert manifest["tensors"] == ref_manifest["tensors"]
    assert [f["sha256"] for f in manifest["target"]["files"]] == [f["sha256"] for f in ref_manifest["target"]["files"]]

    runs = lineage_runs(_db(tmp_path))
    assert [r["status"] for r in runs] == ["abandoned", "completed"]
    assert runs[0]["id"] == killed_run["id"] and "ended without completing the run" in runs[0]["error"]
    assert runs[0]["outputs"] == []
    assert sorted(p for _, _, p in runs[1]["outputs"]) == sorted(
        [str(p) for p in out.glob(RANK_FILES)] + [str(out / "strategy.ckpt"), str(out / "manifest.json")])
    assert snapshot(big_source.root) == before
    if workers > 1:  # no worker outlived the killed job (it would hold the lock and keep writing)
        leftover = subprocess.run(["pgrep", "-f", f"output.dir={out}"], capture_output=True, text=True)
        assert leftover.stdout.strip() == ""


@pytest.fixture
def completed(tmp_path, app):
    """S1 converted into tmp_path/out; the sources are unchanged after the test, whatever it reran."""
    ckpts, src, dst = copy_s1(tmp_path / "src")
    before = snapshot(tmp_path / "src")
    out = tmp_path / "out"
    args = s1_args(ckpts, src, dst, out)
    res = app(tmp_path, *args)
    assert res.returncode == 0, res.stderr
    yield out, args
    assert snapshot(tmp_path / "src") == before, "source files changed"


def test_identical_rerun_does_nothing(tmp_path, app, completed):
    out, args = completed
    files = [p for p in out.rglob("*") if p.is_file() and p.parent.name != ".reshard_job"]
    identity = _identity(files)
    before = snapshot(tmp_path / "src")
    res = app(tmp_path, *args)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[-3] == f"completed (already done): outputs in {out}"
    logs = log_lines(res.stdout + res.stderr)
    assert any(f"nothing to do: {out} already holds this conversion" in ln for ln in logs), logs
    assert not any("converting" in ln for ln in logs), logs
    assert _identity(files) == identity
    assert snapshot(tmp_path / "src") == before
    runs = lineage_runs(_db(tmp_path))
    assert [r["status"] for r in runs] == ["completed", "completed"]
    assert runs[1]["outputs"] == runs[0]["outputs"]  # the existing outputs, reported again


def test_resume_false_redoes_a_complete_directory(tmp_path, app, completed):
    out, args = completed
    files = sorted(out.glob(RANK_FILES))
    identity, content = _identity(files), _outputs(out)
    res = app(tmp_path, *args, "job.resume=false")
    assert res.returncode == 0, res.stderr
    assert all(_identity([p])[str(p)][0] != identity[str(p)][0] for p in files)  # every file rewritten
    assert _outputs(out) == content


def test_resume_false_redoes_a_partial_directory(tmp_path, app, completed):
    out, args = completed
    (out / "manifest.json").unlink()  # as if killed just before the manifest: every file journaled
    identity = _identity(sorted(out.glob(RANK_FILES)))
    res = app(tmp_path, *args)  # resume keeps all four
    assert res.returncode == 0 and _identity(sorted(out.glob(RANK_FILES))) == identity
    (out / "manifest.json").unlink()
    res = app(tmp_path, *args, "job.resume=false")
    assert res.returncode == 0, res.stderr
    new = _identity(sorted(out.glob(RANK_FILES)))
    assert all(new[p][0] != identity[p][0] for p in identity)
    assert (out / "manifest.json").exists()


def test_a_missing_file_of_a_complete_directory_is_redone(tmp_path, app, completed):
    out, args = completed
    victim = out / "rank_2" / "checkpoint_2.ckpt"
    content = victim.read_bytes()
    others = _identity(p for p in out.glob(RANK_FILES) if p != victim)
    victim.chmod(0o644)
    victim.unlink()
    res = app(tmp_path, *args)
    assert res.returncode == 0, res.stderr
    assert any("1 file(s) listed in its manifest are missing or changed (rank_2/checkpoint_2.ckpt); redoing what does "
               "not verify" in ln
               for ln in log_lines(res.stdout + res.stderr))
    assert victim.read_bytes() == content
    assert _identity(p for p in out.glob(RANK_FILES) if p != victim) == others


def test_a_journaled_file_that_no_longer_verifies_is_redone(tmp_path, app, completed):
    out, args = completed
    (out / "manifest.json").unlink()
    victim = out / "rank_1" / "checkpoint_1.ckpt"
    content = bytearray(victim.read_bytes())
    victim.chmod(0o644)
    content[-1] ^= 0xFF  # same size, different bytes
    victim.write_bytes(bytes(content))
    others = _identity(p for p in out.glob(RANK_FILES) if p != victim)
    res = app(tmp_path, *args)
    assert res.returncode == 0, res.stderr
    assert any("resuming: keeping 3 target file(s) that verify: ranks [0, 2, 3]" in ln
               for ln in log_lines(res.stdout + res.stderr))
    content[-1] ^= 0xFF
    assert victim.read_bytes() == bytes(content)
    assert _identity(p for p in out.glob(RANK_FILES) if p != victim) == others
