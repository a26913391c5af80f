"""The lineage schema: runs (executions), artifacts, and the events that link them.

The shape follows ML Metadata and MLflow: a *run* is one execution of the job, an *artifact* is
one file *content*, and an *event* says "run R read/wrote artifact A, as role K, at path P".

Choices and their trade-offs:

* Artifacts are identified by content (hash algorithm, digest, size), never by path. A file that
  run A wrote and that was later copied elsewhere and fed to run B is the same artifact, so
  ancestry crosses runs and file moves for free. The price is that two byte-identical files
  (say, data-parallel replicas) collapse into one artifact; the events still keep each rank
  and path apart, which is what lineage needs.
* The hash algorithm is a column next to the digest (as DVC stores ``md5`` next to its value),
  so a later switch to another algorithm does not reinterpret old rows.
* Where an artifact was seen lives in its own table (``artifact_locations``) with first/last
  seen times: paths are evidence, not identity, and one content can sit at many paths.
* Status and kind are plain strings guarded by CHECK constraints rather than database ENUM
  types: PostgreSQL enums need their own migrations to extend, strings do not.
* Timestamps are stored as UTC. SQLite has no time zone type, so ``UTCDateTime`` stores naive
  UTC there and hands back aware UTC datetimes on every backend.
* The full plan (potentially large: every parameter of every target rank) lives in
  ``run_plans``, apart from ``runs``, so listing runs never drags plans along; the per-rank
  summary that audits query (which source ranks fed which target rank) is a real table.
* An event says whether the run *made* the bytes or only *copied* them from one of its inputs
  (``copied``: the target strategy file it was given, written beside its outputs). Content ties
  runs together only through bytes a run made; otherwise every run that copied one strategy file
  would be an ancestor of every other's outputs.
* Per-parameter fingerprints (``core.fingerprint``) are rows of ``run_fingerprints``, one per
  parameter and side, not a JSON document: a model of 600,000 parameters is then written in
  batches and compared side against side in SQL. ``Run`` has no relationship to them, so loading
  a run never loads its fingerprints; the database deletes them with their run. On SQLite the
  table is ``WITHOUT ROWID``: its rows live in the primary key's b-tree, not beside a copy of it.
  A load (``reshard_job.load_rank``) keeps its per-parameter fingerprint shares the same way, in
  ``load_fingerprints``, with the dtype, global shape and box that putting shares together needs.

Schema changes go through the Alembic migrations in ``reshard_job/lineage/migrations`` only;
a test compares these models with the migration head.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from reshard_job.lineage.file_records import ARTIFACT_KINDS  # one list for the schema and the file records
from reshard_job.lineage.status import RunStatus, status_of

DIRECTIONS = ("input", "output")
# Which checkpoint a parameter's fingerprint was read from: the run's sources or its outputs.
FINGERPRINT_SIDES = ("source", "target")

# Explicit constraint names make migrations reproducible across backends (SQLite's batch mode
# needs names to drop or alter a constraint later).
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def _in_list(column: str, values: tuple[str, ...]) -> str:
    quoted = ", ".join(f"'{v}'" for v in values)
    return f"{column} IN ({quoted})"


class UTCDateTime(TypeDecorator[dt.datetime]):
    """A timestamp that is always UTC going in and aware UTC coming out, on every backend."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: dt.datetime | None, dialect) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.timezone.utc)
        value = value.astimezone(dt.timezone.utc)
        # SQLite would store the offset-less text anyway; normalising here keeps comparisons
        # between stored values and bound parameters consistent.
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def result_processor(self, dialect, coltype):
        parse = super().result_processor(dialect, coltype)
        if parse is None:
            return None

        def tolerant(value):
            try:
                return parse(value)
            except (ValueError, TypeError):  # a row written by hand or by another tool: shown, not fatal
                return UNREADABLE_TIME
        return tolerant

    def process_result_value(self, value: dt.datetime | None, dialect) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=dt.timezone.utc)
        return value.astimezone(dt.timezone.utc)


