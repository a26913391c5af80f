"""The batch job's configuration schema: dataclasses registered in Hydra's ConfigStore.

The YAML presets in ``conf/`` are validated against these (types, unknown keys), so a typo fails
at composition time with the key's name instead of being silently ignored. Keys and their meaning
are part of the interface contract (``design.md``): add freely, never rename.

Every key says what it means in one line (``setting(default, meaning)``, kept in the field's
metadata): ``python -m reshard_job --help`` prints those lines, so this module is their one source.
It imports neither OmegaConf nor Hydra, so that ``--help`` answers without loading them.
"""

from __future__ import annotations

from dataclasses import MISSING as _NO_DEFAULT, dataclass, field
from typing import Any, Callable, Dict, List, Optional

from reshard_job.core.topology import OPTIMIZER_PREFIXES as _OPTIMIZER_PREFIXES

# OmegaConf's mark of a mandatory value (``omegaconf.MISSING`` is this very string; OmegaConf compares
# by value). Spelled here rather than imported: importing OmegaConf is a quarter of a second.
MISSING = "???"

# Prefixes of optimizer-state entries; they follow their parameter's rule unless a rule names them.
OPTIMIZER_PREFIXES = list(_OPTIMIZER_PREFIXES)

HELP = "help"  # the metadata key of a field's one-line meaning


def setting(default: Any = _NO_DEFAULT, meaning: str = "", *, factory: Callable[[], Any] | None = None) -> Any:
    """A configuration key: its default (or a `factory` of it) and its one-line `meaning`, shown by
    ``--help``. A key without a meaning is refused when the schema is defined."""
    if not meaning.strip() or "\n" in meaning:
        raise ValueError(f"a configuration key needs a one-line meaning, got {meaning!r}")
    if factory is not None:
        return field(default_factory=factory, metadata={HELP: meaning})
    return field(default=default, metadata={HELP: meaning})


@dataclass
class SourceConfig:
    # Required: every source preset sets it (source=demo to null), so a preset that leaves it ???
    # makes it mandatory.
    checkpoints: Optional[str] = setting(
        MISSING, "folder of rank_<r>/ folders, a MindFormers folder or one checkpoint file (path or URL); "
                 "null = the built-in demo")
    strategy: Optional[str] = setting(
        None, "source strategy file (.json = JSON, else protobuf), a folder of per-stage pipeline "
              "strategy files, or null for an unsharded source")
    select: str = setting(
        "latest_step", "which file of a rank folder: latest_step (highest <epoch>_<step>) | last "
                       "(lexicographic, MindSpore's rule) | a glob")
    unsharded: bool = setting(False, "several rank folders without source.strategy: true says they are copies of "
                                     "one whole model")
    iteration: Optional[int] = setting(
        None, "a MindFormers checkpoint folder: which iteration_XXXXXXXX/ to read; null = the one "
              "latest_checkpointed_iteration.txt names")
    # false only for checkpoints whose replicas differ on purpose
    verify_replicas: bool = setting(
        True, "compare by content the tensors the source strategy says several ranks hold identically "
              "(replicas of one block; tensors it does not lay out)")


@dataclass
class LayoutRule:
    match: str = setting(".*", "regular expression that must match the whole parameter name")
    dims: List[Any] = setting(
        meaning="one entry per tensor dimension: null (not split), an axis name or a list of axis names; "
                "[] = fully replicated", factory=list)


@dataclass
class LayoutConfig:
    mesh: Dict[str, int] = setting(
        meaning="ordered named axes, first = slowest varying (e.g. {dp: 2, mp: 4}); their product must "
                "equal target.devices", factory=dict)
    optimizer_shard: Optional[str] = setting(
        None, "null, or an axis name: dimension 0 is additionally sharded across it (optimizer parallel)")
    rules: List[LayoutRule] = setting(
        meaning="per-parameter rules {match, dims}, the first whose match fits a parameter applies",
        factory=list)
    optimizer_prefixes: List[str] = setting(
        meaning="name prefixes of optimizer states, which follow their parameter's rule unless a rule "
                "names them", factory=lambda: list(OPTIMIZER_PREFIXES))


@dataclass
class ClusterConfig:
    # node k holds ranks [k*devices_per_node, (k+1)*devices_per_node)
    nodes: Optional[int] = setting(
        None, "nodes of the target training cluster; give it or devices_per_node (the other follows "
              "from target.devices), or both (checked against it)")
    devices_per_node: Optional[int] = setting(None, "devices per node of the target training cluster")
    node_resource_prefix: str = setting(
        "reshard_node_", "target node k is the Ray node started with --resources='{\"<prefix><k>\": 1000}'")


