"""What a user sees when the object store is not usable: one line naming the URL, exit status 2,
nothing written that looks valid, the lineage run failed with that line.

Missing bucket, no permission, bad credentials, an unreachable endpoint, and throttling (through a
proxy in front of the real server that answers ``503 SlowDown``: retried with back-off, then one
line when it does not stop). The back end's own tests (``tests/storage``) produce the messages of
a missing bucket, bad credentials and an unreachable endpoint too, so here those three are
``slow``; how any store error ends a job (one line, exit 2, nothing written, a failed run) is
checked by default through the others.
"""

from __future__ import annotations

import socket
import sqlite3

import pytest

from s3_job_helpers import GOLDEN, Bucket, Runner, ThrottlingProxy, completed, the_error

S1 = GOLDEN / "S1_mlp_tutorial_8to4"
FEW_RETRIES = "+storage.options.config_kwargs.retries.total_max_attempts=3"


@pytest.fixture(scope="module")
def golden(s3_store, s3_shared_bucket) -> tuple[Bucket, str]:
    bucket = Bucket(s3_store, s3_shared_bucket, "errors")
    return bucket, bucket.put_tree(S1, bucket.url("s1"))


def args(src: str, out: str) -> list[str]:
    return [f"source.checkpoints={src}/src_checkpoints", f"source.strategy={src}/src_strategy.ckpt", "target=strategy",
            f"target.strategy={src}/dst_strategy.ckpt", f"output.dir={out}"]


def runner_as(tmp_path, s3_server, identity: str = "admin", *, secret: str | None = None,
              endpoint: str | None = None) -> Runner:
    key, right = s3_server.credentials[identity]
    return Runner(tmp_path, {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret or right,
                             "AWS_ENDPOINT_URL": endpoint or s3_server.endpoint, "AWS_DEFAULT_REGION": "us-east-1"})


def failed_run(tmp_path, error: str) -> None:
    """The lineage database holds one failed run carrying `error`, with no outputs."""
    with sqlite3.connect(tmp_path / "runs" / "lineage.db") as con:
        assert list(con.execute("select status, error from runs")) == [("failed", error)]
        assert list(con.execute("select * from events where direction = 'output'")) == []


@pytest.mark.slow
def test_missing_bucket(golden, s3_server, tmp_path):
    bucket, src = golden
    res = runner_as(tmp_path, s3_server).job(*args("s3://no-such-bucket-4471/s1", bucket.url("out-missing")))
    error = the_error(res)
    assert error == f"s3://no-such-bucket-4471/s1/src_checkpoints: bucket 'no-such-bucket-4471' does not exist " \
                    f"at {s3_server.endpoint}"
    out = runner_as(tmp_path, s3_server).job(*args(src, "s3://no-such-bucket-4472/out"))
    assert the_error(out) == f"s3://no-such-bucket-4472/out: bucket 'no-such-bucket-4472' does not exist at " \
                             f"{s3_server.endpoint}"
    assert bucket.keys(bucket.url("out-missing")) == []


def test_no_permission_to_write_the_output_prefix(golden, s3_server, tmp_path):
    bucket, src = golden
    out = bucket.url("out-denied")
    res = runner_as(tmp_path, s3_server, "reader").job(*args(src, out))  # may read the sources, not write
    error = the_error(res)
    assert error.startswith(f"{out}: access denied while ") and "lack permission for this bucket or prefix" in error
    assert bucket.keys(out) == [] and bucket.uploads(out) == []
    failed_run(tmp_path, f"reshard_job: error: {error}"[len("reshard_job: error: "):])


@pytest.mark.slow
def test_bad_credentials(golden, s3_server, tmp_path):
    bucket, src = golden
    res = runner_as(tmp_path, s3_server, secret="not-the-secret-at-all").job(*args(src, bucket.url("out-badkey")))
    error = the_error(res)
    assert error.startswith(f"{src}/src_checkpoints: the object store rejected the credentials (SignatureDoesNotMatch)")
    assert "not-the-secret-at-all" not in res.stderr + res.stdout
    assert bucket.keys(bucket.url("out-badkey")) == []


@pytest.mark.slow
def test_unreachable_endpoint(golden, s3_server, tmp_path):
    bucket, src = golden
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    res = runner_as(tmp_path, s3_server, endpoint=endpoint).job(*args(src, bucket.url("out-unreachable")), FEW_RETRIES)
    assert the_error(res) == f"{src}/src_checkpoints: cannot reach the object store at {endpoint} while looking at " \
                             f"it (connection refused, after retries)"


