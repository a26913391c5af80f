"""Every Ctrl-C that stops the job says so: SIGINT sent to the process group of the demo job at random
moments, from its first milliseconds to its end; each run either completes (exit 0, its summary) or
exits 130 with exactly the one ``interrupted`` line on stderr, no traceback and no summary.

Start-up was the gap: the signal handlers came after importing numpy (through the lineage package),
so a Ctrl-C in the first few hundred milliseconds was Python's KeyboardInterrupt, a traceback and
death by SIGINT (a shell shows status 130) without the line. A signal that lands while the
interpreter itself is still starting (``site``, before any code of ours runs) is Python's own
business and counted apart.
"""

from __future__ import annotations

import collections
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from reliability_helpers import app_command, app_env, message_lines

LINE = "reshard_job: interrupted (SIGINT): rerun the same command to resume"


def _interrupt_once(cwd: Path, delay: float, workers: int) -> tuple[str, str | None]:
    """Run the demo in `cwd`, SIGINT its process group after `delay` seconds; return how it ended
    (``finished``, ``interrupted``, ``before our code``) and what it did wrong, if anything."""
    proc = subprocess.Popen(app_command("output.dir=out", f"job.workers={workers}"), cwd=cwd, env=app_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    time.sleep(delay)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C does
    try:
        stdout, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return "hung", f"the job hung after SIGINT at {delay:.3f} s"
    told = f"SIGINT at {delay:.3f} s, job.workers={workers}: exit {proc.returncode}\n{stdout}\n{stderr}"
    if proc.returncode in (-signal.SIGINT, 1) and "reshard_job/" not in stderr:
        return "before our code", None  # the interpreter was still starting: no frame of ours
    if proc.returncode == 0:
        return "finished", None if stdout.startswith("completed") and "Traceback" not in stderr else told
    if proc.returncode != 130 or message_lines(stderr) != [LINE] or "Traceback" in stderr:
        return "wrong", told
    # a summary of success, then 130, would contradict itself
    return "interrupted", told if "completed" in stdout else None


def _campaign(tmp_path: Path, tries: int, seed: int, window: float, at_once: int = 1) -> collections.Counter:
    """`tries` runs, each interrupted at a random moment of the first `window` seconds, `at_once` of
    them at a time (job.workers alternates 1 and 2: forked worker processes); fails listing every
    run that ended without saying so properly."""
    from concurrent.futures import ThreadPoolExecutor

    from reshard_job.sources.demo import demo_folder, ensure_demo

    ensure_demo(demo_folder())  # built once (in this test session's cache), not by the first tries
    rng = random.Random(seed)
    moments = [rng.uniform(0.0, window) for _ in range(tries)]
    for i in range(tries):
        (tmp_path / f"try{i}").mkdir()
    with ThreadPoolExecutor(at_once) as pool:
        ends = list(pool.map(lambda i: _interrupt_once(tmp_path / f"try{i}", moments[i], workers=1 + i % 2),
                             range(tries)))
    outcomes = collections.Counter(outcome for outcome, _ in ends)
    wrong = [problem for _, problem in ends if problem]
    assert not wrong, f"{len(wrong)} of {tries} runs did not tell their interruption ({dict(outcomes)}):\n\n" + \
        "\n\n".join(wrong[:3])
    return outcomes


def _demo_seconds(tmp_path: Path) -> float:
    """How long the demo runs here, its source set built already (the first run builds it)."""
    for _ in ("build", "time"):
        started = time.monotonic()
        res = subprocess.run(app_command("output.dir=out"), cwd=tmp_path, env=app_env(), capture_output=True,
                             text=True, timeout=300)
        assert res.returncode == 0, res.stderr
    return time.monotonic() - started


def test_every_interrupt_at_start_up_or_later_prints_its_line(tmp_path):
    """Ten Ctrl-Cs over the first second: start-up (imports, Hydra composing) and the job's start."""
    outcomes = _campaign(tmp_path, tries=10, seed=37, window=1.0, at_once=2)
    assert outcomes["interrupted"] >= 3, outcomes  # a fast machine finishes some demo runs within the second


@pytest.mark.slow
def test_every_interrupt_over_the_whole_demo_prints_its_line(tmp_path):
    """100 Ctrl-Cs at moments spread over the whole demo run (``pytest -m slow``)."""
    reference = tmp_path / "reference"
    reference.mkdir()
    outcomes = _campaign(tmp_path, tries=100, seed=2037, window=_demo_seconds(reference) * 1.1)
    print(dict(outcomes))
    assert outcomes["interrupted"] >= 50, outcomes
