"""Questions about runs: which runs match some filters, everything recorded about one, and
whether its recorded output fingerprints equal its source ones.

Functions take an open session and return read-side entities (``entities``, and the fingerprint
summaries defined here, which only these questions produce); nothing here prints or touches
files. Ancestry and descendants are in ``trace``, file checks in ``verify``, and turning what a
user typed into runs or contents in ``lookup``.
"""

from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, func, or_, select
from sqlalchemy.orm import Session

from reshard_job.audit.entities import FileUse, RankMapEntry, RunDetails, RunInfo, sorted_files
from reshard_job.lineage.errors import UnknownRunError
from reshard_job.lineage.load_shares import count_shares
from reshard_job.lineage.models import Artifact, Event, Run, RunFingerprint, RunPlan, RunRank
from reshard_job.audit.reading import path_forms
from reshard_job.lineage.status import RunStatus


@dataclass(frozen=True)
class RunFilter:
    """Which runs ``list_runs`` returns; every given field must match.

    ``output`` matches runs whose output directory is that path or lies under it (a sweep's
    directory selects all its jobs), and runs that wrote a file at that path. ``sweep_id`` is
    the sweep directory as recorded (absolute) or as given relative to the current directory.
    ``since``/``until`` bound the start time, ``[since, until)``; ``limit`` keeps the newest runs.
    """

    status: RunStatus | None = None
    since: dt.datetime | None = None
    until: dt.datetime | None = None
    output: str | None = None
    sweep_id: str | None = None
    user: str | None = None
    limit: int | None = None


def _path_forms(path: str) -> list[str]:
    return sorted(form.rstrip("/") or "/" for form in path_forms(path))


def list_runs(session: Session, run_filter: RunFilter = RunFilter()) -> list[RunInfo]:
    """Runs matching `run_filter`, oldest first."""
    query = select(Run)
    f = run_filter
    if f.status is not None:
        query = query.where(Run.status == RunStatus(f.status))
    if f.since is not None:
        query = query.where(Run.started_at >= f.since)
    if f.until is not None:
        query = query.where(Run.started_at < f.until)
    if f.user is not None:
        query = query.where(Run.user == f.user)
    if f.sweep_id is not None:
        query = query.where(Run.sweep_id.in_(sorted({f.sweep_id, os.path.abspath(f.sweep_id)})))
    if f.output is not None:
        conditions = []
        for path in _path_forms(f.output):
            conditions += [Run.output_dir == path,
                           Run.output_dir.startswith(path.rstrip("/") + "/", autoescape=True)]
        wrote_it = select(Event.run_id).where(Event.direction == "output", Event.path.in_(_path_forms(f.output)))
        query = query.where(or_(*conditions, Run.id.in_(wrote_it)))
    if f.limit is not None:
        # The newest `limit` runs, still listed oldest first.
        newest_first = query.order_by(Run.started_at.desc(), Run.id.desc()).limit(f.limit)
        runs = list(session.scalars(newest_first))[::-1]
    else:
        runs = list(session.scalars(query.order_by(Run.started_at, Run.id)))
    return [RunInfo.from_model(run) for run in runs]


def run_info(session: Session, run_id: str) -> RunInfo:
    run = session.get(Run, run_id)
    if run is None:
        raise UnknownRunError(run_id)
    return RunInfo.from_model(run)


def run_files(session: Session, run_id: str, direction: str | None = None) -> list[FileUse]:
    """The files a run read (``input``), wrote (``output``) or both (None), in listing order."""
    query = select(Event, Artifact).join(Artifact, Event.artifact_id == Artifact.id).where(Event.run_id == run_id)
    if direction is not None:
        query = query.where(Event.direction == direction)
    return sorted_files(FileUse.from_model(event, artifact) for event, artifact in session.execute(query))


