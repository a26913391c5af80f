"""Settling a configuration into a ``JobSpec``: the edge where every value is checked.

The configuration is converted through the typed schema (``OmegaConf.to_object``), which enforces
types and required keys (``???``); then each value is checked against the range that makes sense
for it, so that ``job.workers=0``, ``job.max_memory=inf`` or a 300-character prefix fail here, with
one line naming the key and what is accepted, before anything is read or written. Unknown keys
(``+target.devcies=4``) are refused with the closest known key.
"""

from __future__ import annotations

import copy
import difflib
import math
import os
import typing
from dataclasses import fields, is_dataclass
from typing import Any, Mapping

from reshard_job.errors import ConfigError
from reshard_job.storage import StorageOptions, absolute, is_url
from reshard_job.execute.tasks import FORMAT_SAFETENSORS_INDEX, TARGET_FORMATS
import reshard_job.job.config.schema as schema
from reshard_job.secrets import mask_config
from reshard_job.core.placement import devices_per_node_for
from reshard_job.job.config.spec import (EXECUTOR_LOCAL, EXECUTOR_RAY, MODE_CONVERT, MODE_PLAN, ClusterSpec,
                                         JobContext, JobSpec, LineageSpec, OutputSpec, RaySpec, RunSpec,
                                         SourceSpec, TargetSpec)
from reshard_job.core.placement import PLACEMENT_PER_NODE, PLACEMENT_SHARED

MAX_DEVICES = 1 << 20  # documented ceiling on device counts and rank ids
# One job writes one file per target rank and plans every rank's slices up front: far above any
# cluster a checkpoint is converted for, far below a declared matrix that would plan for minutes.
MAX_TARGET_RANKS = 1 << 16
MAX_WORKERS = 1024
MIN_MEMORY, MAX_MEMORY = 1024, 1 << 40
MAX_PREFIX = 200  # characters; a file name must stay within 255 bytes with the rank and suffix
MAX_ITERATION = 10**15  # MindFormers iteration numbers (folder names hold 8 digits or more)
SELECT_RULES = ("latest_step", "last")
UNMAPPED = ("omit", "full", "drop")
EXECUTORS = (EXECUTOR_LOCAL, EXECUTOR_RAY)
PLACEMENTS = (PLACEMENT_SHARED, PLACEMENT_PER_NODE)
MAX_CPUS_PER_TASK = 1024
MAX_RETRIES = 100


def settle(cfg: Any, ctx: JobContext) -> JobSpec:
    """A ``JobSpec`` from a composed configuration (DictConfig or plain dict); ConfigError on any bad value."""
    typed, plain = _to_schema(cfg, ctx)
    source = _source(typed.source, ctx)
    target = _target(typed.target, plain["target"], ctx)
    run = _run(typed.job)
    out_dir = typed.output.dir
    output = OutputSpec(absolute(out_dir, ctx.launch_dir) if out_dir else os.path.join(ctx.run_dir, "output"),
                        bool(typed.output.overwrite), _placement(typed.output.placement))
    _check_placement(output, target, run)
    storage = StorageOptions(typed.storage.endpoint_url, dict(typed.storage.options or {}))
    return JobSpec(source, target, output, _lineage(typed.lineage, ctx), run, ctx, storage, mask_config(plain))


# ---------------------------------------------------------------------------------- schema
def _to_schema(cfg: Any, ctx: JobContext) -> tuple[schema.ReshardConfig, dict]:
    """The configuration as the schema's dataclasses, and as plain dicts and lists (resolved).

    Each conversion of a configuration holding 100,000 patterns or 10,000 layout rules takes
    seconds, so there is one of each: Hydra's composition is already typed by the schema (it starts
    from ``reshard_schema``) and is not merged onto it again, and the plain form is read from the
    merged configuration, not rebuilt from the dataclasses."""
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

    try:
        if not isinstance(cfg, DictConfig):
            cfg = OmegaConf.create(dict(cfg))
        if OmegaConf.get_type(cfg) is schema.ReshardConfig:
            merged = cfg
            plain = OmegaConf.to_container(merged, resolve=True)
            _check_known_keys(plain, schema.ReshardConfig, "")  # (Hydra's +key=value adds keys to it)
        else:
            _check_known_keys(OmegaConf.to_container(cfg, resolve=False), schema.ReshardConfig, "")
            merged = OmegaConf.merge(OmegaConf.structured(schema.ReshardConfig), cfg)
            plain = OmegaConf.to_container(merged, resolve=True)
        return OmegaConf.to_object(merged), plain
    except MissingMandatoryValue as e:
        key = getattr(e, "full_key", None) or "?"
        group = key.split(".")[0]
        preset = ctx.choices.get(group)
        via = f" by the preset {group}={preset}" if preset else ""
        raise ConfigError(f"{key} is required{via}: set {key}=...") from None
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        msg = str(getattr(e, "msg", None) or e).strip().splitlines()[0]
        raise ConfigError(f"{key}: {msg}" if key and not msg.startswith(f"{key}:") else msg) from None


