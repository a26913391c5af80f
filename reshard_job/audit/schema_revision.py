"""``audit db current`` and ``audit db upgrade``: a lineage database's schema revision, and bringing
it to this tool's head without running a job.

The upgrade is the one every job runs before it records (``lineage.migrate.upgrade_to_head``): locked
against jobs and other upgrades starting at the same moment, so it is safe while a sweep starts, and
configured in code, so no ``alembic.ini`` is needed. ``current`` only reads. Both refuse a database
that is not there rather than create one: a mistyped ``--db`` must not leave an empty database behind.
"""

from __future__ import annotations

import json
import os
from typing import Callable

ACTIONS = ("current", "upgrade")


def db_command(action: str, url: str, *, as_json: bool, write: Callable[[str], None],
               complain: Callable[[str], None]) -> int:
    """Run `action` on the database at `url`; one line (or JSON) out, one line on error. Exit status."""
    from sqlalchemy.exc import ArgumentError, SQLAlchemyError

    from reshard_job.errors import ReshardError
    from reshard_job.lineage.errors import driver_detail

    try:
        answer = _revisions(action, url)
    except ReshardError as exc:
        complain(f"error: {exc}")
        return 2
    except ArgumentError as exc:
        complain(f"error: invalid database URL {url!r}: {exc}")
        return 2
    except SQLAlchemyError as exc:
        detail = driver_detail(exc)
        complain(f"error: cannot {'upgrade' if action == 'upgrade' else 'read'} the lineage database: {detail}")
        return 2
    write(json.dumps(answer, indent=2) if as_json else revision_line(action, answer))
    return 0


def _revisions(action: str, url: str) -> dict:
    """The database (shown without its password), its revisions before and after `action`, the head."""
    from reshard_job.lineage.database import check_sqlite_file, create_lineage_engine, normalize_url, sqlite_file
    from reshard_job.lineage.errors import LineageError
    from reshard_job.lineage.migrate import current_revision, head_revision, known_revisions, upgrade_to_head

    parsed = normalize_url(url)
    shown = parsed.render_as_string(hide_password=True)
    database_file = sqlite_file(parsed)
    if database_file is not None:
        if not os.path.exists(database_file):
            raise LineageError(f"no lineage database at {database_file} (a job creates it on its first run; "
                               "use --db or $RESHARD_JOB_LINEAGE_URL)")
        check_sqlite_file(database_file, shown)
    engine = create_lineage_engine(parsed, read_only=action == "current")
    try:
        with engine.connect() as connection:
            before = current_revision(connection)
        if action == "upgrade":
            upgrade_to_head(engine)
            with engine.connect() as connection:
                after = current_revision(connection)
        else:
            after = before
    finally:
        engine.dispose()
    return {"database": shown, "before": before, "after": after, "head": head_revision(),
            "newer_than_head": after is not None and after not in known_revisions()}


def revision_line(action: str, answer: dict) -> str:
    """``<db>: schema revision 0002 -> 0003 (head)`` for an upgrade; where it stands for ``current``."""
    db, before, after, head = answer["database"], answer["before"], answer["after"], answer["head"]
    if action == "upgrade":
        return f"{db}: schema revision {before or 'none'} -> {after} (head{'' if before != after else ', unchanged'})"
    if after == head:
        return f"{db}: schema revision {after} (head)"
    if answer["newer_than_head"]:
        return f"{db}: schema revision {after}, newer than this tool knows (head {head}); upgrade reshard_job"
    if after is None:
        return f"{db}: no lineage schema yet (head {head}; a job's first run or 'db upgrade' creates it)"
    return f"{db}: schema revision {after}, head {head} ('db upgrade' brings it there, as any job would)"