# what an unreadable stored timestamp reads as: the earliest time, so it sorts first and shows as odd
UNREADABLE_TIME = dt.datetime.min.replace(tzinfo=dt.timezone.utc)


class TolerantJSON(TypeDecorator):
    """JSON whose unreadable stored text (edited by hand, written by another tool) reads as
    ``{"unreadable": <the text's start>}`` instead of failing every query that touches the row."""

    impl = JSON
    cache_ok = True

    def result_processor(self, dialect, coltype):
        parse = self.impl_instance.result_processor(dialect, coltype)

        def tolerant(value):
            try:
                return parse(value) if parse is not None else value
            except (ValueError, TypeError, RecursionError):
                return {"unreadable": str(value)[:200]}
        return tolerant


class RunStatusColumn(TypeDecorator[RunStatus]):
    """A run's status: plain text in the database, ``RunStatus`` in Python.

    Binding the enum's text explicitly keeps drivers from guessing how to store an ``Enum``
    (psycopg would store its *name*, ``STARTED``).
    """

    impl = String
    cache_ok = True

    def process_bind_param(self, value: RunStatus | str | None, dialect) -> str | None:
        return None if value is None else RunStatus(value).value

    def process_result_value(self, value: str | None, dialect) -> RunStatus | None:
        return None if value is None else status_of(value)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {dt.datetime: UTCDateTime(), dict[str, Any]: TolerantJSON(), list[Any]: TolerantJSON()}