def _check_known_keys(node: Any, cls: type, prefix: str) -> None:
    """Refuse keys the schema does not know (Hydra's ``+key=value`` would add them silently)."""
    if not isinstance(node, Mapping) or not is_dataclass(cls):
        return
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    for key, value in node.items():
        full = f"{prefix}{key}"
        if key not in known:
            raise ConfigError(_unknown_key_line(str(key), known, prefix))
        sub = _dataclass_of(hints[key])
        if sub is not None:
            _check_known_keys(value, sub, full + ".")


def unknown_key_line(full_key: str) -> str | None:
    """The line for a dotted key the schema does not know (``target.devcies``), naming the closest
    known one; None where the schema knows it or cannot tell (free-form maps such as storage.options).
    Hydra refuses ``target.devcies=4`` itself: its error is told with this same line."""
    cls: type | None = schema.ReshardConfig
    prefix = ""
    for part in full_key.split("."):
        if cls is None:
            return None
        known = {f.name for f in fields(cls)}
        if part not in known:
            return _unknown_key_line(part, known, prefix)
        cls = _dataclass_of(typing.get_type_hints(cls)[part])
        prefix += part + "."
    return None


def _unknown_key_line(key: str, known: set[str], prefix: str) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    hint = f"; did you mean {prefix}{close[0]}?" if close else f" (known keys: {', '.join(sorted(known))})"
    return f"unknown configuration key {prefix}{key}{hint}"


def _dataclass_of(hint: Any) -> type | None:
    """The dataclass a field holds (unwrapping Optional), or None."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    t = args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint
    return t if isinstance(t, type) and is_dataclass(t) else None


# ---------------------------------------------------------------------------------- parts
def _source(s: schema.SourceConfig, ctx: JobContext) -> SourceSpec:
    if s.checkpoints is None and s.strategy is not None:
        raise ConfigError("source.strategy is set but source.checkpoints is not")
    if not isinstance(s.select, str) or not s.select.strip():
        raise ConfigError(f"source.select must be {' or '.join(SELECT_RULES)} or a glob, got {s.select!r}")
    iteration = _bounded_int(s.iteration, "source.iteration", 0, MAX_ITERATION, optional=True,
                             none_means="null for the latest")
    return SourceSpec(absolute(s.checkpoints, ctx.launch_dir) if s.checkpoints is not None else None,
                      absolute(s.strategy, ctx.launch_dir) if s.strategy is not None else None,
                      s.select, bool(s.unsharded), iteration, bool(s.verify_replicas))


def _target(t: schema.TargetConfig, plain: dict, ctx: JobContext) -> TargetSpec:
    """`t` as the schema's dataclasses, `plain` the same as plain dicts and lists."""
    devices = _bounded_int(t.devices, "target.devices", 1, MAX_TARGET_RANKS, optional=True)
    layout = _layout(plain.get("layout"))
    strategy = absolute(t.strategy, ctx.launch_dir) if t.strategy is not None else None
    if strategy is not None:
        # A strategy file given on the command line wins over the default preset's declarative
        # layout and device count; given explicitly, they must agree with it (checked when loaded).
        if layout is not None and ctx.user_set("target.layout") and ctx.user_set("target.strategy"):
            raise ConfigError("give target.strategy or target.layout, not both (set target.layout=null)")
        layout = None
        if not ctx.user_set("target.devices"):
            devices = None
    elif layout is not None and devices is None:
        raise ConfigError("target.layout needs target.devices")
    elif layout is None and devices not in (None, 1):
        raise ConfigError(f"target.devices={devices} needs target.strategy or target.layout to say how to shard")
    if t.format not in TARGET_FORMATS:
        raise ConfigError(f"target.format must be {', '.join(TARGET_FORMATS[:-1])} or {TARGET_FORMATS[-1]}, "
                          f"got {t.format!r}")
    if t.unmapped not in UNMAPPED:
        raise ConfigError(f"target.unmapped must be one of {', '.join(UNMAPPED)}, got {t.unmapped!r}")
    max_shard_size, include = _export_options(t, strategy, layout, devices)
    remove_redundancy = _remove_redundancy(t, strategy, layout)
    return TargetSpec(strategy, layout, devices, _prefix(t.prefix), t.format, t.unmapped, bool(t.crc),
                      max_shard_size, include, *_selection_options(t), cluster=_cluster(t.cluster, devices),
                      remove_redundancy=remove_redundancy)


