"""Engine settings and URL handling (backend-specific details the store relies on)."""

from __future__ import annotations

import pytest
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from reshard_job.lineage import LineageStore, default_url
from reshard_job.lineage.database import create_lineage_engine, is_transient, normalize_url, retry_transient


def test_default_url_is_runs_lineage_db_under_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("RESHARD_LINEAGE_URL", raising=False)
    monkeypatch.chdir(tmp_path)
    assert default_url() == f"sqlite:///{tmp_path / 'runs' / 'lineage.db'}"
    monkeypatch.setenv("RESHARD_LINEAGE_URL", "postgresql+psycopg://somewhere/lineage")
    assert default_url() == "postgresql+psycopg://somewhere/lineage"


def test_store_without_url_creates_runs_lineage_db(tmp_path, monkeypatch):
    monkeypatch.delenv("RESHARD_LINEAGE_URL", raising=False)
    monkeypatch.chdir(tmp_path)
    with LineageStore() as store:
        store.ensure_schema()
    assert (tmp_path / "runs" / "lineage.db").is_file()


def test_relative_sqlite_paths_are_pinned_to_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert normalize_url("sqlite:///a/b.db").database == str(tmp_path / "a" / "b.db")
    assert normalize_url("sqlite://").database is None
    assert normalize_url("postgresql://u@h/db").drivername == "postgresql+psycopg"


def test_sqlite_connections_enforce_foreign_keys_and_use_wal(tmp_path):
    engine = create_lineage_engine(f"sqlite:///{tmp_path / 'x.db'}")
    try:
        with engine.connect() as connection:
            assert connection.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
            assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert connection.exec_driver_sql("PRAGMA busy_timeout").scalar() >= 1000
    finally:
        engine.dispose()


def test_foreign_keys_are_enforced(store):
    from reshard_job.lineage.models import RunRank

    with pytest.raises(Exception, match="(?i)foreign key"):
        with store._writer.begin() as session:
            session.add(RunRank(run_id="no-such-run", target_rank=0, source_ranks=[0]))


def test_contention_is_retried_with_backoff():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise OperationalError("INSERT ...", {}, Exception("database is locked"))
        return "done"

    assert retry_transient(flaky, base_delay=0.001) == "done" and len(calls) == 3


def test_other_errors_are_not_retried():
    calls = []

    def broken():
        calls.append(1)
        raise OperationalError("SELECT ...", {}, Exception("no such table: runs"))

    with pytest.raises(OperationalError):
        retry_transient(broken, base_delay=0.001)
    assert len(calls) == 1


def test_postgres_deadlocks_count_as_transient():
    class Deadlock(Exception):
        sqlstate = "40P01"

    assert is_transient(OperationalError("UPDATE ...", {}, Deadlock("deadlock detected")))


def test_store_works_on_the_real_postgres_server(postgres_url):
    with LineageStore(postgres_url) as store:
        store.ensure_schema()
        with store.engine.connect() as connection:
            assert connection.execute(text("SELECT 1")).scalar() == 1
        assert store.engine.dialect.name == "postgresql" and store.engine.dialect.driver == "psycopg"


def test_in_memory_sqlite_urls_are_known_and_refused_by_the_engine():
    from reshard_job.lineage.database import create_lineage_engine
    from reshard_job.lineage.errors import LineageError
    from reshard_job.lineage.urls import in_memory_sqlite

    for url in ("sqlite://", "sqlite:///:memory:", "sqlite+pysqlite://", "sqlite:///file::memory:?cache=shared",
                "sqlite:///file:x?mode=memory&cache=shared"):
        assert in_memory_sqlite(url), url
        with pytest.raises(LineageError, match="an in-memory SQLite database keeps nothing"):
            create_lineage_engine(url)
    for url in ("sqlite:///x.db", "sqlite:////tmp/memory.db", "sqlite:///file:x.db?mode=ro", "postgresql://h/db",
                "postgresql+psycopg://u@h/:memory:"):
        assert not in_memory_sqlite(url), url


def test_a_sqlite_url_naming_something_other_than_a_file_is_refused_before_anything_is_made(tmp_path):
    """/dev/null gave "disk I/O error" and left /dev/null.migrate.lock; a folder or a FIFO is no better."""
    import os

    from reshard_job.lineage.errors import LineageError

    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "folder").mkdir()
    for path, what in (("/dev/null", "a device"), (str(tmp_path / "fifo"), r"a FIFO \(named pipe\)"),
                       (str(tmp_path / "folder"), "a directory")):
        with pytest.raises(LineageError, match=f"{path} is {what}, not a database file"):
            create_lineage_engine(f"sqlite:///{path}")
        assert not os.path.exists(path + ".migrate.lock")
    create_lineage_engine(f"sqlite:///{tmp_path / 'new.db'}").dispose()  # nothing there yet: made as usual