class Run(Base):
    """One execution of the job."""

    __tablename__ = "runs"
    __table_args__ = (
        CheckConstraint(_in_list("status", RunStatus.values()), name="status"),
        Index("ix_runs_status_started_at", "status", "started_at"),
        Index("ix_runs_sweep_id_job_num", "sweep_id", "job_num"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    status: Mapped[RunStatus] = mapped_column(RunStatusColumn(16))
    started_at: Mapped[dt.datetime] = mapped_column(index=True)
    ended_at: Mapped[dt.datetime | None]
    tool_version: Mapped[str] = mapped_column(String(64))
    host: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    user: Mapped[str | None] = mapped_column(String(255))
    overrides: Mapped[list[Any]]
    config: Mapped[dict[str, Any]]
    sweep_id: Mapped[str | None] = mapped_column(String(255))
    job_num: Mapped[int | None] = mapped_column(Integer)
    output_dir: Mapped[str] = mapped_column(Text)
    source_devices: Mapped[int | None] = mapped_column(Integer)
    target_devices: Mapped[int | None] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)

    events: Mapped[list[Event]] = relationship(back_populates="run", cascade="all, delete-orphan",
                                               passive_deletes=True, order_by="Event.id")
    ranks: Mapped[list[RunRank]] = relationship(back_populates="run", cascade="all, delete-orphan",
                                                passive_deletes=True, order_by="RunRank.target_rank")
    plan: Mapped[RunPlan | None] = relationship(back_populates="run", cascade="all, delete-orphan",
                                                passive_deletes=True)


class RunPlan(Base):
    """The whole plan a run executed, as the plain JSON the planner produced."""

    __tablename__ = "run_plans"

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    plan: Mapped[dict[str, Any]]

    run: Mapped[Run] = relationship(back_populates="plan")


class RunRank(Base):
    """The rank map of a run: which source ranks one target rank was assembled from."""

    __tablename__ = "run_ranks"

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    target_rank: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    source_ranks: Mapped[list[Any]]
    bytes_read: Mapped[int | None] = mapped_column(BigInteger)
    bytes_written: Mapped[int | None] = mapped_column(BigInteger)

    run: Mapped[Run] = relationship(back_populates="ranks")


class Artifact(Base):
    """One file content, whatever paths it has been seen at."""

    __tablename__ = "artifacts"
    __table_args__ = (
        UniqueConstraint("hash_algo", "digest", "size"),
        CheckConstraint(_in_list("kind", ARTIFACT_KINDS), name="kind"),
        Index("ix_artifacts_digest", "digest"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    hash_algo: Mapped[str] = mapped_column(String(16))
    digest: Mapped[str] = mapped_column(String(128))
    size: Mapped[int] = mapped_column(BigInteger)
    # Kind and rank as first recorded; each use keeps its own role and rank on the event,
    # because a run's output becomes the next run's source checkpoint.
    kind: Mapped[str] = mapped_column(String(32))
    rank: Mapped[int | None] = mapped_column(Integer)
    first_recorded_at: Mapped[dt.datetime]

    locations: Mapped[list[ArtifactLocation]] = relationship(
        back_populates="artifact", cascade="all, delete-orphan", passive_deletes=True,
        order_by="ArtifactLocation.first_seen")
    events: Mapped[list[Event]] = relationship(back_populates="artifact", passive_deletes=True)


class ArtifactLocation(Base):
    """A path at which an artifact's content was seen, and when."""

    __tablename__ = "artifact_locations"
    __table_args__ = (UniqueConstraint("artifact_id", "path"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    artifact_id: Mapped[int] = mapped_column(ForeignKey("artifacts.id", ondelete="CASCADE"))
    path: Mapped[str] = mapped_column(Text, index=True)
    first_seen: Mapped[dt.datetime]
    last_seen: Mapped[dt.datetime]

    artifact: Mapped[Artifact] = relationship(back_populates="locations")


class Event(Base):
    """A run read (input) or wrote (output) an artifact, in some role, at some path."""

    __tablename__ = "events"
    __table_args__ = (
        CheckConstraint(_in_list("direction", DIRECTIONS), name="direction"),
        CheckConstraint(_in_list("role", ARTIFACT_KINDS), name="role"),
        UniqueConstraint("run_id", "direction", "path"),
        Index("ix_events_artifact_id_direction", "artifact_id", "direction"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    artifact_id: Mapped[int] = mapped_column(ForeignKey("artifacts.id", ondelete="CASCADE"))
    direction: Mapped[str] = mapped_column(String(8))
    role: Mapped[str] = mapped_column(String(32))
    rank: Mapped[int | None] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)
    recorded_at: Mapped[dt.datetime]
    # An output the run copied from one of its inputs (the target strategy given as a file): its bytes
    # are not the run's product, so ancestry never crosses to the run through them (see ``audit.trace``).
    copied: Mapped[bool] = mapped_column(Boolean, server_default=false(), default=False)

    run: Mapped[Run] = relationship(back_populates="events")
    artifact: Mapped[Artifact] = relationship(back_populates="events")


class RunFingerprint(Base):
    """The layout-independent fingerprint of one parameter of a run, in its sources or in its outputs."""

    __tablename__ = "run_fingerprints"
    __table_args__ = (
        CheckConstraint(_in_list("side", FINGERPRINT_SIDES), name="side"),
        {"sqlite_with_rowid": False},
    )

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    side: Mapped[str] = mapped_column(String(8), primary_key=True)
    name: Mapped[str] = mapped_column(Text, primary_key=True)
    digest: Mapped[str] = mapped_column(String(64))
    algorithm: Mapped[str] = mapped_column(String(32))


class LoadFingerprint(Base):
    """A load's share of one parameter's fingerprint: the part of the global tensor that the loading
    rank holds (``box``: ``start:stop`` per dim, comma-separated), fingerprinted where it lies in the
    parameter (``core.fingerprint_shares``). The shares of all target ranks add up to the parameter's
    fingerprint, so a load says what it read in the terms a conversion's ``run_fingerprints`` use."""

    __tablename__ = "load_fingerprints"
    __table_args__ = ({"sqlite_with_rowid": False},)

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    name: Mapped[str] = mapped_column(Text, primary_key=True)
    digest: Mapped[str] = mapped_column(String(64))
    algorithm: Mapped[str] = mapped_column(String(32))
    dtype: Mapped[str] = mapped_column(String(32))
    shape: Mapped[str] = mapped_column(Text)  # the global shape, comma-separated ("" for a scalar)
    box: Mapped[str] = mapped_column(Text)