def _remove_redundancy(t: schema.TargetConfig, strategy: str | None, layout: dict | None) -> bool:
    """target.remove_redundancy: only where ranks share blocks, i.e. a sharded target of ckpt or
    safetensors files per rank (MindSpore refuses it on a single device too)."""
    if not isinstance(t.remove_redundancy, bool):
        raise ConfigError(f"target.remove_redundancy must be true or false, got {_show(t.remove_redundancy)}")
    if not t.remove_redundancy:
        return False
    if t.format == FORMAT_SAFETENSORS_INDEX:
        raise ConfigError("target.remove_redundancy=true cannot apply to target.format=safetensors_index, which "
                          "writes one full model without replicas: set target.remove_redundancy=false")
    if strategy is None and layout is None:
        raise ConfigError("target.remove_redundancy=true needs a sharded target (target.strategy or target.layout): "
                          "a single device holds no replicas to remove")
    return True


def _export_options(t: schema.TargetConfig, strategy: str | None, layout: dict | None,
                    devices: int | None) -> tuple[int, str]:
    """target.max_shard_size in bytes and target.include; an export is one full model, never sharded."""
    from reshard_job.plan.export_shards import parse_shard_size
    from reshard_job.plan.selection import include_value

    size = parse_shard_size(t.max_shard_size)
    include = None if t.include is None else include_value(_container(t.include))
    sharded = strategy is not None or layout is not None or devices not in (None, 1)
    if t.format == FORMAT_SAFETENSORS_INDEX and sharded:
        raise ConfigError("target.format=safetensors_index writes the full, unsharded model: use target=hf_export, "
                          "or set target.strategy=null target.layout=null target.devices=1")
    return size, include


def _selection_options(t: schema.TargetConfig) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """target.exclude and target.rename (``plan.selection``)."""
    from reshard_job.plan.selection import patterns_value, rename_value

    return patterns_value(_container(t.exclude)), rename_value(_container(t.rename))


