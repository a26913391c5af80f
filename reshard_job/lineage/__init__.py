"""Lineage: which source checkpoints, strategies and config produced each output file.

The job records every conversion through ``LineageStore``; ``python -m reshard_job.audit``
answers questions about the records (``runs``, ``show``, ``trace``, ``verify``). Modules:

* ``models``   — the schema (runs, artifacts by content, locations, events, rank map, plans)
* ``database`` — URLs, engines, SQLite/PostgreSQL settings, retry on contention
* ``migrate``  — concurrency-safe Alembic upgrade to head
* ``store``    — the recording API a job calls
* ``queries``  — read-only answers as plain data; ``render`` turns them into text
"""

from .database import URL_ENV_VAR, create_lineage_engine, default_url
from .errors import AmbiguousRunError, LineageError, RunStateError, SchemaError, UnknownRunError
from .hashing import hash_file
from .store import FileRecord, LineageStore

__all__ = [
    "AmbiguousRunError",
    "FileRecord",
    "LineageError",
    "LineageStore",
    "RunStateError",
    "SchemaError",
    "URL_ENV_VAR",
    "UnknownRunError",
    "create_lineage_engine",
    "default_url",
    "hash_file",
]
