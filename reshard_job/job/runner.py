"""The job: the one place that knows configuration, files, workers, progress and lineage at once.

``run_job`` takes a resolved configuration and carries a conversion from start to end:

1. find the sources (the demo when none is given) and their strategy; index every source file;
2. settle the target: a strategy file, a declarative layout compiled into one, or one full rank;
3. plan (``job.mode=plan`` stops here and writes only ``plan.json`` into the run directory);
4. check and lock the output directory, open a lineage run, hash the sources (verifying CRC
   trailers on the way), and decide between fresh start, resume and nothing-to-do;
5. convert the target ranks in parallel workers, journaling each finished file;
6. write ``manifest.json`` last, then record the outputs in the lineage database.

A failure after the lineage run was opened marks it failed with the error; partial files are
never recorded as outputs.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass, field
from math import prod
from typing import Any

from .. import __version__
from ..demo import ensure_demo
from ..errors import ConfigError, LayoutError, ReshardError
from ..execute import DEFAULT_MAX_MEMORY, FORMAT_CKPT, FORMAT_SAFETENSORS, SourceFiles
from ..formats.ckpt import CRC_TRAILER_LEN, CheckpointReader
from ..formats.strategy import format_for, write_strategy
from ..hashing import digest_file, digest_files
from ..plan import UNMAPPED_FULL, UNMAPPED_OMIT, Planner
from ..sources import discover, load_strategy
from ..topology import Topology
from .declarative import compile_layout
from .manifest import build_manifest, job_fingerprint
from .outputs import COMPLETE, PARTIAL, JournalEntry, OutputDir
from .parallel import RankTask, WriteOptions, default_workers, run_tasks
from .progress import Progress, human_bytes, parse_bytes
from .report import plan_report

log = logging.getLogger("reshard_job")

STATUS_COMPLETED = "completed"
STATUS_REUSED = "completed (already done)"
STATUS_PLANNED = "planned"
STATUS_FAILED = "failed"


@dataclass
class JobContext:
    """Where and how the job was launched (from Hydra, or given directly in tests)."""

    launch_dir: str
    run_dir: str
    overrides: list[str] = field(default_factory=list)
    sweep_id: str | None = None
    job_num: int | None = None


@dataclass
class JobResult:
    status: str
    output_dir: str | None = None
    run_id: str | None = None
    manifest_sha256: str | None = None
    target_devices: int | None = None
    plan_path: str | None = None
    lineage_url: str | None = None
    error: str | None = None

    def to_json(self) -> dict:
        return dict(self.__dict__)


def _abs(path: str | None, base: str) -> str | None:
    if path is None:
        return None
    path = os.path.expanduser(str(path))
    return os.path.normpath(path if os.path.isabs(path) else os.path.join(base, path))


# ===================================================================================== settle


@dataclass
class _Target:
    topology: Topology | None  # None: one whole, unsharded checkpoint
    strategy_bytes_path: str | None  # user file to copy, or None
    compiled: Any = None  # CompiledLayout when declarative
    devices: int = 1


def _settle_target(cfg: dict, src_topo: Topology, index) -> _Target:
    t = cfg["target"]
    devices = t.get("devices")
    if devices is not None and (not isinstance(devices, int) or devices < 1):
        raise ConfigError(f"target.devices must be a positive integer, got {devices!r}")
    layout = t.get("layout")
    has_layout = bool(layout) and bool(layout.get("mesh"))
    if t.get("strategy") is not None:
        if has_layout:
            raise ConfigError("give target.strategy or target.layout, not both (set target.layout=null)")
        loaded = load_strategy(t["strategy"])
        derived = loaded.topology.devices
        if devices is not None and devices != derived:
            raise ConfigError(f"target.devices={devices} but target.strategy {t['strategy']} describes {derived} devices")
        if os.path.isdir(t["strategy"]):
            raise ConfigError("target.strategy must be a single strategy file (merge per-stage files first)")
        return _Target(loaded.topology, t["strategy"], None, derived)
    if has_layout:
        if devices is None:
            raise ConfigError("target.layout needs target.devices")
        shapes = _global_shapes(src_topo, index)
        compiled = compile_layout(layout, devices, shapes)
        compiled.strategy.path = "target.layout"
        return _Target(Topology.from_strategy(compiled.strategy), None, compiled, devices)
    if devices not in (None, 1):
        raise ConfigError(f"target.devices={devices} needs target.strategy or target.layout to say how to shard")
    return _Target(None, None, None, 1)


def _global_shapes(src_topo: Topology, index) -> dict[str, tuple[int, ...]]:
    planner = Planner(src_topo, None, index)
    from ..formats import dtypes

    return {ps.name: ps.global_shape for ps in planner.params
            if ps.meta is not None and ps.meta.kind == "tensor" and dtypes.BY_NAME[ps.meta.dtype].sliceable}


# ===================================================================================== run


def run_job(cfg: dict, ctx: JobContext) -> JobResult:
    """Run one conversion (or plan) described by a resolved config dict."""
    source_cfg, target_cfg, job_cfg = cfg["source"], cfg["target"], cfg["job"]
    mode = job_cfg.get("mode", "convert")
    if mode not in ("convert", "plan"):
        raise ConfigError(f"job.mode must be 'convert' or 'plan', got {mode!r}")
    fmt = target_cfg.get("format", FORMAT_CKPT)
    if fmt not in (FORMAT_CKPT, FORMAT_SAFETENSORS):
        raise ConfigError(f"target.format must be 'ckpt' or 'safetensors', got {fmt!r}")
    prefix = target_cfg.get("prefix", "checkpoint_")
    if not isinstance(prefix, str) or "/" in prefix or (os.altsep and os.altsep in prefix) or prefix in (".", ".."):
        raise ConfigError(f"target.prefix must be the start of a file name (no '/'), got {prefix!r}")
    unmapped = target_cfg.get("unmapped", UNMAPPED_OMIT)
    if unmapped not in (UNMAPPED_OMIT, UNMAPPED_FULL):
        raise ConfigError(f"target.unmapped must be 'omit' or 'full', got {unmapped!r}")
    try:
        max_memory = parse_bytes(job_cfg.get("max_memory") or DEFAULT_MAX_MEMORY)
    except ValueError as e:
        raise ConfigError(f"job.max_memory: {e}") from None
    if max_memory < 1024:
        raise ConfigError(f"job.max_memory={max_memory} bytes is too small (at least 1 KiB)")

    # -- sources ------------------------------------------------------------------------------
    checkpoints = _abs(source_cfg.get("checkpoints"), ctx.launch_dir)
    strategy = _abs(source_cfg.get("strategy"), ctx.launch_dir)
    if checkpoints is None:
        if strategy is not None:
            raise ConfigError("source.strategy is set but source.checkpoints is not")
        checkpoints, strategy = ensure_demo(os.path.join(ctx.launch_dir, "runs", "demo"))
        log.info("no source.checkpoints given: using the built-in demo (MLP 784-512-512-10 on 8 ranks) at %s", checkpoints)
    found = discover(checkpoints, source_cfg.get("select", "last"))
    src = load_strategy(strategy)
    extra = sorted(r for r in found.files if r >= src.topology.devices)
    if extra:
        if strategy is None:
            log.warning("ignoring rank director%s %s: without source.strategy the source is one unsharded rank "
                        "(rank_0); if the rank directories hold shards of one model, set source.strategy",
                        "ies" if len(extra) > 1 else "y", ", ".join(f"rank_{r}" for r in extra))
        else:
            log.warning("ignoring rank director%s %s: the source strategy describes only %d rank(s)",
                        "ies" if len(extra) > 1 else "y", ", ".join(f"rank_{r}" for r in extra), src.topology.devices)
    for rank, others in sorted(found.ignored.items()):
        if rank < src.topology.devices:
            log.info("rank_%d: using %s, ignoring %s", rank, os.path.basename(found.files[rank]), ", ".join(others))
    source_paths = {r: p for r, p in found.files.items() if r < src.topology.devices}
    with SourceFiles(source_paths, verify_crc=False) as sources:
        index = sources.index()
        crc_info = {r: sources.reader(r).crc_stored for r in source_paths
                    if isinstance(sources.reader(r), CheckpointReader) and sources.reader(r).has_crc}

    if extra:
        _check_extra_ranks(found.files, extra, index, src.topology.devices, strategy)
    absent = [n for n in src.topology.layouts if not any(n in names for names in index.values())]
    if absent:
        log.warning("%d parameter(s) of the source strategy are in no source checkpoint and will not be in the "
                    "outputs: %s%s", len(absent), ", ".join(repr(n) for n in absent[:5]), ", ..." if len(absent) > 5 else "")

    # -- target and plan ------------------------------------------------------------------
    target_cfg = dict(target_cfg)
    target_cfg["strategy"] = _abs(target_cfg.get("strategy"), ctx.launch_dir)
    tgt = _settle_target({"target": target_cfg}, src.topology, index)
    planner = Planner(src.topology, tgt.topology, index, unmapped=unmapped)
    if tgt.compiled is not None:
        planner.notes.extend(tgt.compiled.notes)
    ranks = job_cfg.get("ranks")
    if ranks is not None:
        bad = [r for r in ranks if not isinstance(r, int) or not 0 <= r < tgt.devices]
        if bad:
            raise ConfigError(f"job.ranks {bad} are not target ranks (0..{tgt.devices - 1})")
        ranks = sorted(set(ranks))
    missing: dict[int, list[int]] = {}
    plan = planner.plan(ranks, missing=missing)
    predicted = min(max_memory, 2 * max((rp.largest_slice for rp in plan.ranks), default=0))

    if mode == "plan":
        return _plan_only(plan, predicted, missing, ctx, tgt)
    if missing:
        from ..errors import MissingRankError

        raise MissingRankError(missing, checkpoints)

    # -- output directory ---------------------------------------------------------------------
    out_dir = _abs(cfg["output"].get("dir"), ctx.launch_dir) or os.path.join(ctx.run_dir, "output")
    out = OutputDir(out_dir, overwrite=bool(cfg["output"].get("overwrite", False)))
    source_dirs = [checkpoints] + ([strategy] if strategy and os.path.isdir(strategy) else [])
    source_files = list(source_paths.values()) + list(src.files)
    out.check_not_source(source_dirs, source_files)
    planned = [os.path.join(out.path, f"rank_{rp.target_rank}", f"{prefix}{rp.target_rank}.{fmt}") for rp in plan.ranks]
    planned += [out.manifest_path] + [os.path.join(out.path, n) for n in ("strategy.ckpt", "strategy.json")]
    out.check_not_overwriting(planned, source_files, source_dirs)
    out.check_writable()
    out.check_not_foreign()
    out.lock()
    store = run_id = None
    try:
        store, run_id = _open_lineage(cfg, ctx, out_dir, src.topology.devices, tgt.devices)
        result = _convert(cfg, ctx, out, plan, src, tgt, source_paths, crc_info, fmt, max_memory, unmapped,
                          ranks, store, run_id, checkpoints, strategy)
        return result
    except BaseException as e:
        db_error = _lineage_error(e, cfg, ctx)
        if store is not None and run_id is not None:
            try:
                store.fail_run(run_id, _error_text(db_error or e))
            except Exception as le:  # the original error matters more
                log.error("could not record the failure in the lineage database: %s",
                          _lineage_error(le, cfg, ctx) or le)
        if db_error is not None:
            raise db_error from e
        raise
    finally:
        out.unlock()
        if store is not None:
            store.close()


def _check_extra_ranks(files: dict[int, str], extra: list[int], index, devices: int, strategy: str | None) -> None:
    """Ignoring rank directories beyond the strategy's devices is safe only when they hold nothing the
    others lack; otherwise (a pipeline strategy directory missing its last stage, the strategy of
    another run) their parameters would silently be missing from the outputs."""
    from ..errors import PlanError
    from ..execute import open_reader

    known = set().union(*index.values()) if index else set()
    for r in extra:
        try:
            with open_reader(files[r], verify_crc=False) as reader:
                unknown = [n for n in reader.names() if n not in known]
        except ReshardError as e:
            log.warning("rank_%d is ignored and cannot be read either: %s", r, e)
            continue
        if unknown:
            if strategy is None:
                hint = "set source.strategy to the strategy these checkpoints were saved with"
            elif os.path.isdir(strategy):
                hint = f"is a pipeline stage's strategy file missing from {strategy}?"
            else:
                hint = "was source.strategy saved with these checkpoints?"
            scope = ("the one unsharded rank read without source.strategy" if strategy is None
                     else f"the {devices} rank(s) the source strategy describes")
            raise PlanError(
                f"{files[r]}: rank {r} lies beyond {scope}, but holds {len(unknown)} parameter(s) that no rank "
                f"within it holds (e.g. {unknown[0]!r}); {hint}"
            )


def _lineage_error(e: BaseException, cfg, ctx: JobContext):
    """A database failure (disk full, locked, unreachable server) as a one-line LineageError, else None."""
    try:
        from sqlalchemy.exc import SQLAlchemyError
    except ImportError:
        return None
    if not isinstance(e, SQLAlchemyError):
        return None
    from ..lineage import LineageError

    cause = getattr(e, "orig", None) or e
    detail = next((ln.strip() for ln in str(cause).splitlines() if ln.strip()), type(cause).__name__)
    url = _lineage_url(cfg, ctx)
    if "://" in url and "@" in url:  # keep passwords out of messages
        scheme, rest = url.split("://", 1)
        url = f"{scheme}://***@{rest.rsplit('@', 1)[1]}"
    return LineageError(f"lineage database {url}: {detail} (lineage.enabled=false runs without recording)")


def _lineage_url(cfg, ctx: JobContext) -> str:
    lin = cfg.get("lineage") or {}
    url = lin.get("url") or "sqlite:///" + os.path.join(ctx.launch_dir, "runs", "lineage.db")
    if url.startswith("sqlite:///") and not url.startswith("sqlite:////"):
        rel = url[len("sqlite:///"):]
        if rel and rel != ":memory:":
            url = "sqlite:///" + _abs(rel, ctx.launch_dir)
    return url


def _error_text(e: BaseException) -> str:
    if isinstance(e, KeyboardInterrupt):
        return "interrupted"
    return str(e) or type(e).__name__


def _plan_only(plan, predicted, missing, ctx: JobContext, tgt: _Target) -> JobResult:
    import json

    os.makedirs(ctx.run_dir, exist_ok=True)
    plan_path = os.path.join(ctx.run_dir, "plan.json")
    doc = plan.to_json()
    doc["predicted_peak_memory"] = predicted
    doc["missing"] = {str(k): v for k, v in sorted(missing.items())}
    tmp = plan_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, plan_path)
    print(plan_report(plan, predicted_peak=predicted, missing=missing))
    print(f"\nplan written to {plan_path} (nothing else was written)")
    if missing:
        from ..errors import MissingRankError

        raise MissingRankError(missing)
    return JobResult(STATUS_PLANNED, None, None, None, tgt.devices, plan_path)


def _open_lineage(cfg, ctx: JobContext, out_dir, src_devices, dst_devices):
    lin = cfg.get("lineage") or {}
    if not lin.get("enabled", True):
        return None, None
    from ..lineage import LineageStore

    logging.getLogger("alembic").setLevel(logging.WARNING)  # migration chatter is not the job's news
    url = _lineage_url(cfg, ctx)
    if url.startswith("sqlite:///"):
        db_dir = os.path.dirname(url[len("sqlite:///"):]) or "."
        try:
            os.makedirs(db_dir, exist_ok=True)
        except OSError as e:
            from ..lineage import LineageError

            raise LineageError(f"lineage database {url}: cannot create {db_dir} ({e.strerror}); "
                               "lineage.enabled=false runs without recording") from None
    store = LineageStore(url)
    try:
        store.ensure_schema()
        abandoned = store.mark_abandoned_runs()
        if abandoned:
            log.warning("lineage: marked %d run(s) left 'started' by killed processes as abandoned: %s",
                        len(abandoned), ", ".join(a[:8] for a in abandoned))
        run_id = store.start_run(config=cfg, overrides=list(ctx.overrides), tool_version=__version__,
                                 output_dir=out_dir, source_devices=src_devices, target_devices=dst_devices,
                                 sweep_id=ctx.sweep_id, job_num=ctx.job_num)
    except BaseException:
        store.close()
        raise
    return store, run_id


def _convert(cfg, ctx, out: OutputDir, plan, src, tgt: _Target, source_paths, crc_info, fmt, max_memory,
             unmapped, ranks, store, run_id, checkpoints, strategy) -> JobResult:
    from ..lineage import FileRecord

    # -- hash sources (and verify CRC trailers) ------------------------------------------------
    needed = sorted(plan.source_ranks)
    total = sum(os.path.getsize(source_paths[r]) for r in needed)
    prog = Progress(total, len(needed), enabled=cfg["job"].get("progress"), desc="hashing sources")
    requests = [(source_paths[r], (os.path.getsize(source_paths[r]) - CRC_TRAILER_LEN) if r in crc_info else None)
                for r in needed]
    digests = digest_files(requests, threads=2, progress=prog.add_bytes)
    prog.close()
    for r, d in zip(needed, digests):
        if r in crc_info and d.crc32 != crc_info[r]:
            from ..errors import CheckpointFormatError

            raise CheckpointFormatError(source_paths[r], f"CRC32 mismatch: trailer says {crc_info[r]}, "
                                                         f"records give {d.crc32} (file corrupted)")
    source_files = [{"rank": r, "path": d.path, "size": d.size, "sha256": d.sha256} for r, d in zip(needed, digests)]
    strategy_files = [digest_file(p) for p in src.files]
    source_strategy = None
    if strategy is not None:
        source_strategy = {"path": strategy,
                           "files": [{"path": d.path, "size": d.size, "sha256": d.sha256} for d in strategy_files]}
        if len(strategy_files) == 1 and not os.path.isdir(strategy):
            source_strategy.update(size=strategy_files[0].size, sha256=strategy_files[0].sha256)

    # -- target strategy bytes -----------------------------------------------------------------
    target_strategy_name = None
    target_strategy_bytes = None
    if tgt.topology is not None:
        if tgt.strategy_bytes_path is not None:
            with open(tgt.strategy_bytes_path, "rb") as f:
                target_strategy_bytes = f.read()
            target_strategy_name = "strategy.json" if format_for(tgt.strategy_bytes_path) == "json" else "strategy.ckpt"
        else:
            from ..formats.strategy import to_protobuf_bytes

            target_strategy_bytes = to_protobuf_bytes(tgt.compiled.strategy)
            target_strategy_name = "strategy.ckpt"
    import hashlib

    target_strategy_sha = hashlib.sha256(target_strategy_bytes).hexdigest() if target_strategy_bytes else None
    prefix = cfg["target"].get("prefix", "checkpoint_")
    fingerprint = job_fingerprint(
        source_files=source_files, source_strategy=source_strategy, target_strategy_sha256=target_strategy_sha,
        target={"devices": tgt.devices, "format": fmt, "prefix": prefix, "unmapped": unmapped,
                "crc": bool(cfg["target"].get("crc", False)), "ranks": ranks},
    )
    inputs = [FileRecord(f["path"], f["sha256"], f["size"], "source_checkpoint", f["rank"]) for f in source_files]
    inputs += [FileRecord(d.path, d.sha256, d.size, "strategy") for d in strategy_files]
    if store is not None:
        store.record_inputs(run_id, inputs)

    # -- resume / idempotence -----------------------------------------------------------------
    state = out.state(fingerprint)
    resume = bool(cfg["job"].get("resume", True))
    if state == COMPLETE:
        listed = _listed_outputs(out)
        damaged = [e for e in listed if _size_or_none(os.path.join(out.path, e.path)) != e.size]
        if resume and not damaged:
            return _reuse_complete(out, store, run_id, plan, listed)
        if resume:
            log.warning("%s: %d file(s) listed in its manifest are missing or changed (%s); redoing them",
                        out.path, len(damaged), ", ".join(e.path for e in damaged))
        else:
            log.info("job.resume=false: redoing the conversion already complete in %s", out.path)
        out.uncommit(fingerprint, [e for e in listed if e not in damaged] if resume else [])
        state = PARTIAL
    resume = resume and state == PARTIAL
    out.start_journal(fingerprint, keep=resume)
    removed = out.remove_temp_files()
    if removed:
        log.info("removed %d temporary file(s) left by an interrupted run", removed)

    strategy_out = None
    if target_strategy_bytes is not None:
        from ..formats.atomic import write_bytes_atomic

        path = os.path.join(out.path, target_strategy_name)
        size, sha = write_bytes_atomic(path, target_strategy_bytes, mode=0o444)
        strategy_out = {"path": path, "size": size, "sha256": sha,
                        "from": tgt.strategy_bytes_path or "target.layout"}

    out_paths = {rp.target_rank: os.path.join(out.path, f"rank_{rp.target_rank}", f"{prefix}{rp.target_rank}.{fmt}")
                 for rp in plan.ranks}
    kept = out.reusable(out_paths) if resume else {}
    if kept:
        log.info("resuming: keeping %d target file(s) that verify: ranks %s", len(kept), sorted(kept))
    written: dict[int, dict] = {r: {"path": out_paths[r], "size": e.size, "sha256": e.sha256, "tensors": e.tensors}
                                for r, e in kept.items()}
    tasks = [RankTask(rp, out_paths[rp.target_rank]) for rp in plan.ranks if rp.target_rank not in kept]
    workers = cfg["job"].get("workers") or default_workers(len(tasks))
    if not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"job.workers must be a positive integer, got {workers!r}")
    workers = min(workers, max(1, len(tasks)))
    total_out = sum(rp.bytes_written for rp in plan.ranks if rp.target_rank not in kept)
    prog = Progress(total_out, len(tasks), enabled=cfg["job"].get("progress"), desc="converting")
    log.info("converting %d target rank(s) with %d worker(s): %s to write", len(tasks), workers, human_bytes(total_out))

    def on_done(rank: int, wf) -> None:
        written[rank] = {"path": wf.path, "size": wf.size, "sha256": wf.sha256, "tensors": wf.tensors}
        out.append_journal(JournalEntry(rank, out.relative(wf.path), wf.size, wf.sha256, wf.tensors))
        prog.rank_done(rank, wf.size)

    try:
        run_tasks(tasks, source_paths, WriteOptions(fmt, max_memory, bool(cfg["target"].get("crc", False))),
                  workers=workers, on_bytes=prog.add_bytes, on_done=on_done)
    finally:
        prog.close()

    # -- manifest (last) ---------------------------------------------------------------------
    target_files = [{"rank": r, "path": written[r]["path"], "size": written[r]["size"], "sha256": written[r]["sha256"]}
                    for r in sorted(written)]
    manifest = build_manifest(
        run_id=run_id or "", tool_version=__version__, fingerprint=fingerprint, config=cfg,
        source={"checkpoints": checkpoints, "select": cfg["source"].get("select", "last"),
                "devices": src.topology.devices, "stage_devices": src.topology.stage_devices,
                "stages": src.topology.num_stages, "strategy": source_strategy, "files": source_files},
        target={"devices": tgt.devices, "format": fmt, "prefix": prefix, "ranks": ranks,
                "strategy": strategy_out, "files": target_files},
        tensors={str(r): written[r]["tensors"] for r in sorted(written)},
        plan_summary={"totals": plan.to_json()["totals"], "omitted": plan.omitted, "notes": plan.notes,
                      "source_ranks": {str(rp.target_rank): rp.source_ranks for rp in plan.ranks}},
    )
    m_size, m_sha = out.write_manifest(manifest)
    if store is not None:
        outputs = [FileRecord(f["path"], f["sha256"], f["size"], "target_checkpoint", f["rank"]) for f in target_files]
        if strategy_out is not None:
            outputs.append(FileRecord(strategy_out["path"], strategy_out["sha256"], strategy_out["size"], "strategy"))
        outputs.append(FileRecord(out.manifest_path, m_sha, m_size, "manifest"))
        store.complete_run(run_id, outputs=outputs, plan=plan.to_json())
    return JobResult(STATUS_COMPLETED, out.path, run_id, manifest["manifest_sha256"], tgt.devices)


def _size_or_none(path: str) -> int | None:
    try:
        return os.path.getsize(path)
    except OSError:
        return None


def _listed_outputs(out: OutputDir) -> list[JournalEntry]:
    """The target files a complete directory's manifest lists, as journal entries.

    Paths are taken relative to the directory as it is now (``rank_<r>/<file>``), so a directory
    that was moved or copied is checked where it is, not where it was written.
    """
    manifest = out.read_manifest() or {}
    tensors = manifest.get("tensors", {})
    entries = []
    for f in manifest.get("target", {}).get("files", []):
        rel = os.path.join(os.path.basename(os.path.dirname(f["path"])), os.path.basename(f["path"]))
        entries.append(JournalEntry(f["rank"], rel, f["size"], f["sha256"], tensors.get(str(f["rank"]), {})))
    return entries


def _reuse_complete(out: OutputDir, store, run_id, plan, listed: list[JournalEntry]) -> JobResult:
    """The same job already completed here and its files are in place: do nothing else."""
    from ..lineage import FileRecord

    manifest = out.read_manifest()
    log.info("nothing to do: %s already holds this conversion (run %s)", out.path, manifest.get("run_id"))
    if store is not None:
        m = digest_file(out.manifest_path)
        outputs = [FileRecord(os.path.join(out.path, e.path), e.sha256, e.size, "target_checkpoint", e.rank)
                   for e in listed]
        strat = manifest["target"].get("strategy")
        if strat:
            path = os.path.join(out.path, os.path.basename(strat["path"]))
            outputs.append(FileRecord(path, strat["sha256"], strat["size"], "strategy"))
        outputs.append(FileRecord(out.manifest_path, m.sha256, m.size, "manifest"))
        store.complete_run(run_id, outputs=outputs, plan=plan.to_json())
    return JobResult(STATUS_REUSED, out.path, run_id, manifest.get("manifest_sha256"), manifest["target"]["devices"])
