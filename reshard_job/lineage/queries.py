"""Answers to lineage questions, as plain JSON-ready data: list, show, trace, verify.

These functions take an open session and return dicts and lists only (ISO-8601 UTC times, hex
digests), so the audit CLI can print them as tables or dump them as JSON, and tests can assert
on them directly; nothing here prints. ``trace`` and ``verify`` read files from disk because
their questions are about the disk ("what is this file?", "is it still what we wrote?").

Ancestry (``trace``) walks artifacts by content: artifact ← output event of run R ← input
events of R ← artifacts, recursively. A DAG can share ancestors (four outputs of one run feed
the next run), so each run is expanded once; later mentions carry ``expanded_elsewhere``. That
also cuts cycles, which do happen: resharding 8→4→8 can reproduce the original files bit for
bit, making a file its own ancestor.
"""

from __future__ import annotations

import datetime as dt
import os
from typing import Any

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from .errors import AmbiguousRunError, LineageError, UnknownRunError
from .digests import HASH_ALGO, looks_like_sha256
from .reading import content_digest as hash_file
from .models import Artifact, ArtifactLocation, Event, Run, RunPlan, RunRank

STRATEGY_ROLES = ("strategy", "merged_strategy")
_ROLE_ORDER = {"source_checkpoint": 0, "target_checkpoint": 1, "merged_strategy": 2, "strategy": 3, "manifest": 4}


def _iso(value: dt.datetime | None) -> str | None:
    return None if value is None else value.astimezone(dt.timezone.utc).isoformat()


# -- runs ----------------------------------------------------------------------------------------

def resolve_run_id(session: Session, ref: str) -> str:
    """The full id of the run that `ref` (a full id or a unique prefix) names."""
    ref = ref.strip()
    if not ref:
        raise UnknownRunError(ref)
    if session.get(Run, ref) is not None:
        return ref
    escaped = ref.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    matches = list(session.scalars(
        select(Run.id).where(Run.id.like(f"{escaped}%", escape="\\")).order_by(Run.id).limit(11)))
    if not matches:
        raise UnknownRunError(ref)
    if len(matches) > 1:
        raise AmbiguousRunError(ref, matches)
    return matches[0]


def run_summary(run: Run) -> dict[str, Any]:
    return {
        "id": run.id,
        "status": run.status,
        "started_at": _iso(run.started_at),
        "ended_at": _iso(run.ended_at),
        "source_devices": run.source_devices,
        "target_devices": run.target_devices,
        "output_dir": run.output_dir,
        "sweep_id": run.sweep_id,
        "job_num": run.job_num,
        "tool_version": run.tool_version,
        "host": run.host,
        "pid": run.pid,
        "user": run.user,
        "error": run.error,
    }


def list_runs(session: Session, *, status: str | None = None, since: dt.datetime | None = None,
              until: dt.datetime | None = None, limit: int | None = None) -> list[dict[str, Any]]:
    """Runs in start order, optionally filtered by status and a start-time window [since, until)."""
    query = select(Run)
    if status:
        query = query.where(Run.status == status)
    if since is not None:
        query = query.where(Run.started_at >= since)
    if until is not None:
        query = query.where(Run.started_at < until)
    query = query.order_by(Run.started_at, Run.id)
    if limit is not None:
        # The newest `limit` runs, still listed oldest first.
        newest_first = query.order_by(None).order_by(Run.started_at.desc(), Run.id.desc()).limit(limit)
        runs = list(session.scalars(newest_first))[::-1]
    else:
        runs = list(session.scalars(query))
    return [run_summary(run) for run in runs]


def _file_entry(event: Event, artifact: Artifact) -> dict[str, Any]:
    entry = {
        "path": event.path,
        "kind": event.role,
        "rank": event.rank,
        "size": artifact.size,
        "hash_algo": artifact.hash_algo,
        "digest": artifact.digest,
    }
    if artifact.hash_algo == HASH_ALGO:
        entry["sha256"] = artifact.digest
    return entry


def _sort_key(entry: dict[str, Any]) -> tuple:
    rank = entry["rank"]
    return (_ROLE_ORDER.get(entry["kind"], 9), rank is None, rank if rank is not None else 0, entry["path"])


