"""The settled job: typed, validated values that the stages pass along.

``settle`` (``job.settle``) turns a Hydra configuration into a ``JobSpec``: paths absolute (or
URLs), sizes in bytes, presets resolved (a strategy file given on the command line wins over the
default preset's declarative layout), every value checked against its range. Nothing after
settling looks at the raw configuration again. The Python API builds the parts it needs
(``SourceSpec``, ``TargetSpec``) directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..storage import StorageOptions
from ..tasks import FORMAT_CKPT

MODE_CONVERT = "convert"
MODE_PLAN = "plan"


@dataclass(frozen=True)
class JobContext:
    """Where and how the job was launched (from Hydra, or given directly by tests and tools)."""

    launch_dir: str
    run_dir: str
    overrides: tuple[str, ...] = ()
    sweep_id: str | None = None
    job_num: int | None = None
    # the preset chosen in each config group (e.g. {"target": "strategy"}), for messages
    choices: dict[str, str] = field(default_factory=dict)
    # True when the config was composed from presets plus `overrides` (the command line): then
    # only keys named in `overrides` count as the user's own, the rest are preset defaults.
    from_presets: bool = False

    def user_set(self, key: str) -> bool:
        """Whether the user gave `key` (or a key below it, or chose its config group) explicitly."""
        if not self.from_presets:
            return True
        group = key.split(".")[0]
        for o in self.overrides:
            name = o.split("=", 1)[0].lstrip("+~")
            if name == key or name.startswith(key + ".") or key.startswith(name + ".") or name == group:
                return True
        return False


@dataclass(frozen=True)
class SourceSpec:
    checkpoints: str | None  # absolute path or URL; None: the built-in demo
    strategy: str | None = None  # file, per-stage directory, or None (unsharded)
    select: str = "latest_step"
    unsharded: bool = False  # several rank folders without a strategy are copies of one whole model
    iteration: int | None = None  # of a MindFormers save; None: the one latest_checkpointed_iteration.txt names
    # compare, by content, the tensors the source strategy says are the same on several ranks
    verify_replicas: bool = True


@dataclass(frozen=True)
class TargetSpec:
    """Exactly one of `strategy` and `layout` (or neither: one whole checkpoint)."""

    strategy: str | None = None
    layout: dict | None = None  # declarative layout (mesh, optimizer_shard, rules, optimizer_prefixes)
    devices: int | None = None  # None: from the strategy
    prefix: str = "checkpoint_"
    format: str = FORMAT_CKPT
    unmapped: str = "omit"
    crc: bool = False
    max_shard_size: int = 5 * 10**9  # format safetensors_index: bound on a shard's tensor bytes
    include: str = "weights"  # format safetensors_index: weights | all (training state too)


@dataclass(frozen=True)
class OutputSpec:
    dir: str
    overwrite: bool = False


@dataclass(frozen=True)
class LineageSpec:
    enabled: bool
    url: str  # may hold a password: used to connect, never recorded (see secrets.mask_url)


@dataclass(frozen=True)
class RunSpec:
    mode: str = MODE_CONVERT
    workers: int | None = None  # None: CPU count, capped by target ranks
    ranks: tuple[int, ...] | None = None
    max_memory: int = 32 * 1024 * 1024
    resume: bool = True
    hash_cache: bool = True
    progress: bool | None = None


@dataclass(frozen=True)
class JobSpec:
    source: SourceSpec
    target: TargetSpec
    output: OutputSpec
    lineage: LineageSpec
    run: RunSpec
    context: JobContext
    storage: StorageOptions = field(default_factory=StorageOptions)
    # the resolved configuration with credentials masked: what manifest and lineage record
    config: dict[str, Any] = field(default_factory=dict)
