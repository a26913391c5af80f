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

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copies, as in 0001: this revision must keep its meaning when the models change.
STATUSES_BEFORE = "'started', 'completed', 'failed', 'abandoned'"
STATUSES_AFTER = "'started', 'completed', 'failed', 'abandoned', 'interrupted'"


def _runs_as_of_0001(statuses: str) -> sa.Table:
    """``runs`` exactly as revision 0001 made it (with `statuses` allowed), for SQLite's rebuild:
    given the table, batch mode needs no reflection (so ``--sql`` works too) and keeps every index."""
    utc = sa.DateTime(timezone=True)
    return sa.Table(
        "runs", sa.MetaData(),
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("started_at", utc, nullable=False),
        sa.Column("ended_at", utc, nullable=True),
        sa.Column("tool_version", sa.String(length=64), nullable=False),
        sa.Column("host", sa.String(length=255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("user", sa.String(length=255), nullable=True),
        sa.Column("overrides", sa.JSON(), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("sweep_id", sa.String(length=255), nullable=True),
        sa.Column("job_num", sa.Integer(), nullable=True),
        sa.Column("output_dir", sa.Text(), nullable=False),
        sa.Column("source_devices", sa.Integer(), nullable=True),
        sa.Column("target_devices", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.CheckConstraint(f"status IN ({statuses})", name="ck_runs_status"),
        sa.PrimaryKeyConstraint("id", name="pk_runs"),
        sa.Index("ix_runs_started_at", "started_at"),
        sa.Index("ix_runs_status_started_at", "status", "started_at"),
        sa.Index("ix_runs_sweep_id_job_num", "sweep_id", "job_num"),
    )


def _replace_status_check(old: str, new: str) -> None:
    with op.batch_alter_table("runs", copy_from=_runs_as_of_0001(old)) as batch:
        batch.drop_constraint(op.f("ck_runs_status"), type_="check")
        batch.create_check_constraint(op.f("ck_runs_status"), f"status IN ({new})")


def upgrade() -> None:
    _replace_status_check(STATUSES_BEFORE, STATUSES_AFTER)


def downgrade() -> None:
    op.execute("UPDATE runs SET status = 'failed', error = COALESCE(error, 'interrupted') "
               "WHERE status = 'interrupted'")
    _replace_status_check(STATUSES_AFTER, STATUSES_BEFORE)
