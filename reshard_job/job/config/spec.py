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

from reshard_job.storage import StorageOptions
from reshard_job.execute.tasks import FORMAT_CKPT
from reshard_job.core.placement import DEFAULT_NODE_RESOURCE_PREFIX, PLACEMENT_SHARED

MODE_CONVERT = "convert"
MODE_PLAN = "plan"
EXECUTOR_LOCAL = "local"  # this machine: one process or a pool of worker processes
EXECUTOR_RAY = "ray"  # one Ray task per target rank on a Ray cluster


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
class ClusterSpec:
    """The target training cluster (``target.cluster``): how target ranks are laid out over nodes.

    Node k holds ranks ``[k * devices_per_node, (k + 1) * devices_per_node)`` and is the Ray node
    started with the custom resource ``<node_resource_prefix><k>``. Either count may be None when
    the other one and the target's device count settle it (``placement.devices_per_node_for``).
    """

    nodes: int | None = None
    devices_per_node: int | None = None
    node_resource_prefix: str = DEFAULT_NODE_RESOURCE_PREFIX

    @property
    def given(self) -> bool:
        return self.nodes is not None or self.devices_per_node is not None


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
    # weights | all | name patterns; None: the format's (weights for safetensors_index, else all)
    include: str | tuple[str, ...] | None = None
    exclude: tuple[str, ...] = ()  # name patterns left out after include
    rename: tuple[tuple[str, str], ...] = ()  # ordered (old prefix, new prefix), first match wins
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    remove_redundancy: bool = False  # each rank writes only the blocks it owns (MindSpore's remove_redundancy)


@dataclass(frozen=True)
class OutputSpec:
    dir: str
    overwrite: bool = False
    placement: str = PLACEMENT_SHARED


@dataclass(frozen=True)
class LineageSpec:
    enabled: bool
    url: str  # may hold a password: used to connect, never recorded (see secrets.mask_url)


@dataclass(frozen=True)
class RaySpec:
    """``job.ray``: where the Ray cluster is and what each rank task asks of it."""

    address: str = "auto"  # auto | host:port (the head's GCS) | ray://host:port (Ray Client)
    num_cpus_per_task: float = 1.0
    max_retries: int = 3  # re-runs of a rank whose worker or node died, or that failed transiently


@dataclass(frozen=True)
class RunSpec:
    mode: str = MODE_CONVERT
    workers: int | None = None  # None: CPU count, capped by target ranks
    ranks: tuple[int, ...] | None = None
    max_memory: int = 32 * 1024 * 1024
    resume: bool = True
    hash_cache: bool = True
    progress: bool | None = None
    executor: str = EXECUTOR_LOCAL
    ray: RaySpec = field(default_factory=RaySpec)
    fingerprints: bool = True  # prove the conversion (``job.stages.proof``)


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
