"""Schema changes go through Alembic; the migration head must match the models exactly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from reshard_job.lineage import SchemaError, create_lineage_engine
from reshard_job.lineage.database import writer
from reshard_job.lineage.migrate import alembic_config, check_at_head, head_revision, migrations_dir
from reshard_job.lineage.models import Base

LINEAGE_TABLES = {"runs", "run_plans", "run_ranks", "artifacts", "artifact_locations", "events", "run_fingerprints",
                  "load_fingerprints"}
PROJECT_ROOT = Path(__file__).resolve().parents[3]


def test_migrations_are_found_inside_the_package():
    assert migrations_dir() == PROJECT_ROOT / "reshard_job" / "lineage" / "migrations"
    assert head_revision() is not None


def test_upgrade_from_empty_then_downgrade_to_base(db_url):
    engine = create_lineage_engine(db_url)
    if db_url.startswith("sqlite"):
        Path(engine.url.database).parent.mkdir(parents=True, exist_ok=True)
    try:
        with writer(engine).connect() as connection:
            command.upgrade(alembic_config(connection), "head")
            connection.commit()
            assert LINEAGE_TABLES <= set(inspect(connection).get_table_names())
            check_at_head(connection)
            connection.rollback()

            command.downgrade(alembic_config(connection), "base")
            connection.commit()
            assert not LINEAGE_TABLES & set(inspect(connection).get_table_names())
            assert MigrationContext.configure(connection).get_current_revision() is None
    finally:
        engine.dispose()


def test_models_and_migration_head_agree(store):
    with store.engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        differences = compare_metadata(context, Base.metadata)
    assert differences == []


def test_alembic_command_line_from_the_project_root(tmp_path):
    url = f"sqlite:///{tmp_path / 'cli' / 'lineage.db'}"
    environment = {k: v for k, v in os.environ.items() if k != "RESHARD_LINEAGE_URL"}
    alembic = [sys.executable, "-m", "alembic", "-x", f"url={url}"]
    for arguments in (["upgrade", "head"], ["check"]):
        result = subprocess.run(alembic + arguments, cwd=PROJECT_ROOT, capture_output=True, text=True,
                                env=environment, timeout=120)
        assert result.returncode == 0, result.stderr
    assert (tmp_path / "cli" / "lineage.db").exists()


def test_a_schema_newer_than_the_tool_is_refused_in_one_line(store):
    with store.engine.begin() as connection:
        connection.execute(text("UPDATE alembic_version SET version_num = '9999_from_the_future'"))
    with pytest.raises(SchemaError, match="newer than this tool knows") as refused:
        store.ensure_schema()
    assert "\n" not in str(refused.value)
    with store.engine.connect() as connection, pytest.raises(SchemaError, match="newer than this tool"):
        check_at_head(connection)


def test_quick_head_revision_agrees_with_alembic():
    from reshard_job.lineage.migrate import quick_head_revision

    assert quick_head_revision() == head_revision() is not None


def test_the_status_constraint_admits_interrupted_and_downgrading_makes_such_runs_failed(store, tmp_path):
    from sqlalchemy.exc import IntegrityError

    interrupted = store.start_run(config={}, overrides=[], tool_version="0.1.0", output_dir=str(tmp_path),
                                  source_devices=8, target_devices=4)
    store.interrupt_run(interrupted, "SIGTERM")
    with pytest.raises(IntegrityError), store.engine.begin() as connection:
        connection.execute(text("UPDATE runs SET status = 'paused'"))  # the constraint still guards

    with writer(store.engine).connect() as connection:
        command.downgrade(alembic_config(connection), "0001")
        connection.commit()
        row = connection.execute(text("SELECT status, error FROM runs")).one()
        assert tuple(row) == ("failed", "SIGTERM")
        with pytest.raises(IntegrityError):
            connection.execute(text("UPDATE runs SET status = 'interrupted'"))
        connection.rollback()
    store.ensure_schema()  # back to head: interrupted is allowed again
    store.interrupt_run(store.start_run(config={}, overrides=[], tool_version="0.1.0", output_dir=str(tmp_path),
                                        source_devices=8, target_devices=4), "SIGINT")


def test_alembic_command_line_from_any_directory_with_the_absolute_ini_path(tmp_path):
    url = f"sqlite:///{tmp_path / 'elsewhere' / 'lineage.db'}"
    environment = {k: v for k, v in os.environ.items() if k not in ("RESHARD_LINEAGE_URL", "PYTHONPATH")}
    (tmp_path / "cwd").mkdir()
    result = subprocess.run([sys.executable, "-m", "alembic", "-c", str(PROJECT_ROOT / "alembic.ini"),
                             "-x", f"url={url}", "upgrade", "head"], cwd=tmp_path / "cwd", capture_output=True,
                            text=True, env=environment, timeout=120)
    assert result.returncode == 0, result.stderr
    engine = create_lineage_engine(url)
    try:
        with engine.connect() as connection:
            check_at_head(connection)
            assert LINEAGE_TABLES <= set(inspect(connection).get_table_names())
    finally:
        engine.dispose()
    assert list((tmp_path / "cwd").iterdir()) == []  # nothing written where it was launched

    # The printed (--sql) script of the SQLite table rebuild switches foreign keys off around it,
    # outside any transaction, as the online upgrade does.
    script = subprocess.run([sys.executable, "-m", "alembic", "-c", str(PROJECT_ROOT / "alembic.ini"),
                             "-x", f"url={url}", "upgrade", "0001:0002", "--sql"], cwd=tmp_path / "cwd",
                            capture_output=True, text=True, env=environment, timeout=120)
    assert script.returncode == 0, script.stderr
    statements = [line for line in script.stdout.splitlines() if line and not line.startswith("--")]
    assert statements[0] == "PRAGMA foreign_keys = OFF;" and statements[-1] == "PRAGMA foreign_keys = ON;"
    assert "BEGIN;" not in statements and "DROP TABLE runs;" in statements


def test_a_built_wheel_carries_the_migrations_and_upgrades_from_anywhere(tmp_path):
    """``pip install .`` (not editable) must migrate: the wheel holds env.py and every revision."""
    import shutil
    import zipfile

    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(PROJECT_ROOT / name, source / name)
    shutil.copytree(PROJECT_ROOT / "reshard_job", source / "reshard_job",
                    ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"),
                            str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("reshard_job-*.whl")
    revisions = sorted(p.name for p in migrations_dir().joinpath("versions").glob("*.py"))
    expected = {"reshard_job/lineage/migrations/env.py", "reshard_job/lineage/migrations/script.py.mako"} | {
        f"reshard_job/lineage/migrations/versions/{name}" for name in revisions}
    with zipfile.ZipFile(wheel) as archive:
        assert expected <= set(archive.namelist())
        archive.extractall(tmp_path / "installed")  # a pure-Python wheel unpacks to its installed layout

    (tmp_path / "cwd").mkdir()
    database = tmp_path / "db" / "lineage.db"
    script = ("import sys, reshard_job; from reshard_job.lineage import LineageStore\n"
              "assert reshard_job.__file__.startswith(sys.argv[1]), reshard_job.__file__\n"
              "store = LineageStore(sys.argv[2]); store.ensure_schema(); store.close()\n")
    environment = {k: v for k, v in os.environ.items() if k != "RESHARD_LINEAGE_URL"}
    environment["PYTHONPATH"] = str(tmp_path / "installed")
    upgraded = subprocess.run([sys.executable, "-c", script, str(tmp_path / "installed"), f"sqlite:///{database}"],
                              cwd=tmp_path / "cwd", capture_output=True, text=True, env=environment, timeout=120)
    assert upgraded.returncode == 0, upgraded.stderr
    engine = create_lineage_engine(f"sqlite:///{database}")
    try:
        with engine.connect() as connection:
            check_at_head(connection)
    finally:
        engine.dispose()


def _migrate(store, revision: str, how=command.upgrade) -> None:
    with writer(store.engine).connect() as connection:
        how(alembic_config(connection), revision)
        connection.commit()


def _row_counts(store) -> dict[str, int]:
    with store.engine.connect() as connection:
        return {table: connection.execute(text(f"SELECT COUNT(*) FROM {table}")).scalar_one()
                for table in ("runs", "events", "artifacts", "artifact_locations", "run_ranks")}


def test_0003_adds_run_fingerprints_to_a_database_with_runs_and_downgrading_drops_only_it(db_url, tmp_path,
                                                                                        record_lineage, get_run):
    from reshard_job.lineage import LineageStore

    store = LineageStore(db_url)
    try:
        store.ensure_schema()
        lineage = record_lineage(store, tmp_path / "files")
        before = {run_id: get_run(store, run_id) for run_id in (lineage.run_a, lineage.run_b)}
        counts = _row_counts(store)
        _migrate(store, "0002", command.downgrade)  # a database as revision 0002 left it, with runs
        assert _row_counts(store) == counts
        with store.engine.connect() as connection:
            assert "run_fingerprints" not in inspect(connection).get_table_names()

        store.ensure_schema()  # what the next job does
        assert {run_id: get_run(store, run_id) for run_id in before} == before
        assert store.fingerprints(lineage.run_a) == {"algorithm": None, "source": {}, "target": {}}
        run_id = store.start_run(config={}, overrides=[], tool_version="0.1.0", output_dir=str(tmp_path / "out"),
                                 source_devices=4, target_devices=2)
        store.record_fingerprints(run_id, "poslin64x2-v1", {"w": "ab" * 16}, {"w": "ab" * 16})
        assert store.fingerprints(run_id)["target"] == {"w": "ab" * 16}
        with store.engine.connect() as connection:
            check_at_head(connection)
            if connection.dialect.name == "sqlite":  # rows kept in the primary key's b-tree, no second copy
                created = connection.exec_driver_sql(
                    "SELECT sql FROM sqlite_master WHERE name = 'run_fingerprints'").scalar_one()
                assert created.rstrip().endswith("WITHOUT ROWID")

        _migrate(store, "0002", command.downgrade)
        with store.engine.connect() as connection:
            assert "run_fingerprints" not in inspect(connection).get_table_names()
            assert MigrationContext.configure(connection).get_current_revision() == "0002"
        assert _row_counts(store) == {**counts, "runs": counts["runs"] + 1}
        store.ensure_schema()
        assert {run_id: get_run(store, run_id) for run_id in before} == before
        assert get_run(store, run_id)["status"] == "started"
    finally:
        store.close()


def test_0004_marks_copied_outputs_keeping_every_row_and_earlier_events_read_as_made(db_url, tmp_path, make_file):
    from reshard_job.lineage import FileRecord, LineageStore

    store = LineageStore(db_url)
    try:
        store.ensure_schema()
        given = make_file(tmp_path / "given.ckpt", b"target strategy", "strategy")
        copy = make_file(tmp_path / "out" / "strategy.ckpt", b"target strategy", "strategy")
        made = make_file(tmp_path / "out" / "rank_0" / "checkpoint_0.ckpt", b"converted", "target_checkpoint", 0)
        run_id = store.start_run(config={}, overrides=[], tool_version="0.1.0", output_dir=str(tmp_path / "out"),
                                 source_devices=1, target_devices=1)
        store.record_inputs(run_id, [given])
        store.complete_run(run_id, outputs=[made, FileRecord(copy.path, copy.sha256, copy.size, "strategy",
                                                             copied=True)], plan={"ranks": []})

        def copied() -> dict[str, bool]:
            with store.engine.connect() as connection:
                rows = connection.execute(text("SELECT path, copied FROM events WHERE direction = 'output'"))
                return {path: bool(flag) for path, flag in rows}

        assert copied() == {made.path: False, copy.path: True}
        counts = _row_counts(store)
        _migrate(store, "0003", command.downgrade)
        with store.engine.connect() as connection:
            assert "copied" not in {c["name"] for c in inspect(connection).get_columns("events")}
        assert _row_counts(store) == counts
        store.ensure_schema()
        assert copied() == {made.path: False, copy.path: False}  # recorded before: read as made, as they were
        assert _row_counts(store) == counts
    finally:
        store.close()


def test_0005_adds_load_fingerprints_to_a_database_with_runs_and_downgrading_drops_only_it(db_url, tmp_path,
                                                                                         record_lineage, get_run):
    from reshard_job.core.fingerprint_shares import Share
    from reshard_job.lineage import LineageStore
    from reshard_job.lineage.load_shares import count_shares, read_shares

    store = LineageStore(db_url)
    try:
        store.ensure_schema()
        lineage = record_lineage(store, tmp_path / "files")
        before = {run_id: get_run(store, run_id) for run_id in (lineage.run_a, lineage.run_b)}
        counts = _row_counts(store)
        _migrate(store, "0004", command.downgrade)  # a database as revision 0004 left it, with runs
        with store.engine.connect() as connection:
            assert "load_fingerprints" not in inspect(connection).get_table_names()
            assert "run_fingerprints" in inspect(connection).get_table_names()
        assert _row_counts(store) == counts

        store.ensure_schema()  # what the next load does: 0004 -> 0005
        assert {run_id: get_run(store, run_id) for run_id in before} == before
        run_id = store.start_run(config={"load": {"rank": 1}}, overrides=[], tool_version="0.1.0",
                                 output_dir="(loaded)", source_devices=4, target_devices=2)
        share = Share("w", "Float16", (4, 6), ((2, 4), (0, 6)), "ab" * 16, rank=1)
        assert store.record_load_shares(run_id, [share]) == 1
        with store.read_session() as session:
            assert list(read_shares(session, {run_id: 1})) == [share]
            assert count_shares(session, lineage.run_a) == (0, None)  # earlier runs: none, nothing else changed
        with store.engine.connect() as connection:
            check_at_head(connection)
            if connection.dialect.name == "sqlite":
                created = connection.exec_driver_sql(
                    "SELECT sql FROM sqlite_master WHERE name = 'load_fingerprints'").scalar_one()
                assert created.rstrip().endswith("WITHOUT ROWID")

        _migrate(store, "0004", command.downgrade)
        with store.engine.connect() as connection:
            assert "load_fingerprints" not in inspect(connection).get_table_names()
            assert MigrationContext.configure(connection).get_current_revision() == "0004"
        assert _row_counts(store) == {**counts, "runs": counts["runs"] + 1}  # the load itself stays
        store.ensure_schema()
        assert {run_id: get_run(store, run_id) for run_id in before} == before
    finally:
        store.close()
