"""Lineage schema: runs, artifacts by content, where they were seen, events, rank map, plans.

Revision ID: 0001
Revises:
Create Date: 2026-11-22 10:01:22+00:00
"""

from __future__ import annotations

from typing import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copies of the value lists at this revision: a migration must not change meaning when
# the models module evolves later.
ARTIFACT_KINDS = "'source_checkpoint', 'target_checkpoint', 'strategy', 'merged_strategy', 'manifest'"
RUN_STATUSES = "'started', 'completed', 'failed', 'abandoned'"


def _utc() -> sa.DateTime:
    return sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "artifacts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("hash_algo", sa.String(length=16), nullable=False),
        sa.Column("digest", sa.String(length=128), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=True),
        sa.Column("first_recorded_at", _utc(), nullable=False),
        sa.CheckConstraint(f"kind IN ({ARTIFACT_KINDS})", name=op.f("ck_artifacts_kind")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_artifacts")),
        sa.UniqueConstraint("hash_algo", "digest", "size", name=op.f("uq_artifacts_hash_algo_digest_size")),
    )
    op.create_index("ix_artifacts_digest", "artifacts", ["digest"])

    op.create_table(
        "runs",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("started_at", _utc(), nullable=False),
        sa.Column("ended_at", _utc(), nullable=True),
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
        sa.CheckConstraint(f"status IN ({RUN_STATUSES})", name=op.f("ck_runs_status")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_runs")),
    )
    op.create_index(op.f("ix_runs_started_at"), "runs", ["started_at"])
    op.create_index("ix_runs_status_started_at", "runs", ["status", "started_at"])
    op.create_index("ix_runs_sweep_id_job_num", "runs", ["sweep_id", "job_num"])

    op.create_table(
        "artifact_locations",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("artifact_id", sa.Integer(), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("first_seen", _utc(), nullable=False),
        sa.Column("last_seen", _utc(), nullable=False),
        sa.ForeignKeyConstraint(["artifact_id"], ["artifacts.id"],
                                name=op.f("fk_artifact_locations_artifact_id_artifacts"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_artifact_locations")),
        sa.UniqueConstraint("artifact_id", "path", name=op.f("uq_artifact_locations_artifact_id_path")),
    )
    op.create_index(op.f("ix_artifact_locations_path"), "artifact_locations", ["path"])

    op.create_table(
        "events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.String(length=36), nullable=False),
        sa.Column("artifact_id", sa.Integer(), nullable=False),
        sa.Column("direction", sa.String(length=8), nullable=False),
        sa.Column("role", sa.String(length=32), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=True),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("recorded_at", _utc(), nullable=False),
        sa.CheckConstraint("direction IN ('input', 'output')", name=op.f("ck_events_direction")),
        sa.CheckConstraint(f"role IN ({ARTIFACT_KINDS})", name=op.f("ck_events_role")),
        sa.ForeignKeyConstraint(["artifact_id"], ["artifacts.id"],
                                name=op.f("fk_events_artifact_id_artifacts"), ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_events_run_id_runs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_events")),
        sa.UniqueConstraint("run_id", "direction", "path", name=op.f("uq_events_run_id_direction_path")),
    )
    op.create_index("ix_events_artifact_id_direction", "events", ["artifact_id", "direction"])

    op.create_table(
        "run_plans",
        sa.Column("run_id", sa.String(length=36), nullable=False),
        sa.Column("plan", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_run_plans_run_id_runs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", name=op.f("pk_run_plans")),
    )

    op.create_table(
        "run_ranks",
        sa.Column("run_id", sa.String(length=36), nullable=False),
        sa.Column("target_rank", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("source_ranks", sa.JSON(), nullable=False),
        sa.Column("bytes_read", sa.BigInteger(), nullable=True),
        sa.Column("bytes_written", sa.BigInteger(), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_run_ranks_run_id_runs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "target_rank", name=op.f("pk_run_ranks")),
    )


def downgrade() -> None:
    op.drop_table("run_ranks")
    op.drop_table("run_plans")
    op.drop_index("ix_events_artifact_id_direction", table_name="events")
    op.drop_table("events")
    op.drop_index(op.f("ix_artifact_locations_path"), table_name="artifact_locations")
    op.drop_table("artifact_locations")
    op.drop_index("ix_runs_sweep_id_job_num", table_name="runs")
    op.drop_index("ix_runs_status_started_at", table_name="runs")
    op.drop_index(op.f("ix_runs_started_at"), table_name="runs")
    op.drop_table("runs")
    op.drop_index("ix_artifacts_digest", table_name="artifacts")
    op.drop_table("artifacts")
