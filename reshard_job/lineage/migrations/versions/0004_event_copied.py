"""Events say whether a run made an output's bytes or copied them from one of its inputs.

A new column ``events.copied`` (false for every existing row: runs recorded before this revision
are read as having made all their outputs, as they were read until now). A boolean needs no CHECK
constraint, so both backends add it in place: SQLite's ``ADD COLUMN`` accepts a NOT NULL column
with a constant default, and no table is rebuilt.

Downgrading drops the column (in place: SQLite 3.35 or later): copies then read as products again.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-27 07:00:00+00:00
"""

from __future__ import annotations

from typing import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("events", sa.Column("copied", sa.Boolean(), server_default=sa.false(), nullable=False))


def downgrade() -> None:
    op.drop_column("events", "copied")  # SQLite 3.35+ drops a column that no index or constraint names
