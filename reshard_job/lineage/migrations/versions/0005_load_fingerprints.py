"""A load's per-parameter fingerprint shares: one row per parameter the loading rank holds.

A new table only; existing rows are untouched. Like ``run_fingerprints`` (0003) it is ``WITHOUT
ROWID`` on SQLite, for a rank that loads hundreds of thousands of parameters. Beside the digest it
keeps what a share needs to be put together with the other ranks' (``core.fingerprint_shares``):
the parameter's dtype and global shape and the box the rank holds.

Downgrading drops the table and every share recorded in it (the loads themselves stay).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-27 09:30:00+00:00
"""

from __future__ import annotations

from typing import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "load_fingerprints",
        sa.Column("run_id", sa.String(length=36), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("algorithm", sa.String(length=32), nullable=False),
        sa.Column("dtype", sa.String(length=32), nullable=False),
        sa.Column("shape", sa.Text(), nullable=False),
        sa.Column("box", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_load_fingerprints_run_id_runs"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "name", name=op.f("pk_load_fingerprints")),
        sqlite_with_rowid=False,
    )


def downgrade() -> None:
    op.drop_table("load_fingerprints")
