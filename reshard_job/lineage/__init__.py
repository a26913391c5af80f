"""Lineage: which source checkpoints, strategies and config produced each output file.

The job records every conversion through ``LineageStore``; ``python -m reshard_job.audit``
answers questions about the records (``runs``, ``show``, ``trace``, ``verify``, ``graph``).

Writing:

* ``models``    — the schema (runs, artifacts by content, locations, events, rank map, plans)
* ``status``    — ``RunStatus``, the one spelling of a run's states
* ``database``  — URLs, engines, SQLite/PostgreSQL settings, retry on contention
* ``migrate``   — concurrency-safe Alembic upgrade to head; revisions in ``migrations/``
* ``file_records`` — ``FileRecord``, what a job says about a file (no SQLAlchemy)
* ``store``     — the recording API a job calls
* ``fingerprint_rows`` — the per-parameter fingerprints of a run's sources and outputs (bulk rows)
* ``load_shares`` — a load's per-parameter fingerprint shares, with their boxes (bulk rows)
* ``waiting``   — lock waits bounded in time and ended by a stop request

Reading is ``reshard_job.audit``'s (the CLI, lookups, traces, graphs, verification).
"""

from reshard_job.lineage.errors import AmbiguousRunError, LineageError, RunStateError, SchemaError, UnknownRunError
from reshard_job.lineage.file_records import FileRecord
from reshard_job.lineage.status import RunStatus

# The database layer (SQLAlchemy, Alembic) is imported on first use: describing files and
# raising lineage errors must not wait for it.
_LAZY = {
    "LineageStore": ("store", "LineageStore"),
    "URL_ENV_VAR": ("database", "URL_ENV_VAR"),
    "create_lineage_engine": ("database", "create_lineage_engine"),
    "default_url": ("database", "default_url"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(f".{module}", __name__), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AmbiguousRunError",
    "FileRecord",
    "LineageError",
    "LineageStore",
    "RunStateError",
    "RunStatus",
    "SchemaError",
    "URL_ENV_VAR",
    "UnknownRunError",
    "create_lineage_engine",
    "default_url",
]
