"""Is the file on disk still the one recorded? Re-read the bytes and compare.

Three subjects: a run (its recorded outputs, optionally its inputs), a file path (against the
content last recorded at that path), and an output directory (every file its ``manifest.json``
lists, against the sha256 listed there, and the manifest itself, which must be a content the
lineage database recorded: a manifest edited to match edited files is caught here). Verification
never trusts a cache: every byte is read through ``reading.content_digest``.

Each file ends in one state: ``ok``, ``missing``, ``changed``, ``unreadable``, or (for a
directory's manifest) ``unrecorded``; the report is intact only if all are ``ok``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from reshard_job.audit.entities import iso
from reshard_job.lineage.errors import AmbiguousRunError, LineageError, UnknownRunError
from reshard_job.audit.lookup import artifact_at_path, artifacts_by_digest, resolve_run_id
from reshard_job.audit.manifests import OutputListing, node_listings, read_listing
from reshard_job.formats.manifest_file import MANIFEST_FILE
from reshard_job.lineage.models import Event, Run
from reshard_job.audit.queries import run_files
from reshard_job.audit.reading import absolute, content_digest, exists, file_size, is_directory

STATES = ("ok", "missing", "changed", "unreadable", "unrecorded")


@dataclass
class FileCheck:
    """One file compared with its record."""

    path: str
    expected_sha256: str
    expected_size: int
    state: str = "ok"
    actual_sha256: str | None = None
    actual_size: int | None = None
    detail: str | None = None
    # What the record says about the file, as far as the subject tells.
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        entry = {"path": self.path, "expected_sha256": self.expected_sha256, "expected_size": self.expected_size,
                 "actual_sha256": self.actual_sha256, "actual_size": self.actual_size, "state": self.state}
        if self.detail is not None:
            entry["detail"] = self.detail
        return {**entry, **self.extra}


@dataclass
class VerifyReport:
    files: list[FileCheck]
    run_id: str | None = None
    run_status: str | None = None
    path: str | None = None  # the file or directory verified, when not a run

    def count(self, state: str) -> int:
        return sum(1 for f in self.files if f.state == state)

    @property
    def intact(self) -> bool:
        return all(f.state == "ok" for f in self.files)

    @property
    def problems(self) -> list[FileCheck]:
        return [f for f in self.files if f.state != "ok"]

    def to_json(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "run_status": self.run_status, "path": self.path, "intact": self.intact,
                "checked": len(self.files), **{state: self.count(state) for state in STATES},
                "files": [f.to_json() for f in self.files]}


def check_file(path: str, expected_sha256: str, expected_size: int, **extra: Any) -> FileCheck:
    """Compare one file on disk with its record."""
    check = FileCheck(path, expected_sha256.lower(), expected_size, extra=extra)
    try:
        check.actual_size = file_size(path)
    except FileNotFoundError:
        check.state = "missing"
        return check
    except OSError as exc:
        check.state, check.detail = "unreadable", exc.strerror or str(exc)
        return check
    try:
        check.actual_sha256, check.actual_size = content_digest(path)
    except IsADirectoryError:
        check.state, check.detail = "changed", "is a directory"
        return check
    except OSError as exc:
        check.state, check.detail = "unreadable", exc.strerror or str(exc)
        return check
    if (check.actual_sha256, check.actual_size) != (check.expected_sha256, expected_size):
        check.state = "changed"
    return check


def verify_run(session: Session, run_id: str, *, include_inputs: bool = False) -> VerifyReport:
    """Re-hash a run's recorded outputs (and optionally inputs) and compare with the record."""
    run = session.get(Run, run_id)
    if run is None:
        raise UnknownRunError(run_id)
    directions = ["output", "input"] if include_inputs else ["output"]
    files = [check_file(f.path, f.digest, f.size, direction=direction, kind=f.kind, rank=f.rank)
             for direction in directions for f in run_files(session, run_id, direction)]
    if not files:
        what = "files" if include_inputs else "outputs"
        raise LineageError(f"run {run_id} is {run.status} and has no recorded {what} to verify")
    return VerifyReport(files, run_id=run_id, run_status=str(run.status))


