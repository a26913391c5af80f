"""Lineage in both directions: where a file came from, and what was built from it.

Walks go by content, so they cross copies and moves. Backwards (``ANCESTORS``): a content ←
the runs that made it ← their inputs ← ..., down to the original files no recorded run made.
Forwards (``DESCENDANTS``): a content → the runs that read it → the outputs they made → ..., up to
the final files no recorded run read. Any number of hops.

Only bytes a run *made* tie it to others by content. An output a run copied from its inputs (the
target strategy it was given, written beside its outputs: ``Event.copied``) is listed among the
run's files but never links: two conversions of unrelated checkpoints to one target strategy copy
the same bytes, and linking through them would make each the other's ancestor.

A lineage is a DAG with shared parts (the four outputs of one run all feed the next), so each
run is expanded once; later mentions carry ``expanded_elsewhere`` and no files. That also ends
cycles, which do happen: resharding 8→4→8 can reproduce the original files bit for bit, making
a file its own ancestor.

The result keeps the tree (for text), flat lists of runs and related contents (for scripts),
and the end files: one per content *and* rank, with every path it was used at, so that data-
parallel replicas (equal bytes, different ranks) are separate files while one strategy used at
two paths is one file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from reshard_job.audit.entities import ANCESTORS, DESCENDANTS, KIND_ORDER, STRATEGY_KINDS, ArtifactInfo, FileUse, RunInfo, iso
from reshard_job.lineage.errors import UnknownRunError
from reshard_job.audit.lookup import ContentSubject, DirectorySubject, Root, RunSubject, Subject, artifact_info, resolve
from reshard_job.lineage.models import Artifact, Event, Run
from reshard_job.audit.queries import run_files

__all__ = ["ANCESTORS", "DESCENDANTS", "Trace", "TraceHop", "TraceNode", "trace", "trace_reference"]

# JSON names per direction. The ancestor names are those of the first release of ``trace --json``.
_NAMES = {
    ANCESTORS: {"links": "produced_by", "end": "original", "next": "inputs", "related": "ancestors",
                "ends": "original_sources"},
    DESCENDANTS: {"links": "used_by", "end": "final", "next": "outputs", "related": "descendants",
                  "ends": "final_outputs"},
}


@dataclass
class TraceHop:
    """A run on the walk, with all its recorded files; ``next`` holds the files the walk goes on
    to (its inputs backwards, its outputs forwards) where the run is expanded."""

    run: RunInfo
    files: list[FileUse]
    expanded_elsewhere: bool
    next: list[TraceNode] = field(default_factory=list)

    @property
    def source_checkpoints(self) -> list[FileUse]:
        return [f for f in self.files if f.direction == "input" and f.kind == "source_checkpoint"]

    @property
    def strategy_files(self) -> list[FileUse]:
        inputs = [f for f in self.files if f.direction == "input" and f.kind in STRATEGY_KINDS]
        return inputs + [f for f in self.files if f.direction == "output" and f.kind in STRATEGY_KINDS]

    def summary_json(self) -> dict[str, Any]:
        run = self.run
        return {
            "run_id": run.id,
            "status": run.status.value,
            "started_at": iso(run.started_at),
            "ended_at": iso(run.ended_at),
            "source_devices": run.source_devices,
            "target_devices": run.target_devices,
            "output_dir": run.output_dir,
            "tool_version": run.tool_version,
            "source_checkpoints": [f.to_json() for f in self.source_checkpoints],
            "strategy_files": [{**f.to_json(), "direction": f.direction} for f in self.strategy_files],
        }

    def to_json(self, direction: str) -> dict[str, Any]:
        return {**self.summary_json(), "expanded_elsewhere": self.expanded_elsewhere,
                _NAMES[direction]["next"]: [node.to_json(direction) for node in self.next]}


@dataclass
class TraceNode:
    """A file on the walk: its content, the path and role it was reached through, and the runs
    that wrote it (backwards) or read it (forwards)."""

    artifact: ArtifactInfo
    path: str | None
    role: str
    rank: int | None
    hops: list[TraceHop] = field(default_factory=list)

    @property
    def is_end(self) -> bool:
        return not self.hops

    def to_json(self, direction: str) -> dict[str, Any]:
        names = _NAMES[direction]
        return {**self.artifact.to_json(), "path": self.path, "role": self.role, "rank": self.rank,
                names["end"]: self.is_end, names["links"]: [hop.to_json(direction) for hop in self.hops]}


@dataclass(frozen=True)
class RelatedContent:
    """A content reached by the walk, at its shortest distance (in runs) from the start."""

    artifact: ArtifactInfo
    depth: int
    is_end: bool


@dataclass
class EndFile:
    """A file at the end of the walk (original source, or final output): one content at one rank."""

    kind: str
    rank: int | None
    size: int
    hash_algo: str
    digest: str
    paths: list[str]

    @property
    def sha256(self) -> str | None:
        return self.digest if self.hash_algo == "sha256" else None

    def to_json(self) -> dict[str, Any]:
        return {"path": self.paths[0] if self.paths else None, "paths": list(self.paths), "kind": self.kind,
                "rank": self.rank, "size": self.size, "hash_algo": self.hash_algo, "digest": self.digest,
                "sha256": self.sha256}


@dataclass
class Trace:
    direction: str
    query: dict
    roots: list[TraceNode]
    runs: list[TraceHop]
    related: list[RelatedContent]
    ends: list[EndFile]
    # A file or content has one root; an output directory or a run has several (or none).
    single_root: bool = True
    # Set when the walk started from a run: that run, expanded.
    subject_run: TraceHop | None = None

    def to_json(self) -> dict[str, Any]:
        names = _NAMES[self.direction]
        result: dict[str, Any] = {"direction": self.direction, "query": self.query}
        if self.single_root and len(self.roots) == 1:
            result["root"] = self.roots[0].to_json(self.direction)
        else:
            result["roots"] = [root.to_json(self.direction) for root in self.roots]
        result["runs"] = [hop.summary_json() for hop in self.runs]
        result[names["related"]] = [{**r.artifact.to_json(), "depth": r.depth, names["end"]: r.is_end}
                                    for r in self.related]
        result[names["ends"]] = [end.to_json() for end in self.ends]
        return result


class _Walker:
    def __init__(self, session: Session, direction: str):
        if direction not in _NAMES:
            raise ValueError(f"unknown direction {direction!r}")
        self.session = session
        self.direction = direction
        self.expanded: set[str] = set()
        self.runs: list[TraceHop] = []
        self.related: dict[int, RelatedContent] = {}
        self.ends: dict[tuple, EndFile] = {}
        self._artifacts: dict[int, ArtifactInfo] = {}
        self._files: dict[str, list[FileUse]] = {}

    @property
    def _linking_event(self) -> str:
        """The event that links a content to the next runs: written by (backwards), read by (forwards)."""
        return "output" if self.direction == ANCESTORS else "input"

    @property
    def _next_side(self) -> str:
        return "input" if self.direction == ANCESTORS else "output"

    def artifact(self, artifact_id: int) -> ArtifactInfo:
        if artifact_id not in self._artifacts:
            self._artifacts[artifact_id] = artifact_info(self.session, self.session.get(Artifact, artifact_id))
        return self._artifacts[artifact_id]

    def files(self, run_id: str) -> list[FileUse]:
        if run_id not in self._files:
            self._files[run_id] = run_files(self.session, run_id)
        return self._files[run_id]

    def linked_runs(self, artifact_id: int, path: str | None) -> list[Run]:
        """The runs that made (backwards) or read (forwards) this content, as the file at `path`
        (None: the content, wherever it was)."""
        # Only runs that made these bytes: a run that merely copied them (a target strategy written
        # beside its outputs) did not produce them from its sources.
        uses = self.session.execute(select(Event.run_id, Event.path).where(
            Event.artifact_id == artifact_id, Event.direction == self._linking_event, Event.copied.is_(False))).all()
        if path is not None:
            uses = self._of_this_file(artifact_id, path, uses)
        ids = sorted({run_id for run_id, _ in uses})
        # (by ids only: PostgreSQL cannot compare the JSON columns of whole rows for DISTINCT)
        return list(self.session.scalars(select(Run).where(Run.id.in_(ids)).order_by(Run.started_at, Run.id)))

    def _of_this_file(self, artifact_id: int, path: str, uses: list) -> list:
        """What produced *this* file: equal bytes that other runs made elsewhere (the same strategy
        compiled twice, say) are another file. Crossing to them by content is right only where
        no run made the bytes at this path: a copy made outside any run."""
        if self.direction == ANCESTORS:
            return [use for use in uses if use[1] == path] or uses
        # forwards: a run that read these bytes where another run made them read that run's file
        makers: dict[str, set[str]] = {}
        for run_id, made_at in self.session.execute(select(Event.run_id, Event.path).where(
                Event.artifact_id == artifact_id, Event.direction == "output", Event.copied.is_(False))):
            makers.setdefault(made_at, set()).add(run_id)
        mine = makers.get(path, set())
        return [use for use in uses if use[1] == path or use[1] not in makers or makers[use[1]] & mine]

    def node(self, root: Root, depth: int) -> TraceNode:
        info = self.artifact(root.artifact_id)
        path = root.path or (info.paths[-1] if info.paths else None)
        node = TraceNode(info, path, root.kind or info.kind, root.rank if root.rank is not None else info.rank)
        runs = self.linked_runs(info.id, root.path)
        if depth > 0:
            seen = self.related.get(info.id)
            if seen is None or depth < seen.depth:
                self.related[info.id] = RelatedContent(info, depth, not runs)
            if not runs:
                end = self.ends.setdefault((info.digest, info.size, node.role, node.rank), EndFile(
                    node.role, node.rank, info.size, info.hash_algo, info.digest, []))
                if path is not None and path not in end.paths:
                    end.paths.append(path)
        node.hops = [self.hop(run, depth) for run in runs]
        return node

    def hop(self, run: Run, depth: int) -> TraceHop:
        info = RunInfo.from_model(run)
        files = self.files(run.id)
        if run.id in self.expanded:
            return TraceHop(info, files, expanded_elsewhere=True)
        self.expanded.add(run.id)
        hop = TraceHop(info, files, expanded_elsewhere=False)
        self.runs.append(hop)
        # Forwards, a copy is not built from what the run read: the walk does not go on through it.
        hop.next = [self.node(Root(f.artifact_id, f.path, f.kind, f.rank), depth + 1)
                    for f in files if f.direction == self._next_side and not f.copied]
        return hop

    def result(self, query: dict, roots: list[TraceNode], **extra) -> Trace:
        related = sorted(self.related.values(),
                         key=lambda r: (r.depth, r.artifact.kind, r.artifact.rank or 0, r.artifact.digest))
        ends = sorted(self.ends.values(),
                      key=lambda e: (KIND_ORDER.get(e.kind, 9), e.rank is None, e.rank or 0, e.paths[:1], e.digest))
        return Trace(self.direction, query, roots, self.runs, related, ends, **extra)


def trace(session: Session, subject: Subject, direction: str = ANCESTORS) -> Trace:
    """The lineage of `subject` (see ``lookup.resolve``) in `direction`."""
    walker = _Walker(session, direction)
    if isinstance(subject, RunSubject):
        return _trace_run(session, walker, subject)
    roots = [subject.root] if isinstance(subject, ContentSubject) else list(subject.roots)
    nodes = [walker.node(root, depth=0) for root in roots]
    return walker.result(dict(subject.query), nodes, single_root=not isinstance(subject, DirectorySubject))


def _trace_run(session: Session, walker: _Walker, subject: RunSubject) -> Trace:
    """Start from a run: it is expanded in the walk's direction, and the files on its other side
    (its outputs backwards, its inputs forwards) are the roots, linked through it alone."""
    run = session.get(Run, subject.run_id)
    if run is None:
        raise UnknownRunError(subject.run_id)
    hop = walker.hop(run, depth=0)
    other_side = "output" if walker.direction == ANCESTORS else "input"
    roots = []
    for f in (f for f in hop.files if f.direction == other_side and not f.copied):
        link = hop if not roots else TraceHop(hop.run, hop.files, expanded_elsewhere=True)
        roots.append(TraceNode(walker.artifact(f.artifact_id), f.path, f.kind, f.rank, [link]))
    return walker.result(dict(subject.query), roots, single_root=False, subject_run=hop)


def trace_reference(session: Session, ref: str, direction: str = ANCESTORS) -> Trace:
    """Trace what `ref` names: a path, an output directory, a sha256 (prefix) or a run id (prefix)."""
    return trace(session, resolve(session, ref), direction)
