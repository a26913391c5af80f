"""Fixtures of the end-to-end tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def app(job_launcher):
    """``app(cwd, *args, timeout=300, env=None)``: run ``python -m reshard_job`` as a fresh process (forked from
    a pre-imported one, see job_launcher) with this process's environment at the time of the call."""
    return lambda cwd, *args, timeout=300, env=None: job_launcher.run(cwd, list(args), timeout, env)
