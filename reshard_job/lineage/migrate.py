"""Bringing a lineage database to the current schema, safely when many jobs start at once.

Each job upgrades the database to the Alembic head before recording, the way MLflow does: the
job's own connection is handed to ``alembic.command.upgrade`` through
``config.attributes["connection"]``, so the migration runs exactly where the job will write.

A sweep starts dozens of jobs at the same moment against one database, and two Alembic runs
racing on an empty database would both try ``CREATE TABLE``. So upgrades are serialised:

* SQLite file: an ``fcntl`` lock on ``<db file>.migrate.lock`` next to the database. A file
  lock (unlike SQLite's own locking) spans the whole check-then-migrate sequence, and it is
  released by the kernel if the holder dies.
* PostgreSQL: a session-level ``pg_advisory_lock`` on the migrating connection, released on
  unlock or when the connection drops.
* Other backends: no lock; if the upgrade fails but the database is at head afterwards, another
  job won the race and the failure is ignored.

Before taking any lock, the current revision is compared with the head: once a database is up
to date (the common case), starting a job costs one small query and no lock.

The migrations ship inside the package, in ``reshard_job/lineage/migrations`` (as MLflow keeps
its own), so an installed wheel migrates exactly like a source checkout; ``alembic -c
<clone>/alembic.ini upgrade head`` uses the same scripts.
"""

from __future__ import annotations

import contextlib
import os
import re
import zlib
from pathlib import Path
from typing import Iterator

from sqlalchemy import Connection, Engine, inspect, text

from reshard_job.lineage.database import sqlite_file, writer
from reshard_job.lineage.errors import SchemaError
from reshard_job.storage.local_files import exclusive_lock, make_folder

VERSION_TABLE = "alembic_version"
# Arbitrary but fixed: every process of every version must agree on it.
PG_ADVISORY_LOCK_KEY = zlib.crc32(b"reshard_job.lineage.migrate")


def migrations_dir() -> Path:
    return Path(__file__).resolve().parent / "migrations"


def alembic_config(connection: Connection | None = None):
    """An Alembic config pointing at the project's migrations, optionally bound to `connection`.

    Built without reading ``alembic.ini`` so that a job's logging setup is left alone.
    """
    from alembic.config import Config

    location = migrations_dir()
    if not (location / "env.py").is_file():
        raise SchemaError(f"{location}: lineage migrations not found; this installation of reshard_job "
                          f"is incomplete (reinstall it)")
    config = Config()
    config.set_main_option("script_location", str(location))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def head_revision() -> str | None:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config()).get_current_head()


_REVISION_LINE = re.compile(r"^(down_revision|revision)\b[^=]*=\s*(.+?)\s*$", re.M)


def quick_head_revision() -> str | None:
    """The head revision read straight from the migration files, without importing Alembic.

    A job only needs to know whether the database is already at head, which it nearly always is;
    Alembic (and its script directory) is loaded only when there is something to migrate. Valid for
    a linear history (tests check it agrees with Alembic); anything unusual falls back to Alembic.
    """
    revisions, parents = set(), set()
    for path in sorted((migrations_dir() / "versions").glob("*.py")):
        found = dict(_REVISION_LINE.findall(path.read_text(encoding="utf-8")))
        rev = found.get("revision", "").strip("'\"")
        down = found.get("down_revision", "None")
        if not rev or not re.fullmatch(r"None|'[^']*'|\"[^\"]*\"", down):
            return head_revision()  # branches, merges or unusual syntax: ask Alembic
        revisions.add(rev)
        if down != "None":
            parents.add(down.strip("'\""))
    heads = revisions - parents
    return heads.pop() if len(heads) == 1 else head_revision()


def known_revisions() -> set[str]:
    from alembic.script import ScriptDirectory

    return {script.revision for script in ScriptDirectory.from_config(alembic_config()).walk_revisions()}


def current_revision(connection: Connection) -> str | None:
    """The database's Alembic revision (None when it has no schema yet).

    Read with plain SQL rather than through Alembic's MigrationContext, which logs its backend
    at INFO on every call: every job start would print it.
    """
    if not inspect(connection).has_table(VERSION_TABLE):
        return None
    revisions = connection.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars().all()
    if len(revisions) > 1:
        raise SchemaError(f"the lineage database has several schema heads ({', '.join(sorted(revisions))})")
    return revisions[0] if revisions else None


