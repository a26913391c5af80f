"""An object store that accepts connections and never answers: every operation is bounded in time.

botocore's read timeout (120 s then) times 5 attempts kept a job waiting about ten minutes for an
endpoint that accepted the connection and said nothing. Now each operation has a deadline with its
retries (``storage.options.config_kwargs.operation_timeout``, 60 s by default, plus 1 s per MiB it
moves), and once one went unanswered the store's next operations fail at once. Here the endpoint is a
thread on 127.0.0.1 that accepts and never answers, and the timeouts are a few seconds, set through
``storage.options.config_kwargs`` as a user would: the job ends in one line within the bound, whether
the sources or the outputs are in the silent store. No SeaweedFS is needed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("s3fs", reason="needs s3fs (the s3 extra)")

sys.path.insert(0, str(Path(__file__).parents[2] / "e2e" / "reliability"))
from test_hostile import one_error, run_bounded  # noqa: E402 - the job under the reliability tests' limits

GOLDEN_S1 = Path(__file__).parents[2] / "golden" / "S1_mlp_tutorial_8to4"
OPERATION_S = 3
QUICK = [f"+storage.options.config_kwargs.{k}={v}" for k, v in
         (("connect_timeout", 1), ("read_timeout", 1), ("operation_timeout", OPERATION_S))]


@pytest.fixture
def silent_endpoint(silent_server) -> str:
    """http://127.0.0.1:<port>: accepts every connection, reads nothing, answers nothing."""
    return f"http://127.0.0.1:{silent_server}"

@pytest.fixture
def aws_env(monkeypatch, tmp_path):
    """Credentials that need no network to be found (the store is never reached anyway)."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "reshard-test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "reshard-test-secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("RESHARD_JOB_CACHE_DIR", str(tmp_path / "digest-cache"))


def _args(source: str, out: str, endpoint: str) -> list[str]:
    return [f"source.checkpoints={source}", f"source.strategy={GOLDEN_S1 / 'src_strategy.ckpt'}", "target=strategy",
            f"target.strategy={GOLDEN_S1 / 'dst_strategy.ckpt'}", f"output.dir={out}",
            f"storage.endpoint_url={endpoint}"]


@pytest.mark.parametrize("silent", ["source", "output"])
def test_a_store_that_never_answers_ends_the_job_in_one_line_within_the_bound(tmp_path, aws_env, silent_endpoint,
                                                                             silent):
    source = "s3://models/s1/src_checkpoints" if silent == "source" else str(GOLDEN_S1 / "src_checkpoints")
    out = "s3://models/s1/out" if silent == "output" else str(tmp_path / "out")
    code, stderr, rss, seconds = run_bounded(tmp_path, *_args(source, out, silent_endpoint), *QUICK)
    error = one_error(code, stderr, rss)
    url = source if silent == "source" else out
    assert error.startswith(f"{url}: no answer from the object store at {silent_endpoint} within {OPERATION_S} s "), error
    assert error.endswith("(connecting, retries and back-off included); check the endpoint, or raise "
                          "storage.options.config_kwargs.operation_timeout"), error
    # one operation's deadline (the later ones fail at once), and the job's start
    assert seconds < 2 * OPERATION_S + 8, f"{seconds:.1f} s"


def test_an_operation_timeout_that_is_no_number_of_seconds_is_refused(tmp_path, aws_env, silent_endpoint):
    args = _args("s3://models/s1/src_checkpoints", str(tmp_path / "out"), silent_endpoint)
    code, stderr, rss, seconds = run_bounded(tmp_path, *args, "+storage.options.config_kwargs.operation_timeout=-1")
    assert one_error(code, stderr, rss) == ("storage.options.config_kwargs.operation_timeout must be a positive "
                                            "number of seconds; got -1")


def test_the_deadline_grows_with_the_bytes_an_operation_moves():
    from reshard_job.storage.s3client import SECONDS_PER_BYTE, Watchdog
    from reshard_job.storage.s3errors import StoreTimeout

    dog = Watchdog(2.0)
    assert dog.limit() == 2.0 and dog.limit(64 << 20) == pytest.approx(2.0 + (64 << 20) * SECONDS_PER_BYTE)
    dog.check()  # nothing missed yet
    assert isinstance(dog.missed(2.0), StoreTimeout)
    with pytest.raises(StoreTimeout) as refused:
        dog.check()  # within the deadline of the one that went unanswered: at once
    assert refused.value.earlier
