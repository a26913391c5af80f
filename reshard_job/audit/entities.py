"""Read-side entities: what the audit reads out of the database, as plain frozen dataclasses.

Every answer the audit gives (lists of runs, a run's details, a trace, a picture) is built from
these few values, and each is built from the ORM rows in exactly one place, its ``from_model``
constructor (MLflow's ``to_mlflow_entity`` idea). ``queries``, ``trace`` and ``verify`` produce
them; ``render`` and ``drawing`` consume them without touching SQLAlchemy; ``to_json`` gives the
stable JSON of ``--json`` (ISO-8601 UTC times, whole hex digests). The ORM objects themselves never
leave a session, so nothing can lazy-load after it is closed.

The constructors take the ORM objects duck-typed and this module imports nothing from
SQLAlchemy, so printing and drawing stay cheap to import and easy to test with literal values.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any, Iterable

from reshard_job.lineage.hash_names import HASH_ALGO
from reshard_job.lineage.status import RunStatus, status_of

# Which way a lineage is walked: back to the original sources, or forward to what was built.
ANCESTORS = "ancestors"
DESCENDANTS = "descendants"

# How files of one run are listed: checkpoints first, by rank, then strategies and the manifest.
KIND_ORDER = {"source_checkpoint": 0, "target_checkpoint": 1, "merged_strategy": 2, "strategy": 3, "manifest": 4}
STRATEGY_KINDS = ("strategy", "merged_strategy")


def iso(value: dt.datetime | None) -> str | None:
    return None if value is None else value.astimezone(dt.timezone.utc).isoformat()


@dataclass(frozen=True)
class RunInfo:
    """One run: who ran what, when, where to, and how it ended."""

    id: str
    status: RunStatus
    started_at: dt.datetime
    ended_at: dt.datetime | None
    source_devices: int | None
    target_devices: int | None
    output_dir: str
    sweep_id: str | None
    job_num: int | None
    tool_version: str
    host: str
    pid: int
    user: str | None
    error: str | None

    @classmethod
    def from_model(cls, run) -> RunInfo:
        return cls(id=run.id, status=status_of(run.status), started_at=run.started_at, ended_at=run.ended_at,
                   source_devices=run.source_devices, target_devices=run.target_devices, output_dir=run.output_dir,
                   sweep_id=run.sweep_id, job_num=run.job_num, tool_version=run.tool_version, host=run.host,
                   pid=run.pid, user=run.user, error=run.error)

    def to_json(self) -> dict[str, Any]:
        # The keys and their order are the stable output of ``audit runs --json``.
        return {
            "id": self.id,
            "status": self.status.value,
            "started_at": iso(self.started_at),
            "ended_at": iso(self.ended_at),
            "source_devices": self.source_devices,
            "target_devices": self.target_devices,
            "output_dir": self.output_dir,
            "sweep_id": self.sweep_id,
            "job_num": self.job_num,
            "tool_version": self.tool_version,
            "host": self.host,
            "pid": self.pid,
            "user": self.user,
            "error": self.error,
        }


@dataclass(frozen=True)
class FileUse:
    """A file as one run read (``input``) or wrote (``output``) it: path, role, rank, content."""

    path: str
    kind: str
    rank: int | None
    size: int
    hash_algo: str
    digest: str
    direction: str
    artifact_id: int
    copied: bool = False  # an output the run copied from an input, not one it made

    @classmethod
    def from_model(cls, event, artifact) -> FileUse:
        return cls(path=event.path, kind=event.role, rank=event.rank, size=artifact.size,
                   hash_algo=artifact.hash_algo, digest=artifact.digest, direction=event.direction,
                   artifact_id=artifact.id, copied=bool(event.copied))

    @property
    def sha256(self) -> str | None:
        return self.digest if self.hash_algo == HASH_ALGO else None

    def sort_key(self) -> tuple:
        return (KIND_ORDER.get(self.kind, 9), self.rank is None, self.rank or 0, self.path)

    def to_json(self) -> dict[str, Any]:
        entry = {"path": self.path, "kind": self.kind, "rank": self.rank, "size": self.size,
                 "hash_algo": self.hash_algo, "digest": self.digest}
        if self.sha256 is not None:
            entry["sha256"] = self.sha256
        if self.copied:
            entry["copied"] = True
        return entry


def sorted_files(files: Iterable[FileUse]) -> list[FileUse]:
    return sorted(files, key=FileUse.sort_key)


@dataclass(frozen=True)
class LocationInfo:
    """A path at which a content was seen, and when first and last."""

    path: str
    first_seen: dt.datetime
    last_seen: dt.datetime

    @classmethod
    def from_model(cls, location) -> LocationInfo:
        return cls(path=location.path, first_seen=location.first_seen, last_seen=location.last_seen)


@dataclass(frozen=True)
class ArtifactInfo:
    """One file content (by digest and size), with every path it was seen at, oldest first."""

    id: int
    hash_algo: str
    digest: str
    size: int
    kind: str
    rank: int | None
    locations: tuple[LocationInfo, ...]

    @classmethod
    def from_model(cls, artifact, locations: Iterable) -> ArtifactInfo:
        return cls(id=artifact.id, hash_algo=artifact.hash_algo, digest=artifact.digest, size=artifact.size,
                   kind=artifact.kind, rank=artifact.rank,
                   locations=tuple(LocationInfo.from_model(location) for location in locations))

    @property
    def sha256(self) -> str | None:
        return self.digest if self.hash_algo == HASH_ALGO else None

    @property
    def paths(self) -> list[str]:
        return [location.path for location in self.locations]

    def to_json(self) -> dict[str, Any]:
        entry = {"hash_algo": self.hash_algo, "digest": self.digest, "size": self.size, "kind": self.kind,
                 "rank": self.rank, "paths": self.paths}
        if self.sha256 is not None:
            entry["sha256"] = self.sha256
        return entry


@dataclass(frozen=True)
class RankMapEntry:
    """Which source ranks one target rank was assembled from, and the bytes moved."""

    target_rank: int
    source_ranks: tuple[int, ...]
    bytes_read: int | None
    bytes_written: int | None
    unreadable: str | None = None  # the row's source ranks where they are not a list of ranks (reported)

    @classmethod
    def from_model(cls, row) -> RankMapEntry:
        ranks = row.source_ranks or []
        plain = isinstance(ranks, list) and all(type(r) is int for r in ranks)
        return cls(target_rank=row.target_rank, source_ranks=tuple(ranks) if plain else (),
                   bytes_read=row.bytes_read, bytes_written=row.bytes_written,
                   unreadable=None if plain else repr(ranks)[:200])

    def to_json(self) -> dict[str, Any]:
        out = {"target_rank": self.target_rank, "source_ranks": list(self.source_ranks),
               "bytes_read": self.bytes_read, "bytes_written": self.bytes_written}
        if self.unreadable is not None:
            out["source_ranks_unreadable"] = self.unreadable
        return out


@dataclass(frozen=True)
class RunDetails:
    """Everything recorded about one run."""

    run: RunInfo
    overrides: tuple[str, ...]
    config: Any
    inputs: tuple[FileUse, ...]
    outputs: tuple[FileUse, ...]
    rank_map: tuple[RankMapEntry, ...]
    plan: Any

    def to_json(self) -> dict[str, Any]:
        return {**self.run.to_json(), "overrides": list(self.overrides), "config": self.config,
                "inputs": [f.to_json() for f in self.inputs], "outputs": [f.to_json() for f in self.outputs],
                "rank_map": [r.to_json() for r in self.rank_map], "plan": self.plan}


def to_json(value: Any) -> Any:
    """`value` as plain JSON data: entities through their ``to_json``, containers element-wise."""
    if hasattr(value, "to_json"):
        return value.to_json()
    if isinstance(value, (list, tuple)):
        return [to_json(item) for item in value]
    if isinstance(value, dict):
        return {key: to_json(item) for key, item in value.items()}
    if isinstance(value, RunStatus):
        return value.value
    if isinstance(value, dt.datetime):
        return iso(value)
    return value