@dataclass
class TargetConfig:
    devices: Optional[int] = setting(None, "target card count; derived from target.strategy when omitted")
    # Required like source.checkpoints: every target preset sets it, target=strategy leaves it ???
    # for the user.
    strategy: Optional[str] = setting(
        MISSING, "target strategy file (MindSpore's); null together with target.layout, or with "
                 "target.devices=1 for one full checkpoint")
    # An empty layout (no mesh) is none; a node, not null, so that `target.layout={mesh: ...}` on the
    # command line merges into it (OmegaConf cannot merge a dict into a typed node that is null).
    layout: Optional[LayoutConfig] = setting(
        meaning="a declarative target layout (a named device mesh and per-parameter rules) instead of "
                "a strategy file", factory=LayoutConfig)
    prefix: str = setting("checkpoint_", "file name prefix of the outputs: rank_<r>/<prefix><r>.ckpt")
    format: str = setting(
        "ckpt", "ckpt | safetensors | safetensors_index (the full model as size-bounded safetensors "
                "shards plus model.safetensors.index.json, for inference: see target=hf_export)")
    unmapped: str = setting("omit", "parameters in the source strategy but not the target one: omit (leave out "
                                    "accu_grads.*, refuse others) | full (keep them whole) | drop (leave them out)")
    crc: bool = setting(False, "append MindSpore's CRC32 trailer to .ckpt outputs")
    max_shard_size: Any = setting(
        "5GB", "safetensors_index only: bound on one shard's tensor bytes (5GB = 5e9 bytes, "
               "4GiB = 4*2^30)")
    include: Any = setting(
        None, "which parameters to convert: all | weights (no optimizer or training state) | a list of name "
              "patterns ([model.*,lm_head.*]); null = the format's default (weights for safetensors_index, "
              "else all)")
    exclude: Optional[List[str]] = setting(None, "name patterns left out after target.include ([adam_m.*,adam_v.*])")
    rename: Any = setting(
        None, "ordered prefix rewrites of source names, first match wins ({backbone.: model.}, or "
              "[[backbone., model.]])")
    remove_redundancy: bool = setting(
        False, "each target rank writes only the parameter slices it owns, one rank per block (MindSpore's "
               "save_checkpoint(remove_redundancy=True)); needs a sharded target, not safetensors_index")
    cluster: ClusterConfig = setting(
        meaning="the target training cluster's nodes, for output.placement=per_node", factory=ClusterConfig)


@dataclass
class OutputConfig:
    dir: Optional[str] = setting(None, "output folder (path or URL); null = <run dir>/output")
    overwrite: bool = setting(False, "allow writing into a non-empty folder this tool did not produce")
    placement: str = setting(
        "shared", "shared: output.dir is seen by every node | per_node: rank r's file is written under "
                  "output.dir on the target node holding rank r (needs job.executor=ray)")


@dataclass
class LineageConfig:
    enabled: bool = setting(True, "record the conversion in the lineage database")
    url: Optional[str] = setting(
        None, "SQLAlchemy URL of the lineage database; null = $RESHARD_JOB_LINEAGE_URL, else "
              "sqlite:///<launch dir>/runs/lineage.db")


@dataclass
class RayConfig:
    address: str = setting(
        "auto", "auto (this machine's cluster) | host:port (the head's GCS) | ray://host:10001")
    num_cpus_per_task: float = setting(1, "Ray CPUs each rank task reserves")
    max_retries: int = setting(3, "re-runs of a rank whose worker process or node died")


@dataclass
class JobConfig:
    mode: str = setting("convert", "convert | plan (print the plan, write nothing)")
    workers: Optional[int] = setting(None, "parallel processes, at most 4 per CPU; null = CPU count, capped by "
                                           "target ranks")
    ranks: Optional[List[int]] = setting(None, "a subset of target ranks to write, e.g. [0,3]; null = all")
    max_memory: Any = setting(
        "32MiB", "bound on in-flight tensor buffers per worker (bytes, or a size such as 512MiB)")
    resume: bool = setting(True, "keep target files of an interrupted identical run that still verify")
    hash_cache: bool = setting(
        True, "reuse digests of source files unchanged since hashed (inode, size, mtime, ctime), kept in "
              "$RESHARD_JOB_CACHE_DIR or ~/.cache/reshard_job")
    progress: Optional[bool] = setting(None, "progress bars; null = when stderr is a terminal")
    fingerprints: bool = setting(
        True, "fingerprint every converted parameter in the sources and the outputs, and compare them")
    executor: str = setting(
        "local", "local (this machine) | ray (one task per target rank on a Ray cluster)")
    ray: RayConfig = setting(meaning="the Ray executor's settings (job.executor=ray)", factory=RayConfig)


@dataclass
class StorageConfig:
    # Credentials belong in the environment; given here they are used, never recorded.
    endpoint_url: Optional[str] = setting(
        None, "object store endpoint for s3:// paths (OBS, MinIO, SeaweedFS); null = the standard chain "
              "(AWS_ENDPOINT_URL, ~/.aws)")
    options: Dict[str, Any] = setting(meaning="options passed to the fsspec back end (s3fs)", factory=dict)


@dataclass
class ReshardConfig:
    source: SourceConfig = setting(meaning="the checkpoints to convert", factory=SourceConfig)
    target: TargetConfig = setting(meaning="the layout to convert them to", factory=TargetConfig)
    output: OutputConfig = setting(meaning="where the converted files land", factory=OutputConfig)
    lineage: LineageConfig = setting(meaning="the record of every conversion", factory=LineageConfig)
    job: JobConfig = setting(meaning="how the job runs", factory=JobConfig)
    storage: StorageConfig = setting(meaning="object storage access", factory=StorageConfig)


def register() -> None:
    # One schema for the whole tree: the primary config lists it first in its defaults, so every
    # group's YAML preset is merged onto (and validated by) the typed dataclasses above.
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    node = OmegaConf.structured(ReshardConfig)
    for open_dict in OPEN_DICTS:  # their keys are the user's: Hydra's struct mode would refuse every new one
        OmegaConf.set_struct(OmegaConf.select(node, open_dict), False)
    ConfigStore.instance().store(name="reshard_schema", node=node)


# Dictionaries whose keys the user names (`target.layout={mesh: {dp: 2, mp: 4}}`, `storage.options={...}`).
OPEN_DICTS = ("target.layout.mesh", "storage.options")