def run_files(session: Session, run_id: str, direction: str) -> list[dict[str, Any]]:
    rows = session.execute(
        select(Event, Artifact).join(Artifact, Event.artifact_id == Artifact.id)
        .where(Event.run_id == run_id, Event.direction == direction)
    ).all()
    return sorted((_file_entry(event, artifact) for event, artifact in rows), key=_sort_key)


def run_details(session: Session, run_id: str) -> dict[str, Any]:
    """Everything recorded about the run with exactly this id."""
    run = session.get(Run, run_id)
    if run is None:
        raise UnknownRunError(run_id)
    details = run_summary(run)
    details["overrides"] = list(run.overrides or [])
    details["config"] = run.config
    details["inputs"] = run_files(session, run_id, "input")
    details["outputs"] = run_files(session, run_id, "output")
    details["rank_map"] = [
        {"target_rank": r.target_rank, "source_ranks": list(r.source_ranks), "bytes_read": r.bytes_read,
         "bytes_written": r.bytes_written}
        for r in session.scalars(select(RunRank).where(RunRank.run_id == run_id).order_by(RunRank.target_rank))
    ]
    plan = session.get(RunPlan, run_id)
    details["plan"] = None if plan is None else plan.plan
    return details


# -- artifacts -----------------------------------------------------------------------------------

def artifacts_by_digest(session: Session, digest: str, size: int | None = None) -> list[Artifact]:
    query = select(Artifact).where(Artifact.digest == digest.lower())
    if size is not None:
        query = query.where(Artifact.size == size)
    return list(session.scalars(query.order_by(Artifact.id)))


def artifact_at_path(session: Session, path: str) -> tuple[Artifact, ArtifactLocation] | None:
    """The artifact most recently seen at `path` (absolute, or resolved through symlinks)."""
    candidates = {os.path.abspath(path), os.path.realpath(path)}
    row = session.execute(
        select(Artifact, ArtifactLocation).join(ArtifactLocation, ArtifactLocation.artifact_id == Artifact.id)
        .where(ArtifactLocation.path.in_(sorted(candidates)))
        .order_by(ArtifactLocation.last_seen.desc(), ArtifactLocation.id.desc()).limit(1)
    ).first()
    return None if row is None else (row[0], row[1])


def _artifact_entry(session: Session, artifact: Artifact) -> dict[str, Any]:
    paths = list(session.scalars(
        select(ArtifactLocation.path).where(ArtifactLocation.artifact_id == artifact.id)
        .order_by(ArtifactLocation.first_seen, ArtifactLocation.id)))
    entry = {
        "hash_algo": artifact.hash_algo,
        "digest": artifact.digest,
        "size": artifact.size,
        "kind": artifact.kind,
        "rank": artifact.rank,
        "paths": paths,
    }
    if artifact.hash_algo == HASH_ALGO:
        entry["sha256"] = artifact.digest
    return entry


# -- trace ---------------------------------------------------------------------------------------

