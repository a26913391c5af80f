"""A load's fingerprint shares as rows of ``load_fingerprints``: written in bulk, read back in name order.

One row per parameter the loading rank holds: the share's digest and algorithm, the parameter's
dtype and global shape, and the box the rank holds (``core.fingerprint_shares``). A rank of a model
of 600,000 parameters writes 600,000 rows, so they go in as ``run_fingerprints``' do (batches of
one executemany, or one ``COPY`` on PostgreSQL through psycopg), in the caller's transaction.
Reading streams them in name order across any number of loads, so putting a model back together
holds one parameter's shares at a time, never a whole load.

Text forms: a shape is its dims comma-separated (``"4096,1024"``, ``""`` for a scalar), a box its
``start:stop`` ranges (``"0:1024,0:1024"``).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Iterable, Iterator, Sequence

from sqlalchemy import delete, func, insert, select
from sqlalchemy.orm import Session

from reshard_job.core.boxes import Box
from reshard_job.core.fingerprint_shares import Share
from reshard_job.lineage.errors import LineageError
from reshard_job.lineage.fingerprint_rows import _batches, _copy
from reshard_job.lineage.models import LoadFingerprint

_TABLE = LoadFingerprint.__table__
_COLUMNS = ("run_id", "name", "digest", "algorithm", "dtype", "shape", "box")
READ_BATCH = 10_000  # rows fetched at a time when reading


def shape_text(shape: Sequence[int]) -> str:
    return ",".join(str(int(n)) for n in shape)


def box_text(box: Box) -> str:
    return ",".join(f"{int(lo)}:{int(hi)}" for lo, hi in box)


@lru_cache(maxsize=1 << 16)  # a model's parameters share a few shapes and boxes: parse each once
def parse_shape(text: str) -> tuple[int, ...]:
    return tuple(int(n) for n in text.split(",")) if text else ()


@lru_cache(maxsize=1 << 16)
def parse_box(text: str) -> Box:
    return tuple(tuple(int(i) for i in part.split(":")) for part in text.split(",")) if text else ()


def replace_shares(session: Session, run_id: str, shares: Iterable[Share]) -> int:
    """Replace the shares recorded for the load `run_id`; return the number of rows written.
    `shares`: a list or tuple in any order, else an iterable in name order (not held whole)."""
    session.execute(delete(_TABLE).where(_TABLE.c.run_id == run_id))
    rows = _rows(run_id, shares)
    if session.get_bind().dialect.driver == "psycopg":
        return _copy(session, rows, _TABLE, _COLUMNS)
    written = 0
    for batch in _batches(rows):
        session.execute(insert(_TABLE), [dict(zip(_COLUMNS, row)) for row in batch])
        written += len(batch)
    return written


def _rows(run_id: str, shares: Iterable[Share]) -> Iterator[tuple[str, ...]]:
    """Rows in key order, so that the primary key's b-tree grows at its end."""
    if isinstance(shares, (list, tuple)):
        shares = sorted(shares, key=lambda s: s.name)
    previous = None
    for s in shares:
        if not s.name or len(s.digest) > _TABLE.c.digest.type.length:
            raise LineageError(f"load fingerprint of parameter {s.name[:200]!r} is {s.digest[:80]!r}, not a hex digest")
        if previous is not None and s.name <= previous:
            raise LineageError(f"load fingerprints: parameter {s.name[:200]!r} comes after {previous[:200]!r} "
                               "(twice, or out of name order)")
        previous = s.name
        yield run_id, s.name, s.digest, s.algorithm, s.dtype, shape_text(s.shape), box_text(s.box)


def count_shares(session: Session, run_id: str) -> tuple[int, str | None]:
    """How many shares the load `run_id` recorded, and under which algorithm(s) (None: none)."""
    found = session.execute(select(_TABLE.c.algorithm, func.count()).where(_TABLE.c.run_id == run_id)
                            .group_by(_TABLE.c.algorithm)).all()
    return sum(n for _, n in found), ", ".join(sorted(a for a, _ in found)) or None


def read_shares(session: Session, ranks: dict[str, int | None]) -> Iterator[Share]:
    """The shares of the loads `ranks` names (run id -> the target rank it loaded), in name order."""
    query = (select(*(_TABLE.c[c] for c in _COLUMNS)).where(_TABLE.c.run_id.in_(list(ranks)))
             .order_by(_TABLE.c.name, _TABLE.c.run_id).execution_options(yield_per=READ_BATCH))
    for run_id, name, digest, algorithm, dtype, shape, box in session.execute(query):
        yield Share(name, dtype, parse_shape(shape), parse_box(box), digest, algorithm, ranks[run_id])
