"""Per-parameter fingerprints of a run: one row per parameter and side (its sources, its outputs).

A new table only; existing rows are untouched. On SQLite it is ``WITHOUT ROWID``: its rows are
stored in the primary key's b-tree instead of beside a second copy of it, which halves the space
and the insert work of a model's hundreds of thousands of parameters.

Downgrading drops the table and every fingerprint recorded in it.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 09:00:00+00:00
"""

from __future__ import annotations

from typing import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copy, as in 0001: this revision must keep its meaning when the models change.
SIDES = "'source', 'target'"


def upgrade() -> None:
    op.create_table(
        "run_fingerprints",
        sa.Column("run_id", sa.String(length=36), nullable=False),
        sa.Column("side", sa.String(length=8), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("algorithm", sa.String(length=32), nullable=False),
        sa.CheckConstraint(f"side IN ({SIDES})", name=op.f("ck_run_fingerprints_side")),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_run_fingerprints_run_id_runs"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "side", "name", name=op.f("pk_run_fingerprints")),
        sqlite_with_rowid=False,
    )


def downgrade() -> None:
    op.drop_table("run_fingerprints")
