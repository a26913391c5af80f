"""Runs that do not complete: failed runs and runs abandoned by killed processes."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

import pytest
from sqlalchemy import select, update

from reshard_job.lineage import LineageStore, RunStateError, RunStatus
from reshard_job.lineage.models import Event, Run


def _start(store, tmp_path):
    return store.start_run(config={}, overrides=[], tool_version="0.1.0", output_dir=str(tmp_path / "out"),
                           source_devices=8, target_devices=4)


def test_a_failed_run_keeps_its_error_and_no_outputs(store, tmp_path, make_file, get_run):
    run_id = _start(store, tmp_path)
    source = make_file(tmp_path / "src.ckpt", b"source", "source_checkpoint", 0)
    store.record_inputs(run_id, [source])
    make_file(tmp_path / "out" / "rank_0.ckpt", b"half written", "target_checkpoint", 0)  # never recorded
    store.fail_run(run_id, "MissingRankError: missing source checkpoint: rank 3")

    run = get_run(store, run_id)
    assert run["status"] == "failed"
    assert run["error"] == "MissingRankError: missing source checkpoint: rank 3"
    assert run["ended_at"] is not None and run["outputs"] == [] and len(run["inputs"]) == 1
    with store.read_session() as session:
        directions = session.scalars(select(Event.direction).where(Event.run_id == run_id)).all()
    assert directions == ["input"]
    store.fail_run(run_id, "reported twice")  # harmless; the first error stays
    assert get_run(store, run_id)["error"].startswith("MissingRankError")


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _set_run(store, run_id, **values):
    with store._writer.begin() as session:
        session.execute(update(Run).where(Run.id == run_id).values(**values))


def test_runs_of_dead_processes_on_this_host_are_abandoned(store, tmp_path, get_run):
    dead = _start(store, tmp_path)
    _set_run(store, dead, pid=_dead_pid())
    alive = _start(store, tmp_path)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _set_run(store, alive, pid=sleeper.pid)
        elsewhere = _start(store, tmp_path)
        _set_run(store, elsewhere, pid=_dead_pid(), host="some-other-host")
        mine = _start(store, tmp_path)  # this very process: alive by definition

        assert store.mark_abandoned_runs() == [dead]
    finally:
        sleeper.kill()
        sleeper.wait()
    statuses = {run_id: get_run(store, run_id)["status"] for run_id in (dead, alive, elsewhere, mine)}
    assert statuses == {dead: "abandoned", alive: "started", elsewhere: "started", mine: "started"}
    abandoned = get_run(store, dead)
    assert "ended without completing" in abandoned["error"] and abandoned["ended_at"]
    # The sleeper is gone now too; the other host's run is still never judged from here.
    assert store.mark_abandoned_runs() == [alive]


def _start_and_die(url, output_dir, connection):
    store = LineageStore(url)
    connection.send(store.start_run(config={}, overrides=[], tool_version="0.1.0", output_dir=output_dir,
                              source_devices=8, target_devices=4))
    os._exit(1)  # killed mid-conversion: no fail_run, no cleanup


def test_a_killed_job_is_found_by_the_next_one(store, tmp_path, get_run):
    db_url = store.url.render_as_string(hide_password=False)
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_start_and_die, args=(db_url, str(tmp_path / "out"), sender))
    child.start()
    assert receiver.poll(30), "the job never reported its run id"
    run_id = receiver.recv()
    child.join(timeout=30)
    assert child.exitcode == 1
    assert get_run(store, run_id)["status"] == "started"
    assert store.mark_abandoned_runs() == [run_id]
    assert get_run(store, run_id)["status"] == "abandoned"


def test_an_abandoned_run_that_reports_after_all_is_believed(store, tmp_path, get_run):
    run_id = _start(store, tmp_path)
    _set_run(store, run_id, status="abandoned")
    store.complete_run(run_id, outputs=[], plan={"ranks": []})
    run = get_run(store, run_id)
    assert run["status"] == "completed" and run["error"] is None


def test_an_interrupted_run_keeps_its_reason_and_no_outputs(store, tmp_path, make_file, get_run):
    run_id = _start(store, tmp_path)
    store.record_inputs(run_id, [make_file(tmp_path / "src.ckpt", b"source", "source_checkpoint", 0)])
    store.interrupt_run(run_id, "SIGTERM")
    run = get_run(store, run_id)
    assert (run["status"], run["error"]) == ("interrupted", "SIGTERM")
    assert run["ended_at"] is not None and run["outputs"] == []
    store.interrupt_run(run_id, "SIGINT")  # a second signal: the first word stays
    assert get_run(store, run_id)["error"] == "SIGTERM"
    with pytest.raises(RunStateError, match=f"cannot mark run {run_id} failed: it is already interrupted"):
        store.fail_run(run_id, "late error")
    with pytest.raises(RunStateError, match="already interrupted"):
        store.complete_run(run_id, outputs=[], plan={"ranks": []})
    assert store.mark_abandoned_runs() == []  # only "started" runs are ever judged abandoned


def test_an_abandoned_run_may_still_say_it_was_interrupted(store, tmp_path, get_run):
    run_id = _start(store, tmp_path)
    _set_run(store, run_id, status=RunStatus.ABANDONED)
    store.interrupt_run(run_id, "SIGINT")
    assert get_run(store, run_id)["status"] == RunStatus.INTERRUPTED == "interrupted"