def _container(value: Any) -> Any:
    """A plain list or dict from an OmegaConf one (values given on the command line)."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    return OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value


def _cluster(c: schema.ClusterConfig, devices: int | None) -> ClusterSpec:
    """``target.cluster``, checked against ``target.devices`` when that is known here (a device
    count derived from target.strategy is checked once the strategy is read)."""
    nodes = _bounded_int(c.nodes, "target.cluster.nodes", 1, MAX_DEVICES, optional=True)
    per_node = _bounded_int(c.devices_per_node, "target.cluster.devices_per_node", 1, MAX_DEVICES, optional=True)
    prefix = c.node_resource_prefix
    if not isinstance(prefix, str) or not prefix.strip() or prefix != prefix.strip() or not prefix.isprintable():
        raise ConfigError(f"target.cluster.node_resource_prefix must be a non-empty name without spaces around it, "
                          f"got {_show(prefix)}")
    cluster = ClusterSpec(nodes, per_node, prefix)
    if cluster.given and devices is not None:
        devices_per_node_for(devices, nodes, per_node)
    return cluster


def _layout(layout: dict | None) -> dict | None:
    """target.layout as plain dicts and lists (a copy: the recorded configuration keeps its own)."""
    if not layout or not layout.get("mesh"):
        return None
    return copy.deepcopy(layout)


def _prefix(prefix: Any) -> str:
    bad = (not isinstance(prefix, str) or "/" in prefix or "\\" in prefix or "\0" in prefix
           or prefix in (".", "..") or not prefix.isprintable())
    if bad:
        raise ConfigError(f"target.prefix must be the start of a file name (no '/'), got {_show(prefix)}")
    if len(prefix) > MAX_PREFIX:
        raise ConfigError(f"target.prefix has {len(prefix)} characters; at most {MAX_PREFIX} keep the file "
                          "names within the 255 bytes file systems allow")
    return prefix


def _run(j: schema.JobConfig) -> RunSpec:
    if j.mode not in (MODE_CONVERT, MODE_PLAN):
        raise ConfigError(f"job.mode must be '{MODE_CONVERT}' or '{MODE_PLAN}', got {j.mode!r}")
    workers = _bounded_int(j.workers, "job.workers", 1, MAX_WORKERS, optional=True,
                           none_means="null for the CPU count")
    ranks = None
    if j.ranks is not None:
        ranks = tuple(sorted({_bounded_int(r, "job.ranks entries", 0, MAX_DEVICES - 1) for r in j.ranks}))
        if not ranks:
            raise ConfigError("job.ranks is empty; give target ranks, e.g. job.ranks=[0,1], or null for all")
    if j.executor not in EXECUTORS:
        raise ConfigError(f"job.executor must be {' or '.join(EXECUTORS)}, got {_show(j.executor)}")
    return RunSpec(j.mode, workers, ranks, _max_memory(j.max_memory), bool(j.resume), bool(j.hash_cache),
                   j.progress, j.executor, _ray(j.ray), fingerprints=bool(j.fingerprints))


def _ray(r: schema.RayConfig) -> RaySpec:
    from reshard_job.job.config.ray_address import parse_address  # pure; Ray itself is imported only when a job uses it

    try:
        parse_address(r.address)
    except ConfigError as e:
        raise ConfigError(f"job.ray.address: {e}") from None
    cpus = r.num_cpus_per_task
    if isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or not 0 < cpus <= MAX_CPUS_PER_TASK:
        raise ConfigError(f"job.ray.num_cpus_per_task must be a number above 0 and at most {MAX_CPUS_PER_TASK}, "
                          f"got {_show(cpus)}")
    retries = _bounded_int(r.max_retries, "job.ray.max_retries", 0, MAX_RETRIES)
    return RaySpec(str(r.address).strip(), float(cpus), retries)


def _placement(placement: Any) -> str:
    if placement not in PLACEMENTS:
        raise ConfigError(f"output.placement must be {' or '.join(PLACEMENTS)}, got {_show(placement)}")
    return placement


def _check_placement(output: OutputSpec, target: TargetSpec, run: RunSpec) -> None:
    """``per_node`` writes each rank on its own node: that takes Ray, a node layout, and local disks."""
    if output.placement != PLACEMENT_PER_NODE:
        return
    if run.executor != EXECUTOR_RAY:
        raise ConfigError("output.placement=per_node writes each rank's file on its target node through Ray; "
                          "set job.executor=ray")
    if not target.cluster.given:
        raise ConfigError("output.placement=per_node needs the target cluster's layout: set "
                          "target.cluster.devices_per_node (or target.cluster.nodes)")
    if is_url(output.dir):
        raise ConfigError(f"output.placement=per_node writes to each node's local disk, but output.dir is "
                          f"{_show(output.dir)}; use a local path, or output.placement=shared")


def _max_memory(value: Any) -> int:
    from reshard_job.core.sizes import parse_size

    try:
        size = parse_size(value)
    except (ValueError, OverflowError) as e:
        raise ConfigError(f"job.max_memory: {e}") from None
    if not MIN_MEMORY <= size <= MAX_MEMORY:
        raise ConfigError(f"job.max_memory must lie between 1KiB and 1TiB (e.g. 256MiB), got {_show(value)}")
    return size


def _lineage(lin: schema.LineageConfig, ctx: JobContext) -> LineageSpec:
    from reshard_job.lineage.urls import IN_MEMORY, in_memory_sqlite, url_from_environment

    url = lin.url or url_from_environment() or "sqlite:///" + os.path.join(ctx.launch_dir, "runs", "lineage.db")
    if isinstance(url, str) and url and "://" not in url:  # a path, as people type it: the SQLite file there
        url = "sqlite:///" + absolute(url, ctx.launch_dir)
    if not isinstance(url, str) or "://" not in url:
        raise ConfigError(f"lineage.url must be an SQLAlchemy URL such as sqlite:///runs/lineage.db, got {_show(url)}")
    if url.startswith("sqlite:///") and not url.startswith("sqlite:////"):
        rel = url[len("sqlite:///"):]
        if rel and rel != ":memory:" and not is_url(rel):
            url = "sqlite:///" + absolute(rel, ctx.launch_dir)
    if lin.enabled and in_memory_sqlite(url):
        raise ConfigError(f"lineage.url={_show(url)}: {IN_MEMORY}, or lineage.enabled=false")
    return LineageSpec(bool(lin.enabled), url)


def _bounded_int(value: Any, key: str, low: int, high: int, *, optional: bool = False,
                 none_means: str = "") -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        if isinstance(value, float) and math.isfinite(value) and value.is_integer() and low <= value <= high:
            return int(value)
        alt = f", or {none_means}" if none_means else (", or null" if optional else "")
        raise ConfigError(f"{key} must be an integer from {low} to {high}{alt}; got {_show(value)}")
    return value


def _show(value: Any) -> str:
    from reshard_job.text import shorten

    return shorten(repr(value), 60)
