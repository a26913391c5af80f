"""The lineage as a graph to draw, and a deterministic layered layout for it. Pure: no I/O.

Vertices are runs and file contents; an edge goes from a file to each run that read it and from
a run to each file it wrote, so time flows along the edges. A content used at several paths or
ranks is one vertex listing them all, as the database records it.

The layout is the classic layered (Sugiyama-style) drawing, kept small so that no Graphviz is
needed and the output is byte-for-byte reproducible:

1. cycles (a round trip that reproduces its source) are broken by dropping DFS back edges from
   the layering; they are still drawn;
2. layers by longest path from the sources, then sources pulled right to just before their first
   reader, so a strategy file read late does not sit in the first column;
3. order within layers by barycenter sweeps (fewer crossings), ties broken by a fixed key order;
4. vertical positions pulled toward the neighbours' mean and made non-overlapping by averaging a
   top-down and a bottom-up packing (both feasible, so their mean is too).

Its cost is O(sweeps × edges × log) — fine for the thousands of files of a large conversion.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from reshard_job.audit.entities import ANCESTORS, KIND_ORDER, RunInfo

if TYPE_CHECKING:  # the walker imports SQLAlchemy; drawing does not need it
    from reshard_job.audit.trace import Trace, TraceHop, TraceNode

FILE = "file"
RUN = "run"
ORDER_SWEEPS = 4
PLACEMENT_SWEEPS = 3


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


# -- the layout ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Box:
    x: float
    y: float
    width: float
    height: float
    layer: int

    @property
    def left_middle(self) -> tuple[float, float]:
        return self.x, self.y + self.height / 2

    @property
    def right_middle(self) -> tuple[float, float]:
        return self.x + self.width, self.y + self.height / 2


@dataclass(frozen=True)
class Layout:
    boxes: dict[str, Box]
    width: float
    height: float
    back_edges: frozenset[tuple[str, str]]  # drawn, but not used to order the layers


def layered_layout(keys: Sequence[str], edges: Sequence[tuple[str, str]], size: Callable[[str], tuple[float, float]],
                   *, layer_gap: float = 72, node_gap: float = 14, left: float = 24, top: float = 24,
                   right: float = 24, bottom: float = 24) -> Layout:
    """Positions for `keys` (their order is the tie-breaker everywhere) with `edges` drawn left to right.

    `size(key)` gives a box's (width, height). Edges naming unknown keys and self-loops are ignored.
    """
    index = {key: i for i, key in enumerate(dict.fromkeys(keys))}
    keys = list(index)
    pairs = sorted({(a, b) for a, b in edges if a in index and b in index and a != b},
                   key=lambda e: (index[e[0]], index[e[1]]))
    successors: dict[str, list[str]] = defaultdict(list)
    for a, b in pairs:
        successors[a].append(b)

    back = _back_edges(keys, successors)
    dag = [(a, b) for a, b in pairs if (a, b) not in back]
    preds: dict[str, list[str]] = defaultdict(list)
    succs: dict[str, list[str]] = defaultdict(list)
    for a, b in dag:
        succs[a].append(b)
        preds[b].append(a)

    layer = _layers(keys, index, preds, succs)
    layers = _ordered_layers(keys, layer, preds, succs, index)
    sizes = {key: size(key) for key in keys}
    column = max((w for w, _ in sizes.values()), default=0)
    ys = _vertical_positions(layers, sizes, preds, succs, node_gap)

    boxes = {}
    for number, members in enumerate(layers):
        for key in members:
            w, h = sizes[key]
            boxes[key] = Box(left + number * (column + layer_gap) + (column - w) / 2, top + ys[key], w, h, number)
    width = left + right + (len(layers) * column + max(len(layers) - 1, 0) * layer_gap)
    height = top + bottom + max((ys[k] + sizes[k][1] for k in keys), default=0)
    return Layout(boxes, width, height, frozenset(back))


def _back_edges(keys: list[str], successors: dict[str, list[str]]) -> set[tuple[str, str]]:
    """Edges closing a cycle in a depth-first search started from each key in order (iterative)."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    back: set[tuple[str, str]] = set()
    for start in keys:
        if start in state:
            continue
        state[start] = 1
        stack = [(start, iter(successors.get(start, ())))]
        while stack:
            key, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[key] = 2
                stack.pop()
            elif state.get(child) == 1:
                back.add((key, child))
            elif child not in state:
                state[child] = 1
                stack.append((child, iter(successors.get(child, ()))))
    return back


