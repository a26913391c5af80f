"""The lineage as a graph to draw, and a deterministic layered layout for it. Pure: no I/O.

Vertices are runs and file contents; an edge goes from a file to each run that read it and from
a run to each file it wrote, so time flows along the edges. A content used at several paths or
ranks is one vertex listing them all, as the database records it.

Its layout (``layout.layered_layout``, re-exported here) places them in columns, time flowing
left to right, and routes every edge through the gaps between boxes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from reshard_job.audit.entities import ANCESTORS, KIND_ORDER, RunInfo
from reshard_job.audit.layout import Box, Layout, layered_layout

__all__ = ["Box", "Edge", "FileVertex", "Layout", "LineageGraph", "RunVertex", "file_key", "graph_of",
           "layered_layout", "run_key"]

if TYPE_CHECKING:  # the walker imports SQLAlchemy; drawing does not need it
    from reshard_job.audit.trace import Trace, TraceHop, TraceNode

FILE = "file"
RUN = "run"


# -- the graph -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class FileVertex:
    key: str
    hash_algo: str
    digest: str
    size: int
    kinds: tuple[str, ...]  # the roles it had in the drawn runs, first seen first
    ranks: tuple[int, ...]
    paths: tuple[str, ...]
    subject: bool  # where the walk started
    end: bool  # an original source (backwards) or a final output (forwards)

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "type": FILE, "hash_algo": self.hash_algo, "digest": self.digest,
                "size": self.size, "kinds": list(self.kinds), "ranks": list(self.ranks), "paths": list(self.paths),
                "subject": self.subject, "end": self.end}


@dataclass(frozen=True)
class RunVertex:
    key: str
    run: RunInfo
    subject: bool

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "type": RUN, **self.run.to_json(), "subject": self.subject}


@dataclass(frozen=True)
class Edge:
    source: str
    target: str

    def to_json(self) -> dict[str, Any]:
        return {"from": self.source, "to": self.target}


@dataclass(frozen=True)
class LineageGraph:
    direction: str
    title: str
    files: tuple[FileVertex, ...]
    runs: tuple[RunVertex, ...]
    edges: tuple[Edge, ...]

    @property
    def keys(self) -> list[str]:
        """Every vertex, in the fixed order the layout starts from: files by kind, rank and path, then runs by time."""
        return [v.key for v in self.files] + [v.key for v in self.runs]

    def to_json(self) -> dict[str, Any]:
        return {"direction": self.direction, "title": self.title, "files": [v.to_json() for v in self.files],
                "runs": [v.to_json() for v in self.runs], "edges": [e.to_json() for e in self.edges]}


def file_key(digest: str) -> str:
    return f"file-{digest}"


def run_key(run_id: str) -> str:
    return f"run-{run_id}"


class _Collector:
    def __init__(self, direction: str):
        self.direction = direction
        self.files: dict[str, dict[str, Any]] = {}
        self.runs: dict[str, tuple[RunInfo, bool]] = {}
        self.edges: dict[tuple[str, str], None] = {}

    def file(self, node: TraceNode, *, subject: bool) -> str:
        key = file_key(node.artifact.digest)
        entry = self.files.setdefault(key, {"artifact": node.artifact, "kinds": [], "ranks": set(), "paths": [],
                                            "subject": False, "end": False})
        self.use(key, node.role, node.rank, node.path)
        entry["subject"] |= subject
        entry["end"] |= node.is_end and not subject
        return key

    def run(self, hop: TraceHop, *, subject: bool = False) -> str:
        key = run_key(hop.run.id)
        known = self.runs.get(key)
        self.runs[key] = (hop.run, subject or (known is not None and known[1]))
        return key

    def link(self, file: str, run: str, *, run_wrote_file: bool) -> None:
        self.edges[(run, file) if run_wrote_file else (file, run)] = None

    def visit(self, node: TraceNode, *, subject: bool) -> None:
        key = self.file(node, subject=subject)
        backwards = self.direction == ANCESTORS
        for hop in node.hops:
            run = self.run(hop)
            self.link(key, run, run_wrote_file=backwards)
            # The walk met this file through one run's event; the linking run's own event (it wrote
            # or read the file) names the file too, often as another kind, path or rank.
            for use in hop.files:
                if use.artifact_id == node.artifact.id:
                    self.use(key, use.kind, use.rank, use.path)
            self.expand(hop, run)

    def use(self, key: str, kind: str, rank: int | None, path: str | None) -> None:
        entry = self.files[key]
        if kind not in entry["kinds"]:
            entry["kinds"].append(kind)
        if rank is not None:
            entry["ranks"].add(rank)
        if path is not None and path not in entry["paths"]:
            entry["paths"].append(path)

    def expand(self, hop: TraceHop, run: str) -> None:
        backwards = self.direction == ANCESTORS
        for child in hop.next:
            self.visit(child, subject=False)
            self.link(file_key(child.artifact.digest), run, run_wrote_file=not backwards)


def graph_of(trace: Trace, title: str) -> LineageGraph:
    """The vertices and edges of `trace`, in a fixed order."""
    collector = _Collector(trace.direction)
    if trace.subject_run is not None:
        collector.run(trace.subject_run, subject=True)
        collector.expand(trace.subject_run, run_key(trace.subject_run.run.id))
    for root in trace.roots:
        collector.visit(root, subject=trace.subject_run is None)

    files = []
    for key, entry in collector.files.items():
        artifact = entry["artifact"]
        files.append(FileVertex(key=key, hash_algo=artifact.hash_algo, digest=artifact.digest, size=artifact.size,
                                kinds=tuple(entry["kinds"]), ranks=tuple(sorted(entry["ranks"])),
                                paths=tuple(entry["paths"]), subject=entry["subject"], end=entry["end"]))
    files.sort(key=lambda v: (KIND_ORDER.get(v.kinds[0] if v.kinds else "", 9), not v.ranks,
                              v.ranks[0] if v.ranks else 0, v.paths[:1], v.digest))
    runs = sorted((RunVertex(key, run, subject) for key, (run, subject) in collector.runs.items()),
                  key=lambda v: (v.run.started_at, v.run.id))
    edges = tuple(Edge(source, target) for source, target in sorted(collector.edges))
    return LineageGraph(trace.direction, title, tuple(files), tuple(runs), edges)
