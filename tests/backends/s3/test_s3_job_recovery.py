"""Interrupted, concurrent and disturbed jobs writing to or reading from a bucket.

A job killed with SIGKILL in the middle of a multipart upload leaves no object that looks complete;
the rerun aborts what was left unfinished, keeps the journaled objects, and ends byte-identical to
an uninterrupted run. A second job on the same output prefix is refused while the first holds its
lock. A source object replaced while the job runs fails the job in one line, with nothing recorded.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import time
from pathlib import Path

import pytest

from s3_job_helpers import BigSource, Bucket, Runner, completed, make_big_source, the_error

POLL_S = 0.02


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> BigSource:
    return make_big_source(tmp_path_factory.mktemp("big"))


@pytest.fixture(scope="module")
def reference(big, tmp_path_factory) -> dict[str, bytes]:
    """What an uninterrupted local run writes, by path relative to the output directory."""
    cwd = tmp_path_factory.mktemp("reference")
    out = Path(completed(Runner(cwd).job(*big.args(str(cwd / "out")), "job.workers=1")))
    return {str(p.relative_to(out)): p.read_bytes() for p in out.glob("rank_*/*.ckpt")}


@pytest.fixture(scope="module")
def big_in_bucket(big, s3_store, s3_shared_bucket) -> tuple[Bucket, str]:
    bucket = Bucket(s3_store, s3_shared_bucket, f"big-{os.getpid()}-{time.monotonic_ns()}")
    return bucket, bucket.put_tree(big.root, bucket.url("src"))


@pytest.fixture
def runner(tmp_path, s3_server, job_launcher) -> Runner:
    key, secret = s3_server.credentials["admin"]
    return Runner(tmp_path, {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret,
                             "AWS_ENDPOINT_URL": s3_server.endpoint, "AWS_DEFAULT_REGION": "us-east-1"},
                  job_launcher)


def wait_for(condition, process, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"the job ended (exit {process.returncode}) before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(POLL_S)


def journaled_ranks(bucket: Bucket, out: str) -> list[int]:
    text = (bucket.get(f"{out}/.reshard_job/journal.jsonl") or b"").decode()
    return sorted(json.loads(line)["rank"] for line in text.splitlines()[1:] if line.strip())


def test_kill_9_mid_upload_then_rerun_is_byte_identical(big, big_in_bucket, reference, runner, tmp_path):
    bucket, src = big_in_bucket
    out = bucket.url(f"out-{tmp_path.name}")
    job = runner.start_job(*big.args(out, base=src), "job.workers=1", log=tmp_path / "killed.log")
    try:
        # one rank journaled, the next one's multipart upload under way
        wait_for(lambda: journaled_ranks(bucket, out) and bucket.uploads(out), job, "a rank to land and an upload")
        os.killpg(job.pid, signal.SIGKILL)
    finally:
        job.wait(timeout=60)
    assert bucket.uploads(out), "the kill should have left an unfinished upload behind"
    assert "manifest.json" not in bucket.keys(out)
    kept = journaled_ranks(bucket, out)
    for rel in bucket.keys(out):  # every object present is complete: it is one of the reference files
        if rel.startswith("rank_"):
            assert bucket.get(f"{out}/{rel}") == reference[rel], rel

    res = runner.job(*big.args(out, base=src))
    assert completed(res) == out
    assert f"resuming: keeping {len(kept)} target file(s) that verify: ranks {kept}" in res.stderr
    assert "removed 1 temporary file(s) left by an interrupted run" in res.stderr
    assert bucket.uploads(out) == []
    assert {rel: bucket.get(f"{out}/{rel}") for rel in reference} == reference
    with sqlite3.connect(tmp_path / "runs" / "lineage.db") as con:
        assert sorted(r[0] for r in con.execute("select status from runs")) == ["abandoned", "completed"]


@pytest.mark.slow  # a conversion of the large source; the lock object itself is covered by the storage tests
def test_a_second_job_on_the_same_output_prefix_is_refused(big, big_in_bucket, reference, runner, tmp_path):
    bucket, src = big_in_bucket
    out = bucket.url(f"out-{tmp_path.name}")
    first = runner.start_job(*big.args(out, base=src), "job.workers=1", log=tmp_path / "first.log")
    try:
        wait_for(lambda: ".reshard_job/lock" in bucket.keys(out), first, "the first job's lock")
        os.killpg(first.pid, signal.SIGSTOP)  # a stalled holder: well within its lease, still holding
        try:
            second = runner.job(*big.args(out, base=src))
        finally:
            os.killpg(first.pid, signal.SIGCONT)
        error = the_error(second)
        assert error.startswith(f"output.dir {out} is being written by another job (pid {first.pid} on ")
        assert error.endswith("wait for it to finish or choose another output.dir")
    finally:
        first.wait(timeout=240)
    assert first.returncode == 0, (tmp_path / "first.log").read_text()
    assert {rel: bucket.get(f"{out}/{rel}") for rel in reference} == reference
    assert ".reshard_job/lock" not in bucket.keys(out)


def test_a_source_object_replaced_during_the_run_fails_it_in_one_line(big, s3_store, s3_shared_bucket, runner,
                                                                     tmp_path):
    bucket = Bucket(s3_store, s3_shared_bucket, f"changing-{tmp_path.name}")
    src = bucket.put_tree(big.root, bucket.url("src"))
    out = bucket.url("out")
    job = runner.start_job(*big.args(out, base=src), "job.workers=1", log=tmp_path / "job.log")
    victim = f"{src}/ckpts/rank_1/checkpoint_1.ckpt"
    try:
        wait_for(lambda: ".reshard_job/lock" in bucket.keys(out), job, "the job's lock")
        os.killpg(job.pid, signal.SIGSTOP)  # sources indexed, conversion not finished
        try:
            original = bucket.get(victim)
            bucket.put(victim, original[:-4] + bytes(4))  # the same size, other bytes
        finally:
            os.killpg(job.pid, signal.SIGCONT)
    finally:
        job.wait(timeout=240)
    log = (tmp_path / "job.log").read_text()
    lines = [ln for ln in log.splitlines() if ln.startswith("reshard_job: error: ")]
    assert job.returncode == 2 and len(lines) == 1 and "Traceback" not in log, log
    assert lines[0].startswith(f"reshard_job: error: {victim}: ") and "changed" in lines[0]
    keys = bucket.keys(out)
    assert "manifest.json" not in keys and bucket.uploads(out) == []
    with sqlite3.connect(tmp_path / "runs" / "lineage.db") as con:
        assert [r[0] for r in con.execute("select status from runs")] == ["failed"]
        assert list(con.execute("select * from events where direction = 'output'")) == []