def _layers(keys: list[str], index: dict[str, int], preds, succs) -> dict[str, int]:
    remaining = {key: len(preds[key]) for key in keys}
    ready = [(index[key], key) for key in keys if remaining[key] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, key = heapq.heappop(ready)
        order.append(key)
        for child in succs[key]:
            remaining[child] -= 1
            if remaining[child] == 0:
                heapq.heappush(ready, (index[child], child))
    layer: dict[str, int] = {}
    for key in order:
        layer[key] = max((layer[p] + 1 for p in preds[key]), default=0)
    # Sources sit just before their first reader, not all in the first column.
    for key in reversed(order):
        if not preds[key] and succs[key]:
            layer[key] = min(layer[s] for s in succs[key]) - 1
    return layer


def _ordered_layers(keys: list[str], layer: dict[str, int], preds, succs, index) -> list[list[str]]:
    count = max(layer.values(), default=-1) + 1
    layers: list[list[str]] = [[] for _ in range(count)]
    for key in keys:
        layers[layer[key]].append(key)

    def centred_positions() -> dict[str, float]:
        return {key: i - (len(members) - 1) / 2 for members in layers for i, key in enumerate(members)}

    for _ in range(ORDER_SWEEPS):
        # Left to right by the predecessors' positions, then right to left by the successors'.
        for numbers, neighbours in ((range(1, count), preds), (range(count - 2, -1, -1), succs)):
            for number in numbers:
                layers[number] = _by_barycenter(layers[number], neighbours, centred_positions(), index)
    return layers


def _by_barycenter(members: list[str], neighbours, position: dict[str, float], index) -> list[str]:
    current = {key: i for i, key in enumerate(members)}

    def barycenter(key: str) -> float:
        linked = neighbours[key]
        return sum(position[n] for n in linked) / len(linked) if linked else position[key]

    return sorted(members, key=lambda key: (barycenter(key), current[key], index[key]))


def _vertical_positions(layers: list[list[str]], sizes, preds, succs, gap: float) -> dict[str, float]:
    """Top y of every box: stacked and centred first, then pulled toward the neighbours' centres."""
    heights = [sum(sizes[k][1] for k in members) + gap * max(len(members) - 1, 0) for members in layers]
    tallest = max(heights, default=0)
    y: dict[str, float] = {}
    for members, total in zip(layers, heights):
        cursor = (tallest - total) / 2
        for key in members:
            y[key] = cursor
            cursor += sizes[key][1] + gap

    def centre(key: str) -> float:
        return y[key] + sizes[key][1] / 2

    for _ in range(PLACEMENT_SWEEPS):
        for members in layers + layers[::-1]:
            wanted = []
            for key in members:
                linked = preds[key] + succs[key]
                target = sum(centre(n) for n in linked) / len(linked) if linked else centre(key)
                wanted.append(target - sizes[key][1] / 2)
            packed = _pack(wanted, [sizes[k][1] for k in members], gap)
            for key, top in zip(members, packed):
                y[key] = top
    lowest = min(y.values(), default=0.0)
    return {key: value - lowest for key, value in y.items()}


def _pack(wanted: list[float], heights: list[float], gap: float) -> list[float]:
    """Tops as close to `wanted` as keeps the boxes in order and `gap` apart: the mean of a
    top-down and a bottom-up packing (the constraints are linear, so the mean satisfies them)."""
    down = []
    for i, target in enumerate(wanted):
        down.append(target if i == 0 else max(target, down[-1] + heights[i - 1] + gap))
    up = [0.0] * len(wanted)
    for i in range(len(wanted) - 1, -1, -1):
        up[i] = wanted[i] if i == len(wanted) - 1 else min(wanted[i], up[i + 1] - heights[i] - gap)
    return [(a + b) / 2 for a, b in zip(down, up)]