class _Tracer:
    def __init__(self, session: Session):
        self.session = session
        self.expanded_runs: set[str] = set()
        self.runs: list[dict[str, Any]] = []
        self.ancestors: dict[int, dict[str, Any]] = {}
        # Original files by (path, digest): byte-identical replicas (data-parallel ranks) are one
        # artifact but several files, and users count files.
        self.originals: dict[tuple[str | None, str], dict[str, Any]] = {}

    def node(self, artifact: Artifact, *, path: str | None, role: str | None, rank: int | None,
             depth: int) -> dict[str, Any]:
        entry = _artifact_entry(self.session, artifact)
        node = {**entry, "path": path or (entry["paths"][-1] if entry["paths"] else None),
                "role": role or artifact.kind, "rank": rank if rank is not None else artifact.rank}
        # DISTINCT over ids only: PostgreSQL cannot compare the JSON columns of whole rows.
        producer_ids = select(Event.run_id).where(Event.artifact_id == artifact.id, Event.direction == "output")
        producers = self.session.scalars(
            select(Run).where(Run.id.in_(producer_ids)).order_by(Run.started_at, Run.id)).all()
        node["original"] = not producers
        if depth > 0:
            seen = self.ancestors.get(artifact.id)
            if seen is None:
                self.ancestors[artifact.id] = {**entry, "depth": depth, "original": not producers}
            else:
                seen["depth"] = min(seen["depth"], depth)
            if not producers:
                self.originals.setdefault((node["path"], artifact.digest), {
                    "path": node["path"], "kind": node["role"], "rank": node["rank"], "size": artifact.size,
                    "hash_algo": artifact.hash_algo, "digest": artifact.digest, "sha256": entry.get("sha256")})
        node["produced_by"] = [self.hop(run, depth) for run in producers]
        return node

    def hop(self, run: Run, depth: int) -> dict[str, Any]:
        inputs = self.session.execute(
            select(Event, Artifact).join(Artifact, Event.artifact_id == Artifact.id)
            .where(Event.run_id == run.id, Event.direction == "input")).all()
        outputs = self.session.execute(
            select(Event, Artifact).join(Artifact, Event.artifact_id == Artifact.id)
            .where(Event.run_id == run.id, Event.direction == "output", Event.role.in_(STRATEGY_ROLES))).all()
        files = sorted((_file_entry(e, a) for e, a in inputs), key=_sort_key)
        hop = {
            "run_id": run.id,
            "status": run.status,
            "started_at": _iso(run.started_at),
            "ended_at": _iso(run.ended_at),
            "source_devices": run.source_devices,
            "target_devices": run.target_devices,
            "output_dir": run.output_dir,
            "tool_version": run.tool_version,
            "source_checkpoints": [f for f in files if f["kind"] == "source_checkpoint"],
            "strategy_files": [{**f, "direction": "input"} for f in files if f["kind"] in STRATEGY_ROLES]
            + [{**_file_entry(e, a), "direction": "output"} for e, a in outputs],
            "expanded_elsewhere": run.id in self.expanded_runs,
            "inputs": [],
        }
        if run.id in self.expanded_runs:
            return hop
        self.expanded_runs.add(run.id)
        self.runs.append({k: v for k, v in hop.items() if k not in ("inputs", "expanded_elsewhere")})
        ordered = sorted(inputs, key=lambda ea: _sort_key(_file_entry(*ea)))
        hop["inputs"] = [self.node(artifact, path=event.path, role=event.role, rank=event.rank, depth=depth + 1)
                         for event, artifact in ordered]
        return hop


def trace_artifact(session: Session, artifact: Artifact, *, path: str | None = None) -> dict[str, Any]:
    """The ancestry tree of `artifact`, plus flat lists of its runs, its ancestor contents
    (``ancestors``, one per artifact) and the original files it came from (``original_sources``,
    one per path, so replicas with equal bytes are each listed)."""
    tracer = _Tracer(session)
    root = tracer.node(artifact, path=path, role=None, rank=None, depth=0)
    ancestors = sorted(tracer.ancestors.values(), key=lambda a: (a["depth"], a["kind"], a["rank"] or 0, a["digest"]))
    return {
        "root": root,
        "runs": tracer.runs,
        "ancestors": ancestors,
        "original_sources": sorted(tracer.originals.values(), key=_sort_key),
    }


def trace(session: Session, ref: str) -> dict[str, Any]:
    """Trace a file path (looked up by its content) or a sha256 hex digest back to its origins."""
    if looks_like_sha256(ref) and not os.path.exists(ref):
        found = artifacts_by_digest(session, ref)
        if not found:
            raise LineageError(f"no file with sha256 {ref.lower()} in the lineage database")
        # Equal digests of different sizes would take a broken hash; the first is the answer.
        result = trace_artifact(session, found[0])
        result["query"] = {"sha256": ref.lower(), "path": None}
        return result

    path = os.path.abspath(ref)
    if not os.path.exists(path):
        recorded = artifact_at_path(session, path)
        if recorded is None:
            raise LineageError(f"{path}: no such file, and no file was ever recorded at this path")
        result = trace_artifact(session, recorded[0], path=path)
        result["query"] = {"path": path, "sha256": recorded[0].digest,
                           "note": "file not on disk; traced what was recorded at this path"}
        return result
    if os.path.isdir(path):
        raise LineageError(f"{path}: is a directory; trace a file or a sha256")
    digest, size = hash_file(path)
    found = artifacts_by_digest(session, digest, size)
    if not found:
        recorded = artifact_at_path(session, path)
        if recorded is not None:
            raise LineageError(f"{path}: content sha256 {digest} is not in the lineage database; this path was "
                               f"recorded with sha256 {recorded[0].digest}, so the file changed since")
        raise LineageError(f"{path}: content sha256 {digest} is not in the lineage database")
    result = trace_artifact(session, found[0], path=path)
    result["query"] = {"path": path, "sha256": digest}
    return result


