"""Which lineage database: the URL from the configuration, the environment or the default.

Standard library only, so that deciding the URL (every run does, while settling its
configuration) does not import SQLAlchemy: a plan-only run never opens the database, and a
third of a second of its fixed cost was that import.
"""

from __future__ import annotations

import os
from urllib.parse import unquote

URL_ENV_VAR = "RESHARD_JOB_LINEAGE_URL"
LEGACY_URL_ENV_VAR = "RESHARD_LINEAGE_URL"  # the name earlier versions read; still honoured after URL_ENV_VAR
DEFAULT_SQLITE_PATH = os.path.join("runs", "lineage.db")


def default_url() -> str:
    """The lineage database to use when none is configured.

    ``$RESHARD_JOB_LINEAGE_URL`` (or ``$RESHARD_LINEAGE_URL``) if set, else the SQLite file
    ``runs/lineage.db`` under the current working directory, made absolute now so that a later
    ``chdir`` cannot move it.
    """
    return url_from_environment() or sqlite_url(os.path.abspath(DEFAULT_SQLITE_PATH))


def url_from_environment() -> str | None:
    """The lineage database the environment names, if any; a plain path is the SQLite file there."""
    for name in (URL_ENV_VAR, LEGACY_URL_ENV_VAR):
        value = os.environ.get(name, "").strip()
        if value:
            return value if "://" in value else sqlite_url(os.path.abspath(value))
    return None


def sqlite_url(path: str | os.PathLike) -> str:
    return f"sqlite:///{os.fspath(path)}"


IN_MEMORY = ("an in-memory SQLite database keeps nothing once the process ends, and each connection gets "
             "its own; give a file (sqlite:///runs/lineage.db)")


def in_memory_sqlite(url: str) -> bool:
    """Whether `url` names an in-memory SQLite database (``sqlite://``, ``sqlite:///:memory:``,
    ``sqlite:///file::memory:``, ``...?mode=memory``): nothing recorded there would outlive the job."""
    scheme, sep, rest = str(url).partition("://")
    if not sep or scheme.split("+")[0].lower() != "sqlite":
        return False
    database, _, query = unquote(rest[1:] if rest.startswith("/") else rest).partition("?")
    return in_memory_database(database, query)


def in_memory_database(database: str | None, query: str) -> bool:
    """Whether an SQLite URL's database part and query (``a=1&b=2``) name an in-memory database."""
    database = database or ""
    return (database in ("", ":memory:") or database.startswith("file::memory:")
            or "mode=memory" in query or "mode=memory" in database)
