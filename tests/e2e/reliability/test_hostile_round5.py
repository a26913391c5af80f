"""Hostile inputs of a fifth round (combinations of keys that are each valid alone), as a user runs
them: each ends in one line (exit 2) before anything is written, or converts correctly."""

from __future__ import annotations

from pathlib import Path

import pytest

from reliability_helpers import copy_s1, run_app, s1_args, the_error


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:", "sqlite+pysqlite://"])
def test_an_in_memory_lineage_database_is_refused_before_anything_runs(tmp_path, url):
    """It kept nothing and each connection had its own: the conversion ran, its manifest was
    committed, then the job failed with a traceback naming an internal call."""
    ckpts, src, dst = copy_s1(tmp_path / "s1")
    res = run_app(tmp_path, *s1_args(ckpts, src, dst, tmp_path / "out"), f"lineage.url={url}")
    line = the_error(res)
    assert line.startswith(f"lineage.url='{url}': an in-memory SQLite database keeps nothing"), line
    assert res.stderr.count("\n") == 1, res.stderr  # not even a log line before it
    assert not (tmp_path / "out").exists()
