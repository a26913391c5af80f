"""Fuzz-test fixtures: seed files, a scratch file per test, the golden-files guard and the count report."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from fuzz_helpers import GOLDEN, TRIED


def _hashes(root: Path) -> dict[str, tuple[str, int]]:
    return {str(p): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="session", autouse=True)
def golden_files_unchanged():
    """The fuzz tests read golden files as seeds; they must never change them."""
    before = _hashes(GOLDEN)
    yield
    assert _hashes(GOLDEN) == before, "tests/golden changed during the fuzz tests"


def pytest_terminal_summary(terminalreporter):
    if TRIED:
        terminalreporter.section("fuzz inputs tried per target")
        for target, n in sorted(TRIED.items()):
            terminalreporter.write_line(f"{target:45s} {n:>10d}")
        terminalreporter.write_line(f"{'total':45s} {sum(TRIED.values()):>10d}")