@contextlib.contextmanager
def schema_lock(connection: Connection) -> Iterator[None]:
    """Hold the cross-process migration lock for the database behind `connection`."""
    backend = connection.engine.url.get_backend_name()
    database_file = sqlite_file(connection.engine.url)
    if database_file is not None:
        with exclusive_lock(database_file + ".migrate.lock"):
            yield
    elif backend == "postgresql":
        connection.execute(text("SELECT pg_advisory_lock(:key)"), {"key": PG_ADVISORY_LOCK_KEY})
        connection.commit()
        try:
            yield
        finally:
            if connection.in_transaction():
                connection.rollback()
            connection.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": PG_ADVISORY_LOCK_KEY})
            connection.commit()
    else:
        yield


@contextlib.contextmanager
def sqlite_foreign_keys_off(connection: Connection) -> Iterator[None]:
    """Switch SQLite's foreign keys off while migrations run on `connection` (no-op elsewhere).

    SQLite changes a table by rebuilding it (Alembic's batch mode: copy, drop, rename), and with
    foreign keys on, dropping the old ``runs`` would cascade-delete every row referring to a run.
    The pragma is ignored inside a transaction, so it is set on the driver connection before the
    migration's transaction begins; ``check_foreign_keys`` verifies the result before commit.
    """
    if connection.dialect.name != "sqlite":
        yield
        return
    if connection.in_transaction():
        raise RuntimeError("SQLite migrations must start outside a transaction (foreign keys cannot be "
                           "switched off inside one)")
    driver_connection = connection.connection.driver_connection
    driver_connection.execute("PRAGMA foreign_keys = OFF")
    try:
        yield
    finally:
        driver_connection.execute("PRAGMA foreign_keys = ON")


def check_foreign_keys(connection: Connection) -> None:
    """Raise if a migration left rows referring to nothing (SQLite, where it could happen)."""
    if connection.dialect.name != "sqlite":
        return
    dangling = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
    if dangling:
        tables = sorted({str(row[0]) for row in dangling})
        raise SchemaError(f"{_shown(connection)}: migration left {len(dangling)} row(s) with dangling "
                          f"references in {', '.join(tables)}; rolled back")


def upgrade_to_head(engine: Engine) -> None:
    """Migrate the database behind `engine` to the newest schema, concurrency-safe."""
    database_file = sqlite_file(engine.url)
    if database_file is not None:
        make_folder(os.path.dirname(database_file))
    with engine.connect() as connection:
        if current_revision(connection) == quick_head_revision():
            return
    from alembic import command

    head = head_revision()
    with writer(engine).connect() as connection, schema_lock(connection):
        # Another job may have migrated while this one waited for the lock.
        current = current_revision(connection)
        connection.rollback()
        if current == head:
            return
        if current is not None and current not in known_revisions():
            raise SchemaError(f"{_shown(connection)} has schema revision {current}, newer than this tool "
                              f"knows ({head}); upgrade reshard_job")
        try:
            command.upgrade(alembic_config(connection), "head")
            if connection.in_transaction():
                connection.commit()
        except Exception:
            if connection.in_transaction():
                connection.rollback()
            at_head = current_revision(connection) == head
            connection.rollback()
            if not at_head:
                raise


def check_at_head(connection: Connection) -> None:
    """Raise a one-line SchemaError unless the database is exactly at the head revision.

    Readers (the audit CLI) call this instead of migrating: reading must never change a database.
    """
    current = current_revision(connection)
    if current is not None and current == quick_head_revision():
        return  # the common case, answered without loading Alembic
    head = head_revision()
    if current == head:
        return
    if current is None:
        raise SchemaError(f"{_shown(connection)} is not a lineage database (no schema); "
                          f"a job creates it on its first run")
    if current not in known_revisions():
        raise SchemaError(f"{_shown(connection)} has schema revision {current}, newer than this tool "
                          f"knows ({head}); upgrade reshard_job")
    raise SchemaError(f"{_shown(connection)} has an outdated schema (revision {current}, head {head}); "
                      f"'python -m reshard_job.audit db upgrade --db URL' upgrades it, as any job with this "
                      f"lineage.url does")


def _shown(connection: Connection) -> str:
    return connection.engine.url.render_as_string(hide_password=True)
