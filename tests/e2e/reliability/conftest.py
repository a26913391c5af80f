"""Fixtures of the reliability tests (helpers live in reliability_helpers.py)."""

from __future__ import annotations

import pytest

from reliability_helpers import GOLDEN, BigSource, make_big_source, snapshot


@pytest.fixture(scope="session")
def big_source(tmp_path_factory) -> BigSource:
    """128 MiB of source (two ranks), four 32 MiB target files: a conversion that takes seconds.
    Every test that converts it (killed, refused, out of space) must leave it unchanged."""
    source = make_big_source(tmp_path_factory.mktemp("big_source"))
    before = snapshot(source.root)
    yield source
    assert snapshot(source.root) == before, "the big source changed"


# ``app`` (the job as a fresh process, forked from a pre-imported one) comes from tests/e2e/conftest.py.


# ================================================================================== guards


@pytest.fixture(scope="session", autouse=True)
def golden_files_unchanged():
    """Whatever the tests do, the golden scenarios (read by many of them) stay byte- and mtime-identical."""
    before = snapshot(GOLDEN)
    yield
    after = snapshot(GOLDEN)
    changed = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
    assert not changed, f"tests/golden changed during the reliability tests: {changed[:5]}"
