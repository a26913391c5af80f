"""Which lineage database the audit reads, and opening it without ever creating or migrating it."""

from __future__ import annotations

import os

DB_HELP = "SQLAlchemy URL of the lineage database (default: $RESHARD_JOB_LINEAGE_URL, else runs/lineage.db)"


def database_url(args) -> str:
    """--db, else the environment's, else runs/lineage.db; a path, as people type it, is the SQLite file there."""
    from reshard_job.lineage.database import default_url, sqlite_url

    url = getattr(args, "db", None) or default_url()
    return url if "://" in url else sqlite_url(os.path.abspath(url))


def open_store(url: str):
    """Open the database read-only in spirit: never create it, never migrate it."""
    from reshard_job.lineage import LineageStore
    from reshard_job.lineage.database import normalize_url, sqlite_file
    from reshard_job.lineage.errors import LineageError

    database_file = sqlite_file(normalize_url(url))
    if database_file is not None and not os.path.exists(database_file):
        raise LineageError(f"no lineage database at {database_file} (no job has recorded there yet; "
                           "use --db or $RESHARD_JOB_LINEAGE_URL)")
    return LineageStore(url, read_only=True)