def run_details(session: Session, run_id: str) -> RunDetails:
    """Everything recorded about the run with exactly this id."""
    run = session.get(Run, run_id)
    if run is None:
        raise UnknownRunError(run_id)
    files = run_files(session, run_id)
    ranks = session.scalars(select(RunRank).where(RunRank.run_id == run_id).order_by(RunRank.target_rank))
    plan = session.get(RunPlan, run_id)
    return RunDetails(
        run=RunInfo.from_model(run),
        overrides=tuple(run.overrides or ()),
        config=run.config,
        inputs=tuple(f for f in files if f.direction == "input"),
        outputs=tuple(f for f in files if f.direction == "output"),
        rank_map=tuple(RankMapEntry.from_model(row) for row in ranks),
        plan=None if plan is None else plan.plan,
    )


@dataclass(frozen=True)
class FingerprintMismatch:
    """An output parameter whose recorded fingerprint is not its source's (`source` None: the
    sources have no fingerprint of that name)."""

    name: str
    target: str
    source: str | None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "target": self.target, "source": self.source}


@dataclass(frozen=True)
class FingerprintSummary:
    """A run's recorded fingerprints: how many on each side, under which algorithm, and every
    output parameter whose fingerprint differs from its source's (none: the outputs hold exactly
    what the sources held). Nothing recorded (``recorded`` false) is a run from before them."""

    algorithm: str | None
    source: int
    target: int
    mismatches: tuple[FingerprintMismatch, ...]
    loaded: int = 0  # a load's shares: one per parameter its rank returned (``lineage.load_shares``)

    @property
    def recorded(self) -> bool:
        return self.source + self.target + self.loaded > 0

    @property
    def equal(self) -> bool:
        return not self.mismatches

    def to_json(self) -> dict[str, Any]:
        return {"algorithm": self.algorithm, "source": self.source, "target": self.target, "equal": self.equal,
                "mismatches": [m.to_json() for m in self.mismatches], "loaded": self.loaded}


def fingerprint_summary(session: Session, run_id: str) -> FingerprintSummary:
    """The run's fingerprints compared in the database itself (a join on the primary key), so a
    model of 600,000 parameters is never loaded to say that its outputs equal its sources."""
    table = RunFingerprint.__table__
    counts = {"source": 0, "target": 0}
    algorithms = set()
    for side, algorithm, count in session.execute(
            select(table.c.side, table.c.algorithm, func.count()).where(table.c.run_id == run_id)
            .group_by(table.c.side, table.c.algorithm)):
        counts[side] = counts.get(side, 0) + count
        algorithms.add(algorithm)
    target, source = table.alias("target"), table.alias("source")
    same_parameter = and_(source.c.run_id == target.c.run_id, source.c.side == "source",
                          source.c.name == target.c.name)
    query = (select(target.c.name, target.c.digest, source.c.digest)
             .select_from(target.outerjoin(source, same_parameter))
             .where(target.c.run_id == run_id, target.c.side == "target",
                    or_(source.c.digest.is_(None), source.c.digest != target.c.digest,
                        source.c.algorithm != target.c.algorithm))
             .order_by(target.c.name))
    mismatches = tuple(FingerprintMismatch(name, digest, source_digest)
                       for name, digest, source_digest in session.execute(query))
    loaded, load_algorithm = count_shares(session, run_id)
    if load_algorithm:
        algorithms.update(load_algorithm.split(", "))
    return FingerprintSummary(algorithm=", ".join(sorted(algorithms)) or None, source=counts["source"],
                              target=counts["target"], mismatches=mismatches, loaded=loaded)


@dataclass(frozen=True)
class ShownRun:
    """What ``audit show`` prints: everything recorded about a run, and its fingerprints' summary."""

    details: RunDetails
    fingerprints: FingerprintSummary

    def to_json(self) -> dict[str, Any]:
        return {**self.details.to_json(), "fingerprints": self.fingerprints.to_json()}


def shown_run(session: Session, run_id: str) -> ShownRun:
    return ShownRun(run_details(session, run_id), fingerprint_summary(session, run_id))
