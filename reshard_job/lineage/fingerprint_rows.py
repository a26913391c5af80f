"""A run's per-parameter fingerprints as rows of ``run_fingerprints``: written in bulk, read back whole.

A model may have 600,000 parameters, each fingerprinted in the sources and in the outputs: over a
million rows for one run. They go in as plain rows, ``BATCH_ROWS`` at a time, through one
executemany per batch (never one ORM object per row, which would cost minutes and gigabytes); on
PostgreSQL through psycopg, as one ``COPY`` instead, since psycopg runs an executemany as one
statement per row (a million rows: about four times slower than COPY). Either way they go in the
caller's transaction: a run has all its fingerprints or, if recording failed, none of the new
ones. Recording again (a resumed run fingerprints its outputs again) replaces the run's rows.

The values are checked before anything is written, so a bad one is a one-line ``LineageError``
naming the parameter, not a database error halfway through a million rows.
"""

from __future__ import annotations

import re
from typing import Any, Iterator, Mapping

from sqlalchemy import delete, insert, select
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from reshard_job.lineage.errors import LineageError
from reshard_job.lineage.models import FINGERPRINT_SIDES, RunFingerprint

BATCH_ROWS = 5000
_TABLE = RunFingerprint.__table__
_COLUMNS = ("run_id", "side", "name", "digest", "algorithm")
_HEX = re.compile(r"[0-9a-f]+")
_MAX_DIGEST = _TABLE.c.digest.type.length
_MAX_ALGORITHM = _TABLE.c.algorithm.type.length


def replace_fingerprints(session: Session, run_id: str, algorithm: str, source: Mapping[str, str],
                         target: Mapping[str, str] | None) -> int:
    """Replace the fingerprints recorded for `run_id` with `source` and `target` (None: the outputs
    were not read back, so only the sources are recorded); return the number of rows written."""
    _check_algorithm(algorithm)
    sides = {"source": source, "target": target or {}}
    for side, digests in sides.items():
        _check_digests(side, digests)
    session.execute(delete(_TABLE).where(_TABLE.c.run_id == run_id))
    rows = _rows(run_id, algorithm, sides)
    if session.get_bind().dialect.driver == "psycopg":
        return _copy(session, rows)
    written = 0
    for batch in _batches(rows):
        session.execute(insert(_TABLE), [dict(zip(_COLUMNS, row)) for row in batch])
        written += len(batch)
    return written


def _copy(session: Session, rows: Iterator[tuple[str, ...]], table=_TABLE,
          columns: tuple[str, ...] = _COLUMNS) -> int:
    """PostgreSQL's bulk load of `rows` (in `columns` order) into `table`, on the session's own
    connection and so inside its transaction.

    The driver's errors are raised as SQLAlchemy's, as every other statement's are, so that
    contention is retried and failures are reported like any other database error."""
    connection = session.connection()
    dbapi = connection.dialect.loaded_dbapi
    statement = f"COPY {table.name} ({', '.join(columns)}) FROM STDIN"
    written = 0
    try:
        with connection.connection.driver_connection.cursor() as cursor, cursor.copy(statement) as copy:
            for row in rows:
                copy.write_row(row)
                written += 1
    except dbapi.Error as exc:
        raise DBAPIError.instance(statement, None, exc, dbapi.Error, dialect=connection.dialect) from None
    return written


def read_fingerprints(session: Session, run_id: str) -> dict[str, Any]:
    """``{"algorithm", "source": {name: hex}, "target": {name: hex}}`` as recorded for `run_id`.

    ``algorithm`` is None when nothing was recorded (a run from before fingerprints were kept);
    rows under several algorithms (only a hand edit makes them) name them all, comma-separated."""
    found: dict[str, Any] = {side: {} for side in FINGERPRINT_SIDES}
    algorithms: set[str] = set()
    query = (select(_TABLE.c.side, _TABLE.c.name, _TABLE.c.digest, _TABLE.c.algorithm)
             .where(_TABLE.c.run_id == run_id).order_by(_TABLE.c.side, _TABLE.c.name))
    for side, name, digest, algorithm in session.execute(query):
        found.setdefault(side, {})[name] = digest
        algorithms.add(algorithm)
    return {"algorithm": ", ".join(sorted(algorithms)) or None, **found}


def _rows(run_id: str, algorithm: str, sides: Mapping[str, Mapping[str, str]]) -> Iterator[tuple[str, ...]]:
    """Rows in ``_COLUMNS`` order and in key order, so that the index and SQLite's b-tree grow at their ends."""
    for side in sorted(sides):
        for name in sorted(sides[side]):
            yield run_id, side, name, sides[side][name].lower(), algorithm


def _batches(rows: Iterator[tuple[str, ...]]) -> Iterator[list[tuple[str, ...]]]:
    batch: list[tuple[str, ...]] = []
    for row in rows:
        batch.append(row)
        if len(batch) == BATCH_ROWS:
            yield batch
            batch = []
    if batch:
        yield batch


def _check_algorithm(algorithm: Any) -> None:
    if not isinstance(algorithm, str) or not algorithm or len(algorithm) > _MAX_ALGORITHM:
        raise LineageError(f"fingerprint algorithm {str(algorithm)[:80]!r} is not a name of 1 to "
                           f"{_MAX_ALGORITHM} characters")


def _check_digests(side: str, digests: Any) -> None:
    if not isinstance(digests, Mapping):
        raise LineageError(f"{side} fingerprints are a {type(digests).__name__}, not a mapping of parameter "
                           f"names to hex digests")
    for name, digest in digests.items():
        if not isinstance(name, str) or not name:
            raise LineageError(f"{side} fingerprints: parameter name {str(name)[:80]!r} is not a non-empty string")
        if not isinstance(digest, str) or not 0 < len(digest) <= _MAX_DIGEST or not _HEX.fullmatch(digest.lower()):
            raise LineageError(f"{side} fingerprint of parameter {name[:200]!r} is {str(digest)[:80]!r}, not a hex "
                               f"digest of at most {_MAX_DIGEST} characters")
