"""``audit db current`` / ``audit db upgrade``: a database left at an older schema revision is brought
to the head from the command line, without a job and without ``alembic.ini``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from alembic import command
from alembic.runtime.migration import MigrationContext

from reshard_job.lineage import create_lineage_engine
from reshard_job.lineage.database import writer
from reshard_job.lineage.migrate import alembic_config, head_revision


def _audit(cwd, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "reshard_job.audit", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env=os.environ.copy())


def _database_at(path, revision: str) -> str:
    url = f"sqlite:///{path}"
    engine = create_lineage_engine(url)
    try:
        with writer(engine).connect() as connection:
            command.upgrade(alembic_config(connection), revision)
            connection.commit()
    finally:
        engine.dispose()
    return url


def _revision(url: str) -> str | None:
    engine = create_lineage_engine(url)
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()


def test_db_upgrade_brings_an_older_database_to_the_head_in_one_line(tmp_path):
    head = head_revision()
    assert head != "0002"
    url = _database_at(tmp_path / "lineage.db", "0002")
    cwd = tmp_path / "elsewhere"  # no alembic.ini anywhere near
    cwd.mkdir()

    res = _audit(cwd, "db", "current", "--db", url)
    assert res.returncode == 0, res.stderr
    assert res.stdout == f"{url}: schema revision 0002, head {head} ('db upgrade' brings it there, as any job would)\n"
    refused = _audit(cwd, "runs", "--db", url)  # the readers still refuse it, naming the command
    assert refused.returncode == 2 and "audit db upgrade --db URL" in refused.stderr

    res = _audit(cwd, "db", "upgrade", "--db", url)
    assert res.returncode == 0, res.stderr
    assert res.stdout == f"{url}: schema revision 0002 -> {head} (head)\n" and res.stderr == ""
    assert _revision(url) == head
    assert _audit(cwd, "runs", "--db", url).returncode == 0

    again = _audit(cwd, "--db", url, "db", "upgrade", "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["before"] == json.loads(again.stdout)["after"] == head
    assert _audit(cwd, "db", "current", "--db", url).stdout == f"{url}: schema revision {head} (head)\n"


def test_db_upgrade_creates_no_database_where_there_is_none(tmp_path):
    res = _audit(tmp_path, "db", "upgrade", "--db", str(tmp_path / "missing.db"))
    assert res.returncode == 2 and res.stderr.startswith("error: no lineage database at ")
    assert len(res.stderr.splitlines()) == 1 and "Traceback" not in res.stderr
    assert not (tmp_path / "missing.db").exists()