def verify_path(session: Session, path: str) -> VerifyReport:
    """Compare the file at `path` with the content last recorded at that path."""
    where = absolute(path)
    recorded = artifact_at_path(session, where)
    if recorded is None:
        raise LineageError(f"{where}: no file was ever recorded at this path")
    artifact, location = recorded
    runs = list(session.scalars(
        select(Event.run_id).where(Event.artifact_id == artifact.id,
                                   or_(Event.path == location.path, Event.path == where))
        .distinct().order_by(Event.run_id)))
    checked = check_file(where, artifact.digest, artifact.size, kind=artifact.kind, rank=artifact.rank,
                         last_recorded=iso(location.last_seen), run_ids=runs)
    return VerifyReport([checked], path=where)


def _manifest_check(session: Session, listing: OutputListing) -> FileCheck:
    """The manifest itself: its bytes must be a content a recorded run wrote."""
    producers = []
    for artifact in artifacts_by_digest(session, listing.manifest_sha256, listing.manifest_size):
        producers += session.scalars(select(Event.run_id).where(Event.artifact_id == artifact.id,
                                                                Event.direction == "output")
                                     .distinct().order_by(Event.run_id))
    manifest = FileCheck(listing.manifest_path, listing.manifest_sha256, listing.manifest_size,
                         actual_sha256=listing.manifest_sha256, actual_size=listing.manifest_size,
                         extra={"kind": "manifest", "rank": None, "run_ids": producers})
    if listing.node is not None:
        manifest.extra["node"] = listing.node
    if not producers:
        manifest.state = "unrecorded"
        manifest.detail = "no recorded run wrote this manifest"
    return manifest


def _listed_checks(listing: OutputListing) -> list[FileCheck]:
    return [check_file(f.path, f.sha256, f.size, kind=f.kind, rank=f.rank, **({"node": f.node} if f.node else {}))
            for f in listing.files]


def verify_directory(session: Session, directory: str) -> VerifyReport:
    """Check every file an output directory's manifest lists, and that the manifest is recorded.

    With ``output.placement=per_node`` the files lie on the target nodes' disks: a node's
    directory is checked against the node manifests it holds (``manifest.<node>.json``, each of
    which must be recorded); the job's ``manifest.json``, where the driver left it there, only
    for being recorded, as its other files are on other machines."""
    nodes = node_listings(directory)
    listing = read_listing(directory) if not nodes or os.path.exists(os.path.join(directory, MANIFEST_FILE)) \
        else None
    if not nodes and listing.per_node:
        held = sorted({f.node for f in listing.files if f.node})
        raise LineageError(f"{listing.directory}: its files were written on the target nodes' own disks "
                           f"(output.placement=per_node); verify the same directory on each node "
                           f"({', '.join(held[:4])}{', ...' if len(held) > 4 else ''})")
    files, manifests = [], []
    for part in nodes or [listing]:
        files += _listed_checks(part)
        manifests.append(_manifest_check(session, part))
    if nodes and listing is not None:
        manifests.append(_manifest_check(session, listing))
    files = list({f.path: f for f in files}.values()) + manifests  # node manifests each list the strategy
    producers = [r for m in manifests for r in m.extra["run_ids"]]
    listing = listing or nodes[0]
    run_id = listing.run_id if listing.run_id in producers else (producers[0] if len(set(producers)) == 1 else None)
    status = None
    if run_id is not None:
        run = session.get(Run, run_id)
        status = None if run is None else str(run.status)
    return VerifyReport(files, run_id=run_id, run_status=status, path=listing.directory)


def verify(session: Session, ref: str, *, include_inputs: bool = False) -> VerifyReport:
    """Verify an output directory, a file path, or a run (id or unique prefix)."""
    if is_directory(ref):
        return verify_directory(session, ref)
    if os.sep in ref or exists(ref):
        return verify_path(session, ref)
    try:
        run_id = resolve_run_id(session, ref)
    except AmbiguousRunError:
        raise
    except LineageError as not_a_run:  # unknown, or too short for a prefix: maybe a file name
        if artifact_at_path(session, absolute(ref)) is not None:
            return verify_path(session, ref)
        if isinstance(not_a_run, UnknownRunError):
            raise LineageError(f"no run with id {ref!r} and no file recorded at {absolute(ref)}") from None
        raise
    return verify_run(session, run_id, include_inputs=include_inputs)
