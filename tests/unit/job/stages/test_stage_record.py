"""The record stage on its own (``job.stages.record.LineageRecorder``): a conversion's run, inputs,
plan, outputs and end recorded into a real SQLite lineage database in tmp_path, read back the way
``reshard_job.audit`` reads it.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import update

from reshard_job.audit.queries import run_details
from reshard_job.errors import ReshardError
from reshard_job.job.config.spec import JobContext, JobSpec, LineageSpec, OutputSpec, RunSpec, SourceSpec, TargetSpec
from reshard_job.job.run.signals import Interrupted
from reshard_job.job.stages.record import LineageRecorder, NoRecorder
from reshard_job.lineage import FileRecord, LineageError, LineageStore
from reshard_job.lineage.models import Run

PASSWORD = "hunter2"


def _spec(tmp_path: Path, url: str | None = None, overrides: tuple[str, ...] = ()) -> JobSpec:
    url = url or f"sqlite:///{tmp_path / 'runs' / 'lineage.db'}"
    return JobSpec(SourceSpec(str(tmp_path / "src")), TargetSpec(devices=1), OutputSpec(str(tmp_path / "out")),
                   LineageSpec(True, url), RunSpec(), JobContext(str(tmp_path), str(tmp_path / "run"), overrides,
                                                                 sweep_id="sweep-3", job_num=2),
                   config={"target": {"devices": 1}})


def _file(path: Path, data: bytes, kind: str, rank: int | None = None) -> FileRecord:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return FileRecord.from_file(str(path), kind, rank)


def _recorded(spec: JobSpec, run_id: str) -> dict:
    with LineageStore(spec.lineage.url) as store, store.read_session() as session:
        return run_details(session, run_id).to_json()


def _plan() -> dict:
    return {"source": {"devices": 2}, "target": {"devices": 1},
            "ranks": [{"target_rank": 0, "source_ranks": [0, 1], "bytes_read": 20, "bytes_written": 10}]}


def test_a_completed_conversion_is_recorded_with_its_inputs_plan_and_outputs(tmp_path):
    spec = _spec(tmp_path, overrides=("target.devices=1", f"lineage.url=postgresql://me:{PASSWORD}@db/lineage"))
    inputs = [_file(tmp_path / "src" / f"rank_{r}" / "c.ckpt", f"source {r}".encode(), "source_checkpoint", r)
              for r in range(2)]
    output = _file(tmp_path / "out" / "rank_0" / "c.ckpt", b"target 0", "target_checkpoint", 0)
    recorder = LineageRecorder(spec)
    try:
        run_id = recorder.ensure_open()
        assert _recorded(spec, run_id)["status"] == "started"  # before any output is written
        recorder.record_plan(_plan)
        recorder.record_inputs(inputs)
        assert recorder.complete([output]) == run_id == recorder.run_id
    finally:
        recorder.close()

    run = _recorded(spec, run_id)
    assert run["status"] == "completed" and run["error"] is None
    assert [(f["path"], f["sha256"], f["rank"]) for f in run["inputs"]] == [(f.path, f.sha256, f.rank) for f in inputs]
    assert [(f["path"], f["sha256"], f["kind"]) for f in run["outputs"]] == [(output.path, output.sha256,
                                                                              "target_checkpoint")]
    assert [(r["target_rank"], r["source_ranks"]) for r in run["rank_map"]] == [(0, [0, 1])]
    assert (run["source_devices"], run["target_devices"]) == (2, 1)  # from the plan
    assert (run["output_dir"], run["sweep_id"], run["job_num"]) == (spec.output.dir, "sweep-3", 2)
    assert run["config"] == {"target": {"devices": 1}}
    assert run["overrides"][0] == "target.devices=1"
    assert PASSWORD not in run["overrides"][1] and "postgresql://me:" in run["overrides"][1]


def test_a_failed_conversion_is_recorded_with_its_reason_and_no_outputs(tmp_path):
    spec = _spec(tmp_path)
    recorder = LineageRecorder(spec)
    try:
        run_id = recorder.ensure_open()
        recorder.fail(ReshardError(f"cannot read s3://me:{PASSWORD}@bucket/src"))
    finally:
        recorder.close()
    run = _recorded(spec, run_id)
    assert run["status"] == "failed" and run["outputs"] == []
    assert run["error"] == "cannot read s3://***@bucket/src" and PASSWORD not in run["error"]


@pytest.mark.parametrize("error,status,reason", [
    (Interrupted(signal.SIGTERM), "interrupted", "interrupted (SIGTERM)"),
    (KeyboardInterrupt(), "failed", "interrupted"),
])
def test_a_stopped_conversion_says_how(tmp_path, error, status, reason):
    spec = _spec(tmp_path)
    recorder = LineageRecorder(spec)
    try:
        run_id = recorder.ensure_open()
        recorder.fail(error)
    finally:
        recorder.close()
    run = _recorded(spec, run_id)
    assert (run["status"], run["error"], run["outputs"]) == (status, reason, [])


def test_runs_left_started_by_dead_processes_are_marked_abandoned_when_a_job_opens(tmp_path):
    spec = _spec(tmp_path)
    (tmp_path / "runs").mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with LineageStore(spec.lineage.url) as store:
        store.ensure_schema()
        earlier = store.start_run(config={}, overrides=[], tool_version="0", output_dir=str(tmp_path / "old"),
                                  source_devices=None, target_devices=None)
        with store.engine.begin() as connection:
            connection.execute(update(Run).where(Run.id == earlier).values(pid=dead.pid))
    recorder = LineageRecorder(spec)
    try:
        assert recorder.ensure_open() != earlier
    finally:
        recorder.close()
    assert _recorded(spec, earlier)["status"] == "abandoned"


def test_a_database_that_cannot_be_used_is_one_lineage_error_naming_it(tmp_path):
    not_a_database = tmp_path / "runs" / "lineage.db"
    not_a_database.parent.mkdir()
    not_a_database.write_bytes(b"these bytes are not SQLite " * 100)
    spec = _spec(tmp_path, url=f"sqlite:///{not_a_database}")
    recorder = LineageRecorder(spec)
    try:
        with pytest.raises(LineageError) as refused:
            recorder.ensure_open()
        assert recorder.run_id is None
        recorder.fail(ReshardError("the job's own error"))  # logged, never raised over the job's error
    finally:
        recorder.close()
    message = str(refused.value)
    assert message.startswith(f"lineage database sqlite:///{not_a_database}: ") and "\n" not in message
    assert "lineage.enabled=false" in message


def test_a_database_folder_that_cannot_be_made_is_named(tmp_path):
    (tmp_path / "runs").write_text("a file where the database's folder should be")
    spec = _spec(tmp_path)
    recorder = LineageRecorder(spec)
    try:
        with pytest.raises(LineageError, match=f"cannot create {tmp_path / 'runs'}"):
            recorder.ensure_open()
    finally:
        recorder.close()


def test_without_lineage_nothing_is_recorded_and_nothing_fails(tmp_path):
    recorder = NoRecorder()
    recorder.record_plan(_plan)
    recorder.record_inputs([])
    assert recorder.ensure_open() is None and recorder.complete([]) is None and recorder.run_id is None
    recorder.fail(ReshardError("x"))
    recorder.close()
    assert not (tmp_path / "runs").exists()
