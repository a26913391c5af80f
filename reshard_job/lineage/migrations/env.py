"""Alembic environment of the lineage database.

Two ways in:

* Programmatic (every job, via ``reshard_job.lineage.migrate.upgrade_to_head``): the caller
  passes its open connection in ``config.attributes["connection"]`` and already holds the
  cross-process migration lock; this script just runs the migrations on that connection.
* The ``alembic`` command line with the project's ``alembic.ini`` (``alembic -c <clone>/alembic.ini``,
  from any directory): the URL comes from ``-x url=...``, else ``$RESHARD_LINEAGE_URL``, else
  ``sqlite:///runs/lineage.db`` under the current directory; this script then takes the same
  migration lock a job would, so an operator's upgrade cannot race a starting sweep.

The script ships inside the package (``reshard_job/lineage/migrations``) and is loaded by Alembic
from its file, not imported as a module; ``reshard_job`` itself is importable because it is
installed or because ``alembic.ini`` puts the clone on ``sys.path``.

SQLite cannot ALTER most things in place, so migrations are rendered in batch mode there, with
foreign keys off while tables are rebuilt (``migrate.sqlite_foreign_keys_off``).
"""

from __future__ import annotations

import os
from logging.config import fileConfig

from alembic import context

from reshard_job.lineage.database import URL_ENV_VAR, create_lineage_engine, writer
from reshard_job.lineage.migrate import check_foreign_keys, schema_lock, sqlite_foreign_keys_off
from reshard_job.lineage.models import Base
from reshard_job.storage.local_files import make_folder

config = context.config
target_metadata = Base.metadata

CLI_DEFAULT_URL = "sqlite:///runs/lineage.db"


def _cli_url() -> str:
    return (context.get_x_argument(as_dictionary=True).get("url")
            or os.environ.get(URL_ENV_VAR)
            or CLI_DEFAULT_URL)


def _configure(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        # Our SQLite connections begin their transactions explicitly, so DDL there is
        # transactional too: a failed upgrade leaves the database as it was.
        transactional_ddl=True,
        compare_type=True,
    )


def run_migrations_offline() -> None:
    url = _cli_url()
    sqlite = url.startswith("sqlite")
    context.configure(url=url, target_metadata=target_metadata, literal_binds=True,
                      dialect_opts={"paramstyle": "named"}, render_as_batch=sqlite)
    if sqlite:  # the printed script rebuilds tables too: same precaution as online, before any BEGIN
        context.execute("PRAGMA foreign_keys = OFF")
    with context.begin_transaction():
        context.run_migrations()
    if sqlite:
        context.execute("PRAGMA foreign_keys = ON")


def _migrate(connection) -> None:
    with sqlite_foreign_keys_off(connection):
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()
            check_foreign_keys(connection)


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _migrate(connection)
        return

    url = _cli_url()
    if url.startswith("sqlite"):
        from reshard_job.lineage.database import normalize_url, sqlite_file

        database_file = sqlite_file(normalize_url(url))
        if database_file:
            make_folder(os.path.dirname(database_file))
    engine = create_lineage_engine(url)
    try:
        with writer(engine).connect() as connection, schema_lock(connection):
            _migrate(connection)
    finally:
        engine.dispose()


if config.config_file_name is not None:
    fileConfig(config.config_file_name, disable_existing_loggers=False)

if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
