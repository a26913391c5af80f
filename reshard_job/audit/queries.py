"""Questions about runs: which runs match some filters, and everything recorded about one.

Functions take an open session and return read-side entities (``entities``); nothing here
prints or touches files. Ancestry and descendants are in ``trace``, file checks in ``verify``,
and turning what a user typed into runs or contents in ``lookup``.
"""

from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from reshard_job.audit.entities import FileUse, RankMapEntry, RunDetails, RunInfo, sorted_files
from reshard_job.lineage.errors import UnknownRunError
from reshard_job.lineage.models import Artifact, Event, Run, RunPlan, RunRank
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