# -- verify --------------------------------------------------------------------------------------

def check_file(path: str, expected_digest: str, expected_size: int) -> dict[str, Any]:
    """Compare one file on disk with its record: ok, missing, changed or unreadable."""
    result: dict[str, Any] = {"path": path, "expected_sha256": expected_digest, "expected_size": expected_size,
                              "actual_sha256": None, "actual_size": None}
    try:
        actual_size = os.path.getsize(path)
    except FileNotFoundError:
        return {**result, "state": "missing"}
    except OSError as exc:
        return {**result, "state": "unreadable", "detail": exc.strerror}
    result["actual_size"] = actual_size
    try:
        digest, size = hash_file(path)
    except IsADirectoryError:
        return {**result, "state": "changed", "detail": "is a directory"}
    except OSError as exc:
        return {**result, "state": "unreadable", "detail": exc.strerror}
    result["actual_sha256"], result["actual_size"] = digest, size
    same = digest == expected_digest.lower() and size == expected_size
    return {**result, "state": "ok" if same else "changed"}


def _verdict(files: list[dict[str, Any]]) -> dict[str, Any]:
    states = ("ok", "missing", "changed", "unreadable")
    counts = {state: sum(1 for f in files if f["state"] == state) for state in states}
    return {"intact": counts["ok"] == len(files), "checked": len(files), **counts, "files": files}


def verify_run(session: Session, run_id: str, *, include_inputs: bool = False) -> dict[str, Any]:
    """Re-hash a run's recorded outputs (and optionally inputs) and compare with the record."""
    run = session.get(Run, run_id)
    if run is None:
        raise UnknownRunError(run_id)
    directions = ["output", "input"] if include_inputs else ["output"]
    files = []
    for direction in directions:
        for entry in run_files(session, run_id, direction):
            checked = check_file(entry["path"], entry["digest"], entry["size"])
            files.append({**checked, "direction": direction, "kind": entry["kind"], "rank": entry["rank"]})
    if not files:
        what = "files" if include_inputs else "outputs"
        raise LineageError(f"run {run_id} is {run.status} and has no recorded {what} to verify")
    return {"run_id": run_id, "run_status": run.status, "path": None, **_verdict(files)}


def verify_path(session: Session, path: str) -> dict[str, Any]:
    """Compare the file at `path` with the content last recorded at that path."""
    absolute = os.path.abspath(path)
    recorded = artifact_at_path(session, absolute)
    if recorded is None:
        raise LineageError(f"{absolute}: no file was ever recorded at this path")
    artifact, location = recorded
    runs = list(session.scalars(
        select(Event.run_id).where(Event.artifact_id == artifact.id,
                                   or_(Event.path == location.path, Event.path == absolute))
        .distinct().order_by(Event.run_id)))
    checked = check_file(absolute, artifact.digest, artifact.size)
    checked.update(kind=artifact.kind, rank=artifact.rank, last_recorded=_iso(location.last_seen), run_ids=runs)
    return {"run_id": None, "run_status": None, "path": absolute, **_verdict([checked])}


def verify(session: Session, ref: str, *, include_inputs: bool = False) -> dict[str, Any]:
    """Verify a run (id or unique id prefix) or a single file path."""
    if os.sep in ref or os.path.exists(ref):
        return verify_path(session, ref)
    try:
        run_id = resolve_run_id(session, ref)
    except UnknownRunError:
        if artifact_at_path(session, os.path.abspath(ref)) is not None:
            return verify_path(session, ref)
        raise LineageError(f"no run with id {ref!r} and no file recorded at {os.path.abspath(ref)}") from None
    return verify_run(session, run_id, include_inputs=include_inputs)
