"""The mapping from store failures to one-line messages, for answers the test server cannot be made
to give on demand (throttling after retries, expired tokens, unknown codes); SeaweedFS's circuit
breaker can throttle, but applied its setting only after a delay of tens of seconds, if at all. The error objects are
botocore's own, built from the response shape botocore parses off the wire; the live cases
(bad credentials, missing bucket, refused connection, denied writes) are in test_s3_backend.py."""

from __future__ import annotations

import pytest

botocore_exceptions = pytest.importorskip("botocore.exceptions", reason="needs botocore (the s3 extra)")

from reshard_job.storage import SourceChangedError, StorageError  # noqa: E402
from reshard_job.storage.s3errors import shorten, storage_error, strip_userinfo  # noqa: E402

URL = "s3://bucket/run7/ckpt/rank_0/checkpoint_0.ckpt"


def client_error(code: str, message: str = "", status: int = 400, attempts: int = 0):
    response = {"Error": {"Code": code, "Message": message},
                "ResponseMetadata": {"HTTPStatusCode": status, "RetryAttempts": attempts}}
    return botocore_exceptions.ClientError(response, "GetObject")


@pytest.mark.parametrize("code, status, expected", [
    ("SlowDown", 503, "kept throttling requests (SlowDown) while reading it, 5 attempt(s) with back-off"),
    ("ServiceUnavailable", 503, "kept throttling"),
    ("ErrTooManyRequest", 503, "kept throttling requests (ErrTooManyRequest)"),  # SeaweedFS's circuit breaker
    ("TooManyRequests", 429, "kept throttling"),
    ("ExpiredToken", 400, "rejected the credentials (ExpiredToken)"),
    ("InvalidAccessKeyId", 403, "rejected the credentials (InvalidAccessKeyId)"),
    ("AccessDenied", 403, "access denied while reading it"),
    ("NoSuchBucket", 404, "bucket 'bucket' does not exist at http://127.0.0.1:9"),
    ("InternalError", 500, "reading it failed (HTTP 500, InternalError: boom)"),
])
def test_codes_become_one_line(code, status, expected):
    err = storage_error(client_error(code, "boom", status, attempts=4), URL, "reading it",
                        endpoint="http://127.0.0.1:9", bucket="bucket")
    assert isinstance(err, StorageError)
    text = str(err)
    assert text.startswith(URL + ": ") and expected in text and "\n" not in text


def test_absent_and_changed_are_not_storage_errors():
    assert isinstance(storage_error(client_error("NoSuchKey", status=404), URL, "reading it"), FileNotFoundError)
    assert isinstance(storage_error(client_error("404", status=404), URL, "reading it"), FileNotFoundError)
    assert isinstance(storage_error(client_error("PreconditionFailed", status=412), URL, "reading it"),
                      SourceChangedError)


def test_missing_credentials():
    err = storage_error(botocore_exceptions.NoCredentialsError(), URL, "listing it")
    assert "no usable credentials" in str(err) and "storage.options" in str(err)


def test_long_messages_and_urls_are_bounded():
    long_url = "s3://bucket/" + "very-long-folder-name/" * 30 + "checkpoint_0.ckpt"
    err = storage_error(client_error("InternalError", "x" * 5000, 500), long_url, "reading it")
    assert len(str(err)) < 300 and "…" in str(err) and "/checkpoint_0.ckpt: " in str(err)


def test_credentials_in_urls_are_never_shown():
    assert strip_userinfo("s3://AKID:secret@bucket/x") == "s3://bucket/x"
    assert strip_userinfo("http://user:pw@host:9000") == "http://host:9000"
    err = storage_error(client_error("AccessDenied", status=403), "s3://AKID:secret@bucket/x", "reading it",
                        endpoint="http://user:pw@host:9000")
    assert "secret" not in str(err) and "pw" not in str(err)
    assert shorten("abc", 10) == "abc" and len(shorten("a" * 500, 50)) == 50
