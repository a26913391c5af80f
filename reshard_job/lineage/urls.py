"""Which lineage database: the URL from the configuration, the environment or the default.

Standard library only, so that deciding the URL (every run does, while settling its
configuration) does not import SQLAlchemy: a plan-only run never opens the database, and a
third of a second of its fixed cost was that import.
"""

from __future__ import annotations

import os

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