def test_throttling_is_retried_with_back_off(golden, s3_server, tmp_path):
    bucket, src = golden
    budget = {"left": 3}

    def first_three_reads_of_rank_2(method: str, path: str) -> bool:
        if method == "GET" and path.split("?")[0].endswith("/rank_2/checkpoint_2.ckpt") and budget["left"] > 0:
            budget["left"] -= 1
            return True
        return False

    out = bucket.url("out-throttled-once")
    with ThrottlingProxy(s3_server.endpoint, first_three_reads_of_rank_2) as proxy:
        res = runner_as(tmp_path, s3_server, endpoint=proxy.endpoint).job(*args(src, out))
        assert completed(res) == out
    assert proxy.throttled == 3
    assert bucket.get(f"{out}/rank_0/checkpoint_0.ckpt") == \
        (S1 / "expected" / "rank_0" / "checkpoint_0.ckpt").read_bytes()


def test_throttling_that_does_not_stop_fails_in_one_line(golden, s3_server, tmp_path):
    bucket, src = golden

    def every_read_of_rank_2(method: str, path: str) -> bool:
        return method == "GET" and path.split("?")[0].endswith("/rank_2/checkpoint_2.ckpt")

    out = bucket.url("out-throttled")
    with ThrottlingProxy(s3_server.endpoint, every_read_of_rank_2) as proxy:
        res = runner_as(tmp_path, s3_server, endpoint=proxy.endpoint).job(*args(src, out), FEW_RETRIES)
    error = the_error(res)
    assert error.startswith(f"{src}/src_checkpoints/rank_2/checkpoint_2.ckpt: the object store kept throttling "
                            "requests (SlowDown) while reading it, 3 attempt(s) with back-off")
    assert proxy.throttled == 3
    keys = bucket.keys(out)
    assert "manifest.json" not in keys and not [k for k in keys if k.startswith("rank_")]
    assert bucket.uploads(out) == []
    failed_run(tmp_path, error)


S2 = GOLDEN / "S2_block_mp4dp2opt_to_mp4"


def flipped(data: bytes, offset: int) -> bytes:
    return data[:offset] + bytes([data[offset] ^ 0x40]) + data[offset + 1:]


@pytest.mark.slow  # the same integrity pass refuses corrupt bytes on disk (tests/e2e/reliability/test_integrity.py::test_safetensors_crc_num_is_checked)
def test_corrupt_source_bytes_in_the_bucket_are_refused_in_one_line(s3_store, s3_shared_bucket, s3_server, tmp_path):
    """Sources in a bucket are hashed in the read that indexes them; the checks that read makes
    (a `.ckpt` CRC trailer, replicas that must hold the same bytes) still refuse bad bytes."""
    import numpy as np

    from reshard_job.formats.ckpt import CheckpointReader, CheckpointWriter
    from reshard_job.job.stages.prepare import prepare
    from reshard_job.job.config.spec import SourceSpec, TargetSpec

    bucket = Bucket(s3_store, s3_shared_bucket, "corrupt")
    runner = runner_as(tmp_path, s3_server)

    # a CRC trailer that no longer matches: the file is named
    src = bucket.put_tree(S1, bucket.url("crc"))
    with CheckpointReader(S1 / "src_checkpoints" / "rank_1" / "checkpoint_1.ckpt") as r, \
            CheckpointWriter(tmp_path / "with_crc.ckpt", crc=True) as w:
        for name in r.names():
            w.add(name, np.asarray(r.read(name)), r.entries[name].dtype)
        weight = r.entries[next(n for n in r.names() if r.entries[n].nbytes > 64)].pieces[0][0]
    rank_1 = f"{src}/src_checkpoints/rank_1/checkpoint_1.ckpt"
    good = (tmp_path / "with_crc.ckpt").read_bytes()
    with CheckpointReader(tmp_path / "with_crc.ckpt") as r:
        assert r.has_crc
    bucket.put(rank_1, flipped(good, weight + 3))
    error = the_error(runner.job(*args(src, bucket.url("crc-out"))))
    assert error.startswith(f"{rank_1}: CRC32 mismatch"), error
    assert bucket.keys(bucket.url("crc-out")) == []
    bucket.put(rank_1, good)  # the same file unharmed: converts
    completed(runner.job(*args(src, bucket.url("crc-out"))))

    # replicas that differ: the parameter and the ranks are named
    with prepare(SourceSpec(str(S2 / "src_checkpoints"), str(S2 / "src_strategy.ckpt")),
                 TargetSpec(strategy=str(S2 / "dst_strategy.ckpt"))) as prepared:
        name, groups = next(iter(prepared.plan.identical.items()))
        rank = sorted(groups[0])[-1]
        piece = prepared.readers.reader(rank).entries[name].pieces[0]
    src = bucket.put_tree(S2, bucket.url("replicas"))
    path = S2 / "src_checkpoints" / f"rank_{rank}" / f"checkpoint_{rank}.ckpt"
    bucket.put(f"{src}/src_checkpoints/rank_{rank}/checkpoint_{rank}.ckpt",
               flipped(path.read_bytes(), piece[0] + piece[1] - 1))
    error = the_error(runner.job(*args(src, bucket.url("replicas-out"))))
    assert error.startswith(f"parameter '{name}' differs between source ranks"), error
    assert bucket.keys(bucket.url("replicas-out")) == []
