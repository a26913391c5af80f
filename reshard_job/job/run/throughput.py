"""Per-node throughput of a distributed conversion: what each node wrote, read, and how fast.

Each finished task reports where it ran and when; this module folds those reports into one row
per node. A node's speed is its bytes over its *wall* span (first task start to last task end),
not over the sum of task durations: tasks on a node overlap, and the summed time would make a
busy node look slow. Busy seconds are kept too, so an idle gap (a node waiting for work) shows
as wall seconds well above busy seconds divided by the tasks running at once. Pure code: the
executor feeds it reports; nothing here talks to a cluster.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from reshard_job.text import human_size, rank_ranges, table


@dataclass(frozen=True)
class TaskReport:
    """Where and when one target rank's file was produced (returned by the worker with its result)."""

    target_rank: int
    node_id: str  # the cluster's id of the node (hex)
    address: str  # the node's IP address as the cluster knows it
    host: str  # the machine's host name
    pid: int  # the worker process
    resource: str | None  # the placement resource the task held (None: placed anywhere)
    attempt: str  # a token unique to this attempt (a retried task gets a new one)
    started: float  # wall clock (time.time()) on the worker
    seconds: float
    bytes_written: int  # output file size
    bytes_read: int
    bytes_reported: int  # tensor bytes streamed, as reported to the progress display
    peak_rss: int = 0  # the worker process's peak resident memory so far, bytes
    cpu_seconds: float = 0.0  # CPU time of the worker process (all its threads) during the task
    identity: tuple = ()  # the written file's FileInfo.identity as its node sees it (local paths)


@dataclass
class NodeThroughput:
    node_id: str
    address: str
    host: str
    resources: set[str] = field(default_factory=set)
    ranks: list[int] = field(default_factory=list)
    bytes_written: int = 0
    bytes_read: int = 0
    busy_seconds: float = 0.0
    first_start: float | None = None
    last_end: float | None = None
    peak_rss: int = 0  # the largest worker process seen on the node
    cpu_seconds: float = 0.0

    @property
    def tasks(self) -> int:
        return len(self.ranks)

    @property
    def wall_seconds(self) -> float:
        if self.first_start is None or self.last_end is None:
            return 0.0
        return max(0.0, self.last_end - self.first_start)

    @property
    def write_rate(self) -> float | None:
        """Bytes written per wall second (None when no time was measured)."""
        wall = self.wall_seconds
        return self.bytes_written / wall if wall > 0 else None

    def add(self, report: TaskReport) -> None:
        if report.resource:
            self.resources.add(report.resource)
        self.ranks.append(report.target_rank)
        self.bytes_written += report.bytes_written
        self.bytes_read += report.bytes_read
        self.busy_seconds += report.seconds
        self.cpu_seconds += report.cpu_seconds
        self.peak_rss = max(self.peak_rss, report.peak_rss)
        end = report.started + report.seconds
        self.first_start = report.started if self.first_start is None else min(self.first_start, report.started)
        self.last_end = end if self.last_end is None else max(self.last_end, end)


def per_node(reports: Iterable[TaskReport]) -> list[NodeThroughput]:
    """One row per node, ordered by placement resource, then address and node id."""
    rows: dict[str, NodeThroughput] = {}
    for rep in reports:
        row = rows.get(rep.node_id)
        if row is None:
            row = rows[rep.node_id] = NodeThroughput(rep.node_id, rep.address, rep.host)
        row.add(rep)
    return sorted(rows.values(), key=lambda n: (_resource_order(n.resources), n.address, n.node_id))


def render(rows: list[NodeThroughput]) -> str:
    """A table for the job's final summary."""
    body = []
    for n in rows:
        rate = n.write_rate
        body.append([
            ",".join(sorted(n.resources)) or "-", f"{n.address} ({n.host})", n.node_id[:8], n.tasks,
            rank_ranges(n.ranks), human_size(n.bytes_read), human_size(n.bytes_written),
            f"{n.wall_seconds:.1f}", f"{n.cpu_seconds:.1f}", "-" if rate is None else f"{human_size(rate)}/s",
            human_size(n.peak_rss) if n.peak_rss else "-",
        ])
    return table(["node", "address", "id", "tasks", "ranks", "read", "written", "wall s", "cpu s", "write rate",
                  "worker peak RSS"], body, align_right=(3, 5, 6, 7, 8, 9, 10))


def to_json(rows: list[NodeThroughput]) -> list[dict]:
    """The rows as plain values (the job's result file; benchmarks read them)."""
    return [{"node_id": n.node_id, "address": n.address, "host": n.host, "resources": sorted(n.resources),
             "ranks": sorted(n.ranks), "bytes_read": n.bytes_read, "bytes_written": n.bytes_written,
             "busy_seconds": round(n.busy_seconds, 3), "cpu_seconds": round(n.cpu_seconds, 3),
             "first_start": n.first_start, "last_end": n.last_end, "wall_seconds": round(n.wall_seconds, 3),
             "peak_rss": n.peak_rss} for n in rows]


def from_json(rows: list[dict]) -> list[NodeThroughput]:
    return [NodeThroughput(r["node_id"], r["address"], r["host"], set(r.get("resources") or ()), list(r["ranks"]),
                           r["bytes_written"], r["bytes_read"], r.get("busy_seconds", 0.0), r.get("first_start"),
                           r.get("last_end"), r.get("peak_rss", 0), r.get("cpu_seconds", 0.0)) for r in rows]


def _resource_order(resources: set[str]) -> tuple:
    # reshard_node_2 before reshard_node_10: order by the trailing number where there is one
    if not resources:
        return (1, "", 0)
    name = min(resources)
    digits = len(name) - len(name.rstrip("0123456789"))
    return (0, name[: len(name) - digits], int(name[len(name) - digits:]) if digits else -1)
