"""The shared S3 client, without a server: one store per scheme and options, a cache key that keeps
no credential readable, and botocore settings completed (never replaced) with ours."""

from __future__ import annotations

import pytest

from reshard_job.storage import StorageOptions
from reshard_job.storage.s3client import DEFAULT_RETRIES, _retries, options_key, shared_store


def test_the_cache_key_tells_options_apart_without_keeping_the_secret():
    secret = "wJalrXUtnFEMI-K7MDENG"
    key = options_key("s3", StorageOptions(endpoint_url="http://minio:9000", options={"secret": secret}))
    assert secret not in repr(key)
    assert key == options_key("s3", StorageOptions(endpoint_url="http://minio:9000", options={"secret": secret}))
    assert key != options_key("s3", StorageOptions(endpoint_url="http://minio:9000", options={"secret": "other"}))
    assert key != options_key("s3a", StorageOptions(endpoint_url="http://minio:9000", options={"secret": secret}))


def test_a_store_is_built_once_per_key():
    built = []

    def build():
        built.append(object())
        return built[-1]

    key = ("s3", "test_a_store_is_built_once_per_key")
    assert shared_store(key, build) is shared_store(key, build) is built[0]
    assert len(built) == 1


def test_retry_settings_complete_the_users_own():
    assert _retries(None) == DEFAULT_RETRIES
    assert _retries({"mode": "adaptive"}) == {"total_max_attempts": 5, "mode": "adaptive"}
    # botocore's max_attempts counts retries after the first: it replaces our total, not adds to it
    assert _retries({"max_attempts": 2}) == {"max_attempts": 2, "mode": "standard"}


def test_the_client_gets_our_timeouts_and_checksum_settings():
    pytest.importorskip("s3fs", reason="needs s3fs (the s3 extra)")
    from reshard_job.storage.s3client import make_s3fs

    fs = make_s3fs("s3", "http://127.0.0.1:9", {"config_kwargs": {"read_timeout": 7}})
    config = fs.config_kwargs
    assert config["read_timeout"] == 7 and config["connect_timeout"] == 10
    assert config["retries"] == DEFAULT_RETRIES
    assert config["request_checksum_calculation"] == "when_required"
