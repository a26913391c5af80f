"""The batch job's configuration schema: dataclasses registered in Hydra's ConfigStore.

The YAML presets in ``conf/`` are validated against these (types, unknown keys), so a typo fails
at composition time with the key's name instead of being silently ignored. Keys and their meaning
are part of the interface contract (``design.md``): add freely, never rename.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

from reshard_job.core.topology import OPTIMIZER_PREFIXES as _OPTIMIZER_PREFIXES

# Prefixes of optimizer-state entries; they follow their parameter's rule unless a rule names them.
OPTIMIZER_PREFIXES = list(_OPTIMIZER_PREFIXES)


@dataclass
class SourceConfig:
    # directory holding rank_<r>/ folders (a path or URL); null = the built-in demo. Required: every
    # source preset sets it (source=demo to null), so a preset that leaves it ??? makes it mandatory.
    checkpoints: Optional[str] = MISSING
    # strategy file (.json = JSON, else protobuf), directory of per-stage pipeline files, or null
    strategy: Optional[str] = None
    # which file of a rank folder: latest_step (highest <epoch>_<step>) | last (lexicographic,
    # MindSpore's rule) | a glob
    select: str = "latest_step"
    # several rank folders without source.strategy: true says they are copies of one whole model
    unsharded: bool = False
    # a MindFormers checkpoint folder: which iteration_XXXXXXXX/ to read; null = the one
    # latest_checkpointed_iteration.txt names
    iteration: Optional[int] = None
    # compare by content the tensors the source strategy says several ranks hold identically
    # (replicas of one block; tensors it does not lay out). false only for checkpoints whose
    # replicas differ on purpose
    verify_replicas: bool = True


@dataclass
class LayoutRule:
    match: str = ".*"  # regular expression, must match the whole parameter name
    # one entry per tensor dimension: null (not split), an axis name, or a list of axis names;
    # [] = fully replicated whatever the rank
    dims: List[Any] = field(default_factory=list)


@dataclass
class LayoutConfig:
    # ordered named axes (first = slowest varying); the product must equal target.devices
    mesh: Dict[str, int] = field(default_factory=dict)
    # null, or an axis name: dimension 0 is additionally sharded across it (optimizer parallel)
    optimizer_shard: Optional[str] = None
    rules: List[LayoutRule] = field(default_factory=list)
    optimizer_prefixes: List[str] = field(default_factory=lambda: list(OPTIMIZER_PREFIXES))


@dataclass
class ClusterConfig:
    # the target training cluster: node k holds ranks [k*devices_per_node, (k+1)*devices_per_node);
    # give either count (the other follows from target.devices) or both (checked against it)
    nodes: Optional[int] = None
    devices_per_node: Optional[int] = None
    # target node k is the Ray node started with --resources='{"<prefix><k>": 1000}'
    node_resource_prefix: str = "reshard_node_"


@dataclass
class TargetConfig:
    devices: Optional[int] = None  # derived from target.strategy when omitted
    # a MindSpore strategy file; null with layout or devices=1. Required like source.checkpoints:
    # every target preset sets it, target=strategy leaves it ??? for the user.
    strategy: Optional[str] = MISSING
    layout: Optional[LayoutConfig] = None
    prefix: str = "checkpoint_"
    # ckpt | safetensors | safetensors_index (the full model as size-bounded safetensors shards plus
    # model.safetensors.index.json, for inference: see target=hf_export)
    format: str = "ckpt"
    # parameters in the source strategy but not the target one: omit (default) | full
    unmapped: str = "omit"
    crc: bool = False  # append MindSpore's CRC32 trailer to .ckpt outputs
    # safetensors_index only: bound on one shard's tensor bytes (5GB = 5e9 bytes, 4GiB = 4*2^30)
    max_shard_size: Any = "5GB"
    # which parameters to convert: all | weights (no optimizer/training state) | a list of name
    # patterns ([model.*,lm_head.*]); null = the format's default (weights for safetensors_index, else all)
    include: Any = None
    exclude: Optional[List[str]] = None  # name patterns left out after include ([adam_m.*,adam_v.*])
    # ordered prefix rewrites applied to source names ({backbone.: model.}, or [[backbone., model.]])
    rename: Any = None
    cluster: ClusterConfig = field(default_factory=ClusterConfig)


@dataclass
class OutputConfig:
    dir: Optional[str] = None  # null = <run dir>/output
    overwrite: bool = False  # allow writing into a non-empty directory this tool did not produce
    # shared: output.dir is seen by every node | per_node: rank r's file is written under the same
    # local output.dir on the target node that holds rank r (target.cluster; needs job.executor=ray)
    placement: str = "shared"


@dataclass
class LineageConfig:
    enabled: bool = True
    url: Optional[str] = None  # SQLAlchemy URL; null = sqlite:///<launch dir>/runs/lineage.db


@dataclass
class RayConfig:
    address: str = "auto"  # auto (this machine's cluster) | host:port (the head's GCS) | ray://host:10001
    num_cpus_per_task: float = 1  # Ray CPUs each rank task reserves
    max_retries: int = 3  # re-runs of a rank whose worker process or node died


@dataclass
class JobConfig:
    mode: str = "convert"  # convert | plan
    workers: Optional[int] = None  # parallel processes; null = CPU count, capped by target ranks
    ranks: Optional[List[int]] = None  # a subset of target ranks; null = all
    max_memory: Any = "32MiB"  # bound on in-flight tensor buffers per worker (bytes or "512MiB")
    resume: bool = True  # keep target files of an interrupted identical run that still verify
    # reuse digests of source files unchanged since hashed (inode, size, mtime, ctime), kept in
    # $RESHARD_JOB_CACHE_DIR or ~/.cache/reshard_job
    hash_cache: bool = True
    progress: Optional[bool] = None  # progress bar; null = when stderr is a terminal
    # fingerprint every converted parameter in the sources and the outputs, and compare them
    fingerprints: bool = True
    executor: str = "local"  # local (this machine) | ray (one task per target rank on a Ray cluster)
    ray: RayConfig = field(default_factory=RayConfig)  # used with executor=ray


@dataclass
class StorageConfig:
    # object stores (s3:// paths): endpoint for OBS, MinIO, SeaweedFS; null = the standard chain
    # (AWS_ENDPOINT_URL, ~/.aws). Credentials belong in the environment; given here they are
    # used, never recorded.
    endpoint_url: Optional[str] = None
    options: Dict[str, Any] = field(default_factory=dict)  # passed to the fsspec back end


@dataclass
class ReshardConfig:
    source: SourceConfig = field(default_factory=SourceConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    lineage: LineageConfig = field(default_factory=LineageConfig)
    job: JobConfig = field(default_factory=JobConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)


def register() -> None:
    # One schema for the whole tree: the primary config lists it first in its defaults, so every
    # group's YAML preset is merged onto (and validated by) the typed dataclasses above.
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="reshard_schema", node=ReshardConfig)
