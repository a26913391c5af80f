"""Ctrl-C and SIGTERM at any moment: no hang, one line, exit 130/143, lock released, temporary files
removed, the lineage run marked interrupted, and the same command rerun gives the uninterrupted result.

Ctrl-C reaches the whole foreground process group (the job and its workers), so SIGINT is sent to the
group; SIGTERM, as ``kill`` sends it, to the job alone. The moments are spread over the job's whole
duration (startup, indexing, hashing, converting, the manifest, the lineage record).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from reliability_helpers import (app_command, app_env, lineage_runs, make_big_source, message_lines, temp_files)

EXPECTED = {signal.SIGINT: 130, signal.SIGTERM: 143}
NAMES = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM"}


def _outputs(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.glob("rank_*/*")) if p.is_file()}


def _start(cwd: Path, args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(app_command(*args), cwd=cwd, env=app_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _interrupt_once(cwd: Path, args: list[str], out: Path, signum: int, delay: float) -> str:
    """Run, signal after `delay` seconds; return 'interrupted' or 'finished' after checking the aftermath."""
    proc = _start(cwd, args)
    time.sleep(delay)
    if proc.poll() is None:
        if signum == signal.SIGINT:
            os.killpg(proc.pid, signum)  # as a terminal's Ctrl-C does
        else:
            os.kill(proc.pid, signum)
    try:
        stdout, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"the job hung after {NAMES[signum]} at {delay:.2f} s")
    assert "Traceback" not in stderr, stderr
    if proc.returncode == 0:
        return "finished"
    assert proc.returncode == EXPECTED[signum], (proc.returncode, stderr)
    lines = message_lines(stderr)
    assert lines == [f"reshard_job: interrupted ({NAMES[signum]}): rerun the same command to resume"], stderr
    assert temp_files(out) == [], temp_files(out)
    runs = lineage_runs(cwd / "runs" / "lineage.db")
    if runs:  # interrupted before the run was opened: nothing to record
        assert runs[-1]["status"] in ("interrupted", "started") and runs[-1]["outputs"] == [], runs[-1]
    return "interrupted"


def _check_rerun(cwd: Path, args: list[str], out: Path, reference: dict[str, bytes]) -> None:
    res = subprocess.run(app_command(*args), cwd=cwd, env=app_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr  # the lock was released; the run resumes
    assert _outputs(out) == reference
    assert temp_files(out) == []


def _reference(tmp_path: Path, source, workers: int) -> tuple[dict[str, bytes], float]:
    out = tmp_path / "reference"
    started = time.monotonic()
    res = subprocess.run(app_command(*source.args(out, f"job.workers={workers}")), cwd=tmp_path, env=app_env(),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return _outputs(out), time.monotonic() - started


def _campaign(tmp_path: Path, source, tries: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    counts = {"interrupted": 0, "finished": 0}
    reference, duration = _reference(tmp_path, source, 2)
    for i in range(tries):
        signum = (signal.SIGINT, signal.SIGTERM)[i % 2]
        workers = 1 + (i // 2) % 2
        cwd = tmp_path / f"try{i}"
        cwd.mkdir()
        out = cwd / "out"
        args = source.args(out, f"job.workers={workers}")
        # moments well inside the reference run's length: a try (one worker, publishing in one batch)
        # can be quicker than the two-worker reference, the reference may have run while the machine
        # was busier, and a signal after the end tests nothing
        counts[_interrupt_once(cwd, args, out, signum, rng.uniform(0.2, max(0.3, duration * 0.6)))] += 1
        _check_rerun(cwd, args, out, reference)
        shutil.rmtree(cwd)  # a 1 GiB campaign would otherwise keep 60 outputs on disk
    return counts


def test_interrupts_at_random_moments(tmp_path, big_source):
    counts = _campaign(tmp_path, big_source, tries=4, seed=1123)
    assert counts["interrupted"] >= 2, counts


@pytest.mark.slow
def test_interrupts_at_random_moments_in_a_1gb_conversion(tmp_path_factory):
    """30 SIGINT and 30 SIGTERM at random moments of a 1 GiB conversion (``pytest -m slow``)."""
    root = tmp_path_factory.mktemp("big_1gb")
    source = make_big_source(root, n_tensors=8, rows=8192, cols=4096)  # 8 x 128 MiB float32 = 1 GiB
    counts = _campaign(tmp_path_factory.mktemp("signals"), source, tries=60, seed=2026)
    assert counts["interrupted"] >= 40, counts


def test_a_signal_held_during_foreign_code_acts_right_after():
    """``signals.held``: a SIGTERM while a database driver closes its connection is not raised
    inside it (its pool would log a traceback) but right after, as the job's handler would."""
    from reshard_job.job.run.signals import Interrupted, held, interruptible

    reached = []
    with pytest.raises(Interrupted) as err:
        with interruptible():
            with held():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)  # the handler has run by now: only noted
                reached.append("end of the held block")
    assert reached == ["end of the held block"]
    assert err.value.exit_code == 143


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_a_sweep_not_only_its_current_job(tmp_path, signum):
    """Ctrl-C (or SIGTERM) while a sweep's second job starts: the sweep ends there with the signal's
    status, in one line, and its later jobs never start (they went on one after the other)."""
    args = ["-m", "target.devices=1,2,4,8", "output.dir=out${target.devices}", "hydra.sweep.dir=sweep",
            "job.progress=false"]
    proc = _start(tmp_path, args)
    try:
        for line in proc.stdout:
            if "#1 : " in line:  # Hydra's launcher starts the second job
                (os.killpg if signum == signal.SIGINT else os.kill)(proc.pid, signum)
                break
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == EXPECTED[signum], stderr
    assert message_lines(stderr) == [f"reshard_job: interrupted ({NAMES[signum]}): rerun the same command to resume"]
    assert (tmp_path / "out1" / "manifest.json").is_file()  # the first job had finished
    assert not (tmp_path / "out4").exists() and not (tmp_path / "out8").exists()
