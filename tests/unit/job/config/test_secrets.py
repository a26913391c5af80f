"""Credentials never reach what the job writes: URLs, config trees and saved text are masked."""

from __future__ import annotations

from reshard_job.secrets import mask_config, mask_text, mask_url


def test_urls_lose_their_passwords_and_secret_query_values():
    assert mask_url("postgresql+psycopg://u:p%40ss@h:5432/db") == "postgresql+psycopg://u:***@h:5432/db"
    assert mask_url("postgresql://h/db?user=u&password=x&sslmode=require") == \
        "postgresql://h/db?user=u&password=***&sslmode=require"
    assert mask_url("sqlite:////tmp/x.db") == "sqlite:////tmp/x.db" and mask_url("s3://b/k") == "s3://b/k"
    assert mask_url("error at http://a:b@h and ftp://c:d@e") == "error at http://a:***@h and ftp://c:***@e"


def test_an_object_store_urls_user_info_and_an_encoded_separator_are_masked():
    """An object store's URL has no user: a bare token before '@' is a credential; a password after
    a percent-encoded ':' is one too. A database user alone is not, nor an '@' in a key."""
    assert mask_url("s3://TOKENsecret@bkt/ckpt") == "s3://***@bkt/ckpt"
    assert mask_url("OBS://ak:sk@bkt/x and gs://tok@b/y") == "OBS://***@bkt/x and gs://***@b/y"
    assert mask_url("s3://user%3Asecret@bkt/ckpt") == "s3://***@bkt/ckpt"
    assert mask_url("postgresql://alice%3Apw@h/db") == "postgresql://alice%3A***@h/db"
    assert mask_url("postgresql://alice@h/db") == "postgresql://alice@h/db"
    assert mask_url("s3://bkt/step@100/x.ckpt") == "s3://bkt/step@100/x.ckpt"


def test_config_trees_mask_secret_keys_wherever_they_are():
    cfg = {"storage": {"options": {"key": "AK", "secret": "SK", "client_kwargs": {"region_name": "r"}}},
           "lineage": {"url": "postgresql://a:b@h/d"}, "target": {"layout": {"rules": [{"match": "key", "dims": []}]}}}
    masked = mask_config(cfg)
    assert masked["storage"]["options"] == {"key": "***", "secret": "***", "client_kwargs": {"region_name": "r"}}
    assert masked["lineage"]["url"] == "postgresql://a:***@h/d"
    assert masked["target"] == cfg["target"]


def test_saved_yaml_and_command_lines_are_masked():
    text = "storage:\n  options:\n    key: AK\n    secret: SK\n    token: null\n- +storage.options.secret=SK2\n" \
           "- lineage.url=postgresql://a:b@h/d\n  match: layer.key\n"
    masked = mask_text(text)
    assert "AK" not in masked and "SK" not in masked and ":b@" not in masked
    assert "token: null" in masked and "match: layer.key" in masked


def test_overrides_joined_on_one_line_are_masked_each():
    """Hydra's override_dirname joins the command line with commas; quotes elsewhere do not hide a key."""
    text = "a: 'x\n    override_dirname: +storage.options.secret=AK1,lineage.url='sqlite:////l.db?password=pw',x.token=T\n"
    masked = mask_text(text)
    assert "AK1" not in masked and "pw'" not in masked and "=T" not in masked and "x.token=***" in masked
