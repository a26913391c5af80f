"""The recording API a job calls: runs, inputs, outputs, plans and the rank map, on both backends."""

from __future__ import annotations

import json
import shutil

import pytest
from sqlalchemy import func, select

from reshard_job.lineage import FileRecord, LineageError, LineageStore, RunStateError, SchemaError, UnknownRunError
from reshard_job.lineage.models import Artifact, ArtifactLocation, Event


def _start(store, tmp_path, **overrides):
    arguments = dict(config={"job": {"mode": "convert"}}, overrides=["job.workers=2"], tool_version="0.1.0",
                     output_dir=str(tmp_path / "out"), source_devices=8, target_devices=4)
    arguments.update(overrides)
    return store.start_run(**arguments)


def test_start_run_records_who_where_and_what(store, tmp_path, get_run):
    run_id = _start(store, tmp_path, sweep_id="sweep-7", job_num=3)
    run = get_run(store, run_id)
    assert run["status"] == "started"
    assert run["config"] == {"job": {"mode": "convert"}}
    assert run["overrides"] == ["job.workers=2"]
    assert (run["sweep_id"], run["job_num"]) == ("sweep-7", 3)
    assert (run["source_devices"], run["target_devices"]) == (8, 4)
    assert run["host"] and run["pid"] > 0 and run["tool_version"] == "0.1.0"
    assert run["started_at"].endswith("+00:00") and run["ended_at"] is None
    assert run["inputs"] == run["outputs"] == run["rank_map"] == [] and run["plan"] is None
    json.dumps(run)  # plain data all the way down


def test_complete_run_stores_outputs_plan_and_rank_map(store, tmp_path, make_file, make_plan, get_run):
    run_id = _start(store, tmp_path)
    source = make_file(tmp_path / "src" / "rank_0.ckpt", b"source", "source_checkpoint", 0)
    store.record_inputs(run_id, [source])
    outputs = [make_file(tmp_path / "out" / f"rank_{r}.ckpt", f"out {r}".encode(), "target_checkpoint", r)
               for r in range(4)] + [make_file(tmp_path / "out" / "manifest.json", b"{}", "manifest")]
    plan = make_plan(8, 4)
    store.complete_run(run_id, outputs=outputs, plan=plan)

    run = get_run(store, run_id)
    assert run["status"] == "completed" and run["ended_at"] >= run["started_at"]
    assert run["plan"] == plan
    assert run["rank_map"] == [{"target_rank": r, "source_ranks": [2 * r, 2 * r + 1], "bytes_read": 200,
                                "bytes_written": 100} for r in range(4)]
    assert [(f["kind"], f["rank"], f["sha256"]) for f in run["inputs"]] == [("source_checkpoint", 0, source.sha256)]
    assert {f["path"] for f in run["outputs"]} == {o.path for o in outputs}
    assert all(f["hash_algo"] == "sha256" for f in run["outputs"])


def test_same_content_is_one_artifact_with_every_path_it_was_seen_at(store, tmp_path, make_file):
    original = make_file(tmp_path / "a" / "checkpoint_0.ckpt", b"same bytes", "target_checkpoint", 0)
    copy = tmp_path / "b" / "copy.ckpt"
    copy.parent.mkdir()
    shutil.copyfile(original.path, copy)
    run_a, run_b = _start(store, tmp_path), _start(store, tmp_path)
    store.complete_run(run_a, outputs=[original], plan={"ranks": []})
    store.record_inputs(run_b, [FileRecord.from_file(str(copy), "source_checkpoint", 0)])

    with store.read_session() as session:
        assert session.scalar(select(func.count()).select_from(Artifact)) == 1
        paths = session.scalars(select(ArtifactLocation.path).order_by(ArtifactLocation.path)).all()
        assert paths == sorted([original.path, str(copy)])
        artifact = session.scalar(select(Artifact))
        assert (artifact.hash_algo, artifact.digest, artifact.size) == ("sha256", original.sha256, original.size)


