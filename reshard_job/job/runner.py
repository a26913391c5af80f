"""The job: the one place that knows configuration, files, workers, progress and lineage at once.

``run_job`` takes a resolved configuration and carries a conversion from start to end:

1. find the sources (the demo when none is given) and their strategy; index every source file
   once (the readers stay open, and forked workers reuse them);
2. settle the target: a strategy file, a declarative layout compiled into one, or one full rank;
3. plan (``job.mode=plan`` stops here and writes only ``plan.json`` into the run directory);
4. check and lock the output directory; open a lineage run (in a thread, while the sources are
   hashed and their CRC trailers verified); decide between fresh start, resume and nothing-to-do;
5. convert the target ranks in parallel workers, journaling each finished file;
6. write ``manifest.json`` last, then record the outputs in the lineage database.

A failure after the lineage run was opened marks it failed with the error; partial files are
never recorded as outputs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .. import __version__
from ..demo import ensure_demo
from ..errors import CheckpointFormatError, ConfigError, MissingRankError, PlanError, ReshardError
from ..execute import DEFAULT_MAX_MEMORY, SourceFiles
from ..formats.registry import open_reader
from ..tasks import FORMAT_CKPT, FORMAT_SAFETENSORS
from ..formats import dtypes
from ..storage.atomic import write_bytes_atomic
from ..formats.ckpt import CRC_TRAILER_LEN, CheckpointReader
from ..formats.strategy import format_for, to_protobuf_bytes
from ..hashing import HashCache, default_cache_path, digest_file, digest_files
from ..plan import UNMAPPED_FULL, UNMAPPED_OMIT, Plan, Planner
from ..sources import discover, load_strategy
from ..topology import Topology
from .declarative import compile_layout
from .manifest import build_manifest, job_fingerprint
from .memory import fix_mmap_threshold
from .outputs import COMPLETE, PARTIAL, JournalEntry, OutputDir
from .parallel import RankTask, WriteOptions, default_workers, run_tasks
from ..text import human_size
from .progress import Progress, parse_bytes
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


@dataclass
class _Target:
    topology: Topology | None  # None: one whole, unsharded checkpoint
    strategy_path: str | None  # the user's strategy file (copied into the output), or None
    compiled: Any = None  # CompiledLayout when declarative
    devices: int = 1

    def strategy_bytes(self) -> tuple[str, bytes] | None:
        """(file name in the output directory, bytes) of the target strategy, if there is one."""
        if self.topology is None:
            return None
        if self.strategy_path is not None:
            with open(self.strategy_path, "rb") as f:
                data = f.read()
            return ("strategy.json" if format_for(self.strategy_path) == "json" else "strategy.ckpt"), data
        return "strategy.ckpt", to_protobuf_bytes(self.compiled.strategy)


def run_job(cfg: dict, ctx: JobContext) -> JobResult:
    """Run one conversion (or plan) described by a resolved config dict."""
    fix_mmap_threshold()
    return ConversionJob(cfg, ctx).run()


class ConversionJob:
    def __init__(self, cfg: dict, ctx: JobContext):
        self.cfg = cfg
        self.ctx = ctx
        self.job_cfg = cfg["job"]
        self.target_cfg = dict(cfg["target"])
        self.sources: SourceFiles | None = None
        self._plan_json: dict | None = None

    # =============================================================================== settings
    def _settings(self) -> None:
        job, target = self.job_cfg, self.target_cfg
        self.mode = job.get("mode", "convert")
        if self.mode not in ("convert", "plan"):
            raise ConfigError(f"job.mode must be 'convert' or 'plan', got {self.mode!r}")
        self.fmt = target.get("format", FORMAT_CKPT)
        if self.fmt not in (FORMAT_CKPT, FORMAT_SAFETENSORS):
            raise ConfigError(f"target.format must be 'ckpt' or 'safetensors', got {self.fmt!r}")
        self.prefix = target.get("prefix", "checkpoint_")
        if (not isinstance(self.prefix, str) or "/" in self.prefix or (os.altsep and os.altsep in self.prefix)
                or self.prefix in (".", "..")):
            raise ConfigError(f"target.prefix must be the start of a file name (no '/'), got {self.prefix!r}")
        self.unmapped = target.get("unmapped", UNMAPPED_OMIT)
        if self.unmapped not in (UNMAPPED_OMIT, UNMAPPED_FULL):
            raise ConfigError(f"target.unmapped must be 'omit' or 'full', got {self.unmapped!r}")
        try:
            self.max_memory = parse_bytes(job.get("max_memory") or DEFAULT_MAX_MEMORY)
        except ValueError as e:
            raise ConfigError(f"job.max_memory: {e}") from None
        if self.max_memory < 1024:
            raise ConfigError(f"job.max_memory={self.max_memory} bytes is too small (at least 1 KiB)")
        self.crc = bool(target.get("crc", False))
        self.target_cfg["strategy"] = _abs(target.get("strategy"), self.ctx.launch_dir)
        self.out_dir = (_abs(self.cfg["output"].get("dir"), self.ctx.launch_dir)
                        or os.path.join(self.ctx.run_dir, "output"))

    # =============================================================================== run
    def run(self) -> JobResult:
        self._settings()
        # A conversion's lineage run is opened (schema check, abandoned runs, new run) in a thread
        # while the sources are read and planned, and before any output is written, so a killed
        # job leaves a run to mark abandoned. Plan mode records nothing.
        pool = self._lineage_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lineage")
        self._lineage = pool.submit(self._open_lineage if self.mode == "convert" else lambda: (None, None))
        try:
            return self._run_phases()
        except BaseException as e:
            self._record_failure(e)
            raise
        finally:
            pool.shutdown(wait=True)
            if self._lineage.exception() is None:
                store, _ = self._lineage.result()
                if store is not None:
                    store.close()

    def _run_phases(self) -> JobResult:
        self._find_sources()
        self.sources = SourceFiles(self.source_paths, verify_crc=False)
        try:
            self._index_sources()
            self._settle_target()
            self._make_plan()
            if self.mode == "plan":
                return self._plan_only()
            self._planned = self._lineage_pool.submit(self._record_plan)  # queued behind the run's creation
            if self.missing:
                raise MissingRankError(self.missing, self.checkpoints)
            out = self._prepare_output()
            out.lock()
            try:
                return self._convert(out, self._hash_sources())
            finally:
                out.unlock()
        finally:
            self.sources.close()

    def _record_failure(self, e: BaseException) -> None:
        """Mark the lineage run failed with the error; a database failure becomes a one-line error."""
        store = run_id = None
        try:
            store, run_id = self._lineage.result()
        except BaseException as le:
            if le is not e:  # both failed: the job's own error is the one to report
                log.error("could not record the run in the lineage database: %s", self._lineage_error(le) or le)
        db_error = self._lineage_error(e)
        if store is not None and run_id is not None:
            try:
                store.fail_run(run_id, _error_text(db_error or e))
            except Exception as le:  # the original error matters more
                log.error("could not record the failure in the lineage database: %s", self._lineage_error(le) or le)
        if db_error is not None:
            raise db_error from e

    # =============================================================================== sources
    def _find_sources(self) -> None:
        source_cfg = self.cfg["source"]
        self.checkpoints = _abs(source_cfg.get("checkpoints"), self.ctx.launch_dir)
        self.strategy = _abs(source_cfg.get("strategy"), self.ctx.launch_dir)
        if self.checkpoints is None:
            if self.strategy is not None:
                raise ConfigError("source.strategy is set but source.checkpoints is not")
            self.checkpoints, self.strategy = ensure_demo(os.path.join(self.ctx.launch_dir, "runs", "demo"))
            log.info("no source.checkpoints given: using the built-in demo (MLP 784-512-512-10 on 8 ranks) at %s",
                     self.checkpoints)
        self.found = discover(self.checkpoints, source_cfg.get("select", "last"))
        self.src = load_strategy(self.strategy)
        devices = self.src.topology.devices
        self.extra = sorted(r for r in self.found.files if r >= devices)
        if self.extra:
            which = "ies" if len(self.extra) > 1 else "y"
            names = ", ".join(f"rank_{r}" for r in self.extra)
            if self.strategy is None:
                log.warning("ignoring rank director%s %s: without source.strategy the source is one unsharded rank "
                            "(rank_0); if the rank directories hold shards of one model, set source.strategy",
                            which, names)
            else:
                log.warning("ignoring rank director%s %s: the source strategy describes only %d rank(s)",
                            which, names, devices)
        for rank, others in sorted(self.found.ignored.items()):
            if rank < devices:
                log.info("rank_%d: using %s, ignoring %s", rank, os.path.basename(self.found.files[rank]),
                         ", ".join(others))
        self.source_paths = {r: p for r, p in self.found.files.items() if r < devices}

    def _index_sources(self) -> None:
        self.index = self.sources.index()
        self.crc_info = {}
        for r in self.source_paths:
            reader = self.sources.reader(r)
            if isinstance(reader, CheckpointReader) and reader.has_crc:
                self.crc_info[r] = reader.crc_stored
        if self.extra:
            self._check_extra_ranks()
        absent = [n for n in self.src.topology.layouts if not any(n in names for names in self.index.values())]
        if absent:
            log.warning("%d parameter(s) of the source strategy are in no source checkpoint and will not be in "
                        "the outputs: %s%s", len(absent), ", ".join(repr(n) for n in absent[:5]),
                        ", ..." if len(absent) > 5 else "")

    def _check_extra_ranks(self) -> None:
        """Ignoring rank directories beyond the strategy's devices is safe only when they hold nothing
        the others lack; otherwise (a pipeline strategy directory missing its last stage, the strategy
        of another run) their parameters would silently be missing from the outputs."""
        known = set().union(*self.index.values()) if self.index else set()
        files = self.found.files
        for r in self.extra:
            try:
                with open_reader(files[r], verify_crc=False) as reader:
                    unknown = [n for n in reader.names() if n not in known]
            except ReshardError as e:
                log.warning("rank_%d is ignored and cannot be read either: %s", r, e)
                continue
            if not unknown:
                continue
            if self.strategy is None:
                hint = "set source.strategy to the strategy these checkpoints were saved with"
            elif os.path.isdir(self.strategy):
                hint = f"is a pipeline stage's strategy file missing from {self.strategy}?"
            else:
                hint = "was source.strategy saved with these checkpoints?"
            scope = ("the one unsharded rank read without source.strategy" if self.strategy is None
                     else f"the {self.src.topology.devices} rank(s) the source strategy describes")
            raise PlanError(
                f"{files[r]}: rank {r} lies beyond {scope}, but holds {len(unknown)} parameter(s) that no rank "
                f"within it holds (e.g. {unknown[0]!r}); {hint}"
            )

    # =============================================================================== target, plan
    def _settle_target(self) -> None:
        t = self.target_cfg
        devices = t.get("devices")
        if devices is not None and (not isinstance(devices, int) or devices < 1):
            raise ConfigError(f"target.devices must be a positive integer, got {devices!r}")
        layout = t.get("layout")
        has_layout = bool(layout) and bool(layout.get("mesh"))
        if t.get("strategy") is not None:
            # A strategy file given on the command line wins over the default preset's declarative
            # layout and device count; given explicitly, they must agree with it.
            if has_layout and self.ctx.user_set("target.layout"):
                raise ConfigError("give target.strategy or target.layout, not both (set target.layout=null)")
            if not self.ctx.user_set("target.devices"):
                devices = None
            if os.path.isdir(t["strategy"]):
                raise ConfigError("target.strategy must be a single strategy file (merge per-stage files first)")
            loaded = load_strategy(t["strategy"])
            derived = loaded.topology.devices
            if devices is not None and devices != derived:
                raise ConfigError(f"target.devices={devices} but target.strategy {t['strategy']} describes "
                                  f"{derived} devices")
            self.tgt = _Target(loaded.topology, t["strategy"], None, derived)
        elif has_layout:
            if devices is None:
                raise ConfigError("target.layout needs target.devices")
            compiled = compile_layout(layout, devices, self._global_shapes())
            compiled.strategy.path = "target.layout"
            self.tgt = _Target(Topology.from_strategy(compiled.strategy), None, compiled, devices)
        elif devices not in (None, 1):
            raise ConfigError(f"target.devices={devices} needs target.strategy or target.layout to say how to shard")
        else:
            self.tgt = _Target(None, None, None, 1)

    def _global_shapes(self) -> dict[str, tuple[int, ...]]:
        planner = Planner(self.src.topology, None, self.index)
        return {ps.name: ps.global_shape for ps in planner.params
                if ps.meta is not None and ps.meta.kind == "tensor" and dtypes.BY_NAME[ps.meta.dtype].sliceable}

    def _make_plan(self) -> None:
        planner = Planner(self.src.topology, self.tgt.topology, self.index, unmapped=self.unmapped)
        if self.tgt.compiled is not None:
            planner.notes.extend(self.tgt.compiled.notes)
        ranks = self.job_cfg.get("ranks")
        if ranks is not None:
            bad = [r for r in ranks if not isinstance(r, int) or not 0 <= r < self.tgt.devices]
            if bad:
                raise ConfigError(f"job.ranks {bad} are not target ranks (0..{self.tgt.devices - 1})")
            ranks = sorted(set(ranks))
        self.ranks = ranks
        self.missing: dict[int, list[int]] = {}
        self.plan: Plan = planner.plan(ranks, missing=self.missing)
        self.predicted_peak = min(self.max_memory, 2 * max((rp.largest_slice for rp in self.plan.ranks), default=0))

    @property
    def plan_json(self) -> dict:
        if self._plan_json is None:  # large for big models: build it once
            self._plan_json = self.plan.to_json()
        return self._plan_json

    def _plan_only(self) -> JobResult:
        os.makedirs(self.ctx.run_dir, exist_ok=True)
        plan_path = os.path.join(self.ctx.run_dir, "plan.json")
        doc = dict(self.plan_json)
        doc["predicted_peak_memory"] = self.predicted_peak
        doc["missing"] = {str(k): v for k, v in sorted(self.missing.items())}
        tmp = plan_path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, plan_path)
        print(plan_report(self.plan, predicted_peak=self.predicted_peak, missing=self.missing))
        print(f"\nplan written to {plan_path} (nothing else was written)")
        if self.missing:
            raise MissingRankError(self.missing, self.checkpoints)
        return JobResult(STATUS_PLANNED, None, None, None, self.tgt.devices, plan_path)

    # =============================================================================== output dir
    def _prepare_output(self) -> OutputDir:
        out = OutputDir(self.out_dir, overwrite=bool(self.cfg["output"].get("overwrite", False)))
        source_dirs = [self.checkpoints] + ([self.strategy] if self.strategy and os.path.isdir(self.strategy) else [])
        source_files = list(self.source_paths.values()) + list(self.src.files)
        out.check_not_source(source_dirs, source_files)
        self.out_paths = {rp.target_rank: os.path.join(out.path, f"rank_{rp.target_rank}",
                                                       f"{self.prefix}{rp.target_rank}.{self.fmt}")
                          for rp in self.plan.ranks}
        planned = list(self.out_paths.values()) + [out.manifest_path]
        planned += [os.path.join(out.path, n) for n in ("strategy.ckpt", "strategy.json")]
        out.check_not_overwriting(planned, source_files, source_dirs)
        out.check_writable()
        out.check_not_foreign()
        return out

    # =============================================================================== lineage
    def _lineage_url(self) -> str:
        lin = self.cfg.get("lineage") or {}
        url = lin.get("url") or "sqlite:///" + os.path.join(self.ctx.launch_dir, "runs", "lineage.db")
        if url.startswith("sqlite:///") and not url.startswith("sqlite:////"):
            rel = url[len("sqlite:///"):]
            if rel and rel != ":memory:":
                url = "sqlite:///" + _abs(rel, self.ctx.launch_dir)
        return url

    def _open_lineage(self):
        lin = self.cfg.get("lineage") or {}
        if not lin.get("enabled", True):
            return None, None
        from ..lineage import LineageError, LineageStore

        logging.getLogger("alembic").setLevel(logging.WARNING)  # migration chatter is not the job's news
        url = self._lineage_url()
        if url.startswith("sqlite:///"):
            db_dir = os.path.dirname(url[len("sqlite:///"):]) or "."
            try:
                os.makedirs(db_dir, exist_ok=True)
            except OSError as e:
                raise LineageError(f"lineage database {url}: cannot create {db_dir} ({e.strerror}); "
                                   "lineage.enabled=false runs without recording") from None
        store = LineageStore(url)
        try:
            store.ensure_schema()
            abandoned = store.mark_abandoned_runs()
            if abandoned:
                log.warning("lineage: marked %d run(s) left 'started' by killed processes as abandoned: %s",
                            len(abandoned), ", ".join(a[:8] for a in abandoned))
            run_id = store.start_run(config=self.cfg, overrides=list(self.ctx.overrides), tool_version=__version__,
                                     output_dir=self.out_dir, source_devices=None, target_devices=None,
                                     sweep_id=self.ctx.sweep_id, job_num=self.ctx.job_num)
        except BaseException:
            store.close()
            raise
        return store, run_id

    def _record_plan(self) -> None:
        """Record the plan (and so the devices and rank map) once known; runs in the lineage
        thread, while the parent process mostly waits for its workers."""
        store, run_id = self._lineage.result()
        if store is not None:
            store.record_plan(run_id, self.plan_json)

    def _lineage_error(self, e: BaseException):
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
        url = self._lineage_url()
        if "://" in url and "@" in url:  # keep passwords out of messages
            scheme, rest = url.split("://", 1)
            url = f"{scheme}://***@{rest.rsplit('@', 1)[1]}"
        return LineageError(f"lineage database {url}: {detail} (lineage.enabled=false runs without recording)")

    # =============================================================================== hashing
    def _hash_sources(self):
        """sha256 of every source file read (and of the strategy files), verifying CRC trailers."""
        needed = sorted(self.plan.source_ranks)
        paths = [self.source_paths[r] for r in needed]
        cache = HashCache(default_cache_path()) \
            if self.job_cfg.get("hash_cache", True) else None
        requests = [(p, (os.path.getsize(p) - CRC_TRAILER_LEN) if r in self.crc_info else None)
                    for r, p in zip(needed, paths)]
        todo = sum(os.path.getsize(p) for p, c in requests if cache is None or cache.get(p, c) is None)
        prog = Progress(todo, len(needed), enabled=self.job_cfg.get("progress"), desc="hashing sources")
        try:
            digests = digest_files(requests, threads=2, progress=prog.add_bytes, cache=cache)
        finally:
            prog.close()
        if cache is not None:
            cache.save()
        for r, d in zip(needed, digests):
            if r in self.crc_info and d.crc32 != self.crc_info[r]:
                raise CheckpointFormatError(self.source_paths[r], f"CRC32 mismatch: trailer says {self.crc_info[r]}, "
                                                                  f"records give {d.crc32} (file corrupted)")
        source_files = [{"rank": r, "path": d.path, "size": d.size, "sha256": d.sha256} for r, d in zip(needed, digests)]
        strategy_files = [digest_file(p) for p in self.src.files]
        return source_files, strategy_files

    # =============================================================================== convert
    def _lineage_run(self):
        """(store, run id) once the lineage thread is done (re-raises its error); (None, None) if off."""
        return self._lineage.result()

    def _convert(self, out: OutputDir, digests) -> JobResult:
        from ..lineage.records import FileRecord

        source_files, strategy_files = digests
        source_strategy = None
        if self.strategy is not None:
            source_strategy = {"path": self.strategy,
                               "files": [{"path": d.path, "size": d.size, "sha256": d.sha256} for d in strategy_files]}
            if len(strategy_files) == 1 and not os.path.isdir(self.strategy):
                source_strategy.update(size=strategy_files[0].size, sha256=strategy_files[0].sha256)
        target_strategy = self.tgt.strategy_bytes()
        fingerprint = job_fingerprint(
            source_files=source_files, source_strategy=source_strategy,
            target_strategy_sha256=hashlib.sha256(target_strategy[1]).hexdigest() if target_strategy else None,
            target={"devices": self.tgt.devices, "format": self.fmt, "prefix": self.prefix,
                    "unmapped": self.unmapped, "crc": self.crc, "ranks": self.ranks},
        )
        inputs = [FileRecord(f["path"], f["sha256"], f["size"], "source_checkpoint", f["rank"]) for f in source_files]
        inputs += [FileRecord(d.path, d.sha256, d.size, "strategy") for d in strategy_files]
        store, run_id = self._lineage_run()  # the run exists before any output is written
        if store is not None:  # recorded by the lineage thread, after the plan, while ranks convert
            self._inputs_recorded = self._lineage_pool.submit(store.record_inputs, run_id, inputs)

        # -- resume / idempotence -------------------------------------------------------------
        state = out.state(fingerprint)
        resume = bool(self.job_cfg.get("resume", True))
        if state == COMPLETE:
            listed = _listed_outputs(out)
            damaged = [e for e in listed if _size_or_none(os.path.join(out.path, e.path)) != e.size]
            if resume and not damaged:
                return self._reuse_complete(out, store, run_id, listed)
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
        if target_strategy is not None:
            name, data = target_strategy
            path = os.path.join(out.path, name)
            size, sha = write_bytes_atomic(path, data, mode=0o444)
            strategy_out = {"path": path, "size": size, "sha256": sha,
                            "from": self.tgt.strategy_path or "target.layout"}

        kept = out.reusable(self.out_paths) if resume else {}
        if kept:
            log.info("resuming: keeping %d target file(s) that verify: ranks %s", len(kept), sorted(kept))
        written: dict[int, dict] = {r: {"path": self.out_paths[r], "size": e.size, "sha256": e.sha256,
                                        "tensors": e.tensors} for r, e in kept.items()}
        self._run_ranks(out, kept, written)

        self._planned.result()  # the plan is recorded (and its JSON built) by the lineage thread
        if store is not None:
            self._inputs_recorded.result()
        # -- manifest (last) ------------------------------------------------------------------
        target_files = [{"rank": r, "path": written[r]["path"], "size": written[r]["size"],
                         "sha256": written[r]["sha256"]} for r in sorted(written)]
        manifest = build_manifest(
            run_id=run_id or "", tool_version=__version__, fingerprint=fingerprint, config=self.cfg,
            source={"checkpoints": self.checkpoints, "select": self.cfg["source"].get("select", "last"),
                    "devices": self.src.topology.devices, "stage_devices": self.src.topology.stage_devices,
                    "stages": self.src.topology.num_stages, "strategy": source_strategy, "files": source_files},
            target={"devices": self.tgt.devices, "format": self.fmt, "prefix": self.prefix, "ranks": self.ranks,
                    "strategy": strategy_out, "files": target_files},
            tensors={str(r): written[r]["tensors"] for r in sorted(written)},
            plan_summary={"totals": self.plan_json["totals"], "omitted": self.plan.omitted, "notes": self.plan.notes,
                          "source_ranks": {str(rp.target_rank): rp.source_ranks for rp in self.plan.ranks}},
        )
        m_size, m_sha = out.write_manifest(manifest)
        if store is not None:
            outputs = [FileRecord(f["path"], f["sha256"], f["size"], "target_checkpoint", f["rank"])
                       for f in target_files]
            if strategy_out is not None:
                outputs.append(FileRecord(strategy_out["path"], strategy_out["sha256"], strategy_out["size"],
                                          "strategy"))
            outputs.append(FileRecord(out.manifest_path, m_sha, m_size, "manifest"))
            store.complete_run(run_id, outputs=outputs)
        return JobResult(STATUS_COMPLETED, out.path, run_id, manifest["manifest_sha256"], self.tgt.devices)

    def _run_ranks(self, out: OutputDir, kept: dict, written: dict) -> None:
        tasks = [RankTask(rp, self.out_paths[rp.target_rank]) for rp in self.plan.ranks if rp.target_rank not in kept]
        workers = self.job_cfg.get("workers") or default_workers(len(tasks))
        if not isinstance(workers, int) or workers < 1:
            raise ConfigError(f"job.workers must be a positive integer, got {workers!r}")
        workers = min(workers, max(1, len(tasks)))
        total_out = sum(rp.bytes_written for rp in self.plan.ranks if rp.target_rank not in kept)
        prog = Progress(total_out, len(tasks), enabled=self.job_cfg.get("progress"), desc="converting")
        log.info("converting %d target rank(s) with %d worker(s): %s to write", len(tasks), workers,
                 human_size(total_out))

        def on_done(rank: int, wf) -> None:
            written[rank] = {"path": wf.path, "size": wf.size, "sha256": wf.sha256, "tensors": wf.tensors}
            out.append_journal(JournalEntry(rank, out.relative(wf.path), wf.size, wf.sha256, wf.tensors))
            prog.rank_done(rank, wf.size)

        try:
            run_tasks(tasks, self.source_paths, WriteOptions(self.fmt, self.max_memory, self.crc),
                      workers=workers, on_bytes=prog.add_bytes, on_done=on_done, sources=self.sources)
        finally:
            prog.close()

    def _reuse_complete(self, out: OutputDir, store, run_id, listed: list[JournalEntry]) -> JobResult:
        """The same job already completed here and its files are in place: do nothing else."""
        from ..lineage.records import FileRecord

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
            self._planned.result()
            self._inputs_recorded.result()
            store.complete_run(run_id, outputs=outputs)
        return JobResult(STATUS_REUSED, out.path, run_id, manifest.get("manifest_sha256"),
                         manifest["target"]["devices"])


def _error_text(e: BaseException) -> str:
    if isinstance(e, KeyboardInterrupt):
        return "interrupted"
    return str(e) or type(e).__name__


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
