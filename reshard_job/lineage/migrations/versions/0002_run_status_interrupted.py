"""Runs may end "interrupted": the job was stopped by SIGINT or SIGTERM and recorded it.

Only the CHECK constraint on ``runs.status`` changes. PostgreSQL alters it in place. SQLite
cannot alter a constraint, so batch mode rebuilds ``runs`` (copy, drop, rename); the migration
runner switches SQLite's foreign keys off around it (see ``migrate.sqlite_foreign_keys_off``),
since dropping the old copy would otherwise cascade-delete every event, plan and rank map row
that refers to a run.

Downgrading turns interrupted runs into failed ones (the error keeps saying why) before the
narrower constraint returns.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23 07:00:00+00:00
"""

from __future__ import annotations

from typing import Sequence

from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copies, as in 0001: this revision must keep its meaning when the models change.
STATUSES_BEFORE = "'started', 'completed', 'failed', 'abandoned'"
STATUSES_AFTER = "'started', 'completed', 'failed', 'abandoned', 'interrupted'"


def _replace_status_check(statuses: str) -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_constraint(op.f("ck_runs_status"), type_="check")
        batch.create_check_constraint(op.f("ck_runs_status"), f"status IN ({statuses})")


def upgrade() -> None:
    _replace_status_check(STATUSES_AFTER)


def downgrade() -> None:
    op.execute("UPDATE runs SET status = 'failed', error = COALESCE(error, 'interrupted') "
               "WHERE status = 'interrupted'")
    _replace_status_check(STATUSES_BEFORE)