def test_recording_inputs_twice_does_not_duplicate(store, tmp_path, make_file, get_run):
    run_id = _start(store, tmp_path)
    files = [make_file(tmp_path / f"in_{r}", f"in {r}".encode(), "source_checkpoint", r) for r in range(3)]
    store.record_inputs(run_id, files)
    store.record_inputs(run_id, files)
    assert len(get_run(store, run_id)["inputs"]) == 3
    with store.read_session() as session:
        assert session.scalar(select(func.count()).select_from(Event)) == 3


def test_byte_identical_replicas_keep_their_own_ranks(store, tmp_path, make_file, get_run):
    run_id = _start(store, tmp_path)
    replicas = [make_file(tmp_path / f"rank_{r}.ckpt", b"data-parallel replica", "source_checkpoint", r)
                for r in (0, 4)]
    store.record_inputs(run_id, replicas)
    inputs = get_run(store, run_id)["inputs"]
    assert [(f["rank"], f["sha256"]) for f in inputs] == [(0, replicas[0].sha256), (4, replicas[0].sha256)]


def test_devices_missing_at_start_are_taken_from_the_plan(store, tmp_path, make_plan, get_run):
    run_id = _start(store, tmp_path, source_devices=None, target_devices=None)
    store.complete_run(run_id, outputs=[], plan=make_plan(8, 2))
    run = get_run(store, run_id)
    assert (run["source_devices"], run["target_devices"]) == (8, 2)


def test_given_run_id_is_used_and_cannot_be_reused(store, tmp_path):
    assert _start(store, tmp_path, run_id="my-run") == "my-run"
    with pytest.raises(RunStateError, match="already exists"):
        _start(store, tmp_path, run_id="my-run")


def test_a_completed_run_cannot_change(store, tmp_path, make_file):
    run_id = _start(store, tmp_path)
    store.complete_run(run_id, outputs=[], plan={"ranks": []})
    late = make_file(tmp_path / "late.ckpt", b"late", "target_checkpoint", 0)
    with pytest.raises(RunStateError, match="already completed"):
        store.complete_run(run_id, outputs=[late], plan={"ranks": []})
    with pytest.raises(RunStateError, match="already completed"):
        store.fail_run(run_id, "too late")
    with pytest.raises(RunStateError):
        store.record_inputs(run_id, [late])


def test_unknown_runs(store, tmp_path, get_run):
    assert get_run(store, "no-such-run") is None
    with pytest.raises(UnknownRunError, match="no-such-run"):
        store.record_inputs("no-such-run", [])
    with pytest.raises(UnknownRunError):
        store.fail_run("no-such-run", "boom")


def test_config_is_recorded_as_json_and_the_plan_must_be_plain_json(store, tmp_path, get_run):
    from omegaconf import OmegaConf

    config = OmegaConf.create({"source": {"checkpoints": "/data/src", "copy": "${source.checkpoints}"}})
    run_id = _start(store, tmp_path, config=config)
    assert get_run(store, run_id)["config"] == {"source": {"checkpoints": "/data/src", "copy": "/data/src"}}
    run_id = _start(store, tmp_path, config={"output": tmp_path})
    assert get_run(store, run_id)["config"] == {"output": str(tmp_path)}
    with pytest.raises(LineageError, match="config is not plain JSON"):
        _start(store, tmp_path, config={"ratio": float("inf")})
    with pytest.raises(LineageError, match="plan is not plain JSON"):
        store.complete_run(run_id, outputs=[], plan={"ranks": [], "nan": float("nan")})
    assert get_run(store, run_id)["status"] == "started"


def test_file_records_are_validated(tmp_path):
    with pytest.raises(ValueError, match="unknown artifact kind"):
        FileRecord(path="/x", sha256="0" * 64, size=1, kind="weights")
    with pytest.raises(ValueError, match="64 hex"):
        FileRecord(path="/x", sha256="abc", size=1, kind="manifest")


def test_using_a_store_before_its_schema_exists_says_so(db_url, tmp_path):
    with LineageStore(db_url) as fresh:
        with pytest.raises(SchemaError, match="ensure_schema"):
            _start(fresh, tmp_path)


def test_ensure_schema_twice_is_a_no_op(store, tmp_path, get_run):
    store.ensure_schema()
    run_id = _start(store, tmp_path)
    store.ensure_schema()
    assert get_run(store, run_id)["status"] == "started"
