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

LINEAGE_TABLES = {"runs", "run_plans", "run_ranks", "artifacts", "artifact_locations", "events"}
PROJECT_ROOT = Path(__file__).resolve().parents[2]


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
