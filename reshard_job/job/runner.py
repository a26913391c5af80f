"""The job: the stages of one conversion in order, over typed values.

``run_job(spec)`` takes a settled ``JobSpec`` (``job.settle``) and carries a conversion through:

1. open the lineage run (in a thread, while the rest goes on; plan mode records nothing);
2. ``prepare``: find and index the sources, settle the target, cross-check, plan
   (``job.mode=plan`` stops here and writes only ``plan.json`` into the run directory);
3. check and lock the output directory; hash the needed sources, checking their CRCs;
4. ``convert``: reuse, resume or start; run the rank tasks; journal each file; manifest last;
5. record the outputs in the lineage database.

A failure or an interrupt after the run was opened marks it failed (or interrupted) with the error's
one line; partial files are never recorded as outputs, temporary files are removed, the lock is
released. The Python API runs the same ``prepare`` and rank tasks without the output directory's
bookkeeping.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass
from typing import Callable

from reshard_job.errors import MissingRankError
from reshard_job.storage import storage_for
from reshard_job.jsonchunks import iter_json
from reshard_job.storage.atomic import AtomicFile
from reshard_job.job.stages.convert import Outputs, convert
from reshard_job.job.stages.executor_choice import cluster_layout
from reshard_job.sources.demo import demo_folder
from reshard_job.sources.index_cache import IndexCache
from reshard_job.job.stages.integrity import hash_sources
from reshard_job.job.stages.proof import source_taps
from reshard_job.job.run.memory import fix_mmap_threshold
from reshard_job.job.output.directory import OutputDir
from reshard_job.job.output.journal import TENSORS_DIR
from reshard_job.lineage.uses import check_names_recordable
from reshard_job.job.stages.prepare import HashWhileIndexing, Prepared, check_identical, prepare
from reshard_job.job.stages.record import LineageRecorder, NoRecorder
from reshard_job.job.stages.report import plan_report
from reshard_job.job.run.signals import interruptible
from reshard_job.job.config.spec import MODE_PLAN, JobSpec

log = logging.getLogger("reshard_job")

STATUS_PLANNED = "planned"
STATUS_FAILED = "failed"
STATUS_INTERRUPTED = "interrupted"


@dataclass
class JobResult:
    status: str
    output_dir: str | None = None
    run_id: str | None = None
    manifest_sha256: str | None = None  # sha256 of the manifest file (what sha256sum prints)
    target_devices: int | None = None
    plan_path: str | None = None
    lineage_url: str | None = None
    error: str | None = None
    nodes: list[dict] | None = None  # per Ray node throughput (job.executor=ray)

    def to_json(self) -> dict:
        return asdict(self)


def run_job(spec: JobSpec, emit: Callable[[str], None] = print) -> JobResult:
    """Run one conversion (or plan). Errors propagate (a ReshardError is one line) and carry the
    lineage run id, if one was opened, as ``err.run_id``. `emit` prints reports (the plan table)."""
    fix_mmap_threshold()
    plan_mode = spec.run.mode == MODE_PLAN
    with interruptible():
        recorder = LineageRecorder(spec) if spec.lineage.enabled and not plan_mode else NoRecorder()
        try:
            if not plan_mode:  # another job writing output.dir: refused before any source is read
                OutputDir(spec.output.dir, storage_for(spec.output.dir, spec.storage)).refuse_if_locked()
            # a conversion hashes what it reads: remote sources then while they are indexed
            hashing = None if plan_mode else HashWhileIndexing(spec.run.hash_cache, spec.run.progress)
            # job.hash_cache also keeps what walking a local source found (``index_cache``)
            prepared = prepare(spec.source, spec.target, ranks=spec.run.ranks, storage=spec.storage,
                               demo_root=demo_folder(), hashing=hashing,
                               index_cache=IndexCache() if spec.run.hash_cache else None,
                               one_device=not plan_mode and spec.run.fingerprints)
            try:
                if plan_mode:
                    return _plan_only(spec, prepared, emit)
                return _convert(spec, prepared, recorder)
            finally:
                prepared.close()
        except BaseException as e:
            recorder.fail(e)
            e.run_id = recorder.run_id
            raise
        finally:
            recorder.close()


def _convert(spec: JobSpec, prepared: Prepared, recorder) -> JobResult:
    # built by the lineage thread when it records it, and dropped then: for a model of many
    # parameters the document is tens of MB that the conversion has no use for
    recorder.record_plan(lambda: _plan_json(prepared, lazy=True))  # written in pieces by the lineage store
    if prepared.missing:
        raise MissingRankError(prepared.missing, prepared.source.checkpoints)
    cluster_layout(spec, prepared.target.devices)  # target.cluster against devices read from target.strategy
    out = _open_output(spec, prepared)
    recorder.ensure_open()  # the run exists before any output is written
    out.lock()
    try:
        digests = hash_sources(prepared, use_cache=spec.run.hash_cache, progress=spec.run.progress,
                               storage=spec.storage, make_taps=lambda: source_taps(spec, prepared))
        outputs: Outputs = convert(spec, prepared, out, digests, recorder)
    except BaseException:
        out.remove_temp_files()  # what killed workers left; the journaled files stay for a resume
        raise
    finally:
        out.unlock()
    from reshard_job.secrets import mask_url

    return JobResult(outputs.status, outputs.out_dir, outputs.run_id, outputs.manifest_sha256,
                     prepared.target.devices, nodes=outputs.nodes,
                     lineage_url=mask_url(spec.lineage.url) if outputs.run_id else None)


def _open_output(spec: JobSpec, prepared: Prepared) -> OutputDir:
    """The output directory, checked before anything (the lock included) is written into it."""
    storage = storage_for(spec.output.dir, spec.storage)
    out = OutputDir(spec.output.dir, storage, overwrite=spec.output.overwrite)
    source_dirs, source_files = source_places(prepared)
    check_names_recordable([out.path, *source_files])
    out.check_not_source(source_dirs, source_files)
    from reshard_job.job.stages.convert import unit_paths

    planned = list(unit_paths(prepared, out.path, spec.target.prefix, spec.target.format, storage).values())
    planned += [out.manifest_path] + [storage.join(out.path, n) for n in ("strategy.ckpt", "strategy.json")]
    # the state folder and the one below it: the lock, the journal, the per-rank tensor records
    planned += [storage.join(out.state_dir, "lock"), storage.join(out.state_dir, TENSORS_DIR, "rank_0.json")]
    out.check_planned(planned, source_files, source_dirs)
    out.check_writable()
    out.check_not_foreign()
    return out


def source_places(prepared: Prepared) -> tuple[list[str], list[str]]:
    """(the source folders, the source files) no output may be written into or over."""
    source = prepared.source
    source_dirs = [] if source.checkpoints is None else [source.checkpoints]
    source_dirs += [source.strategy] if prepared.strategy.files and source.strategy not in prepared.strategy.files else []
    checkpoint_files = prepared.source_files()
    # the rank folders too: under another path (a bind mount) one is no longer inside the others
    under = None if source.checkpoints is None else source.checkpoints.rstrip("/") + "/"
    source_dirs += sorted({os.path.dirname(f) for f in checkpoint_files
                           if "://" not in f and under is not None and os.path.dirname(f).startswith(under)})
    return source_dirs, checkpoint_files + list(prepared.strategy.files)


def _plan_json(prepared: Prepared, *, lazy: bool = False) -> dict:
    doc = prepared.plan.to_json(lazy=lazy)
    doc["checks"] = list(prepared.checks)
    # rank -> its file, or the list of files read together as that rank (a MindFormers rank)
    doc["source_files"] = {str(r): p for r, p in sorted(prepared.source_paths.items())}
    if prepared.export is not None:
        doc["export"] = prepared.export.index_document() | {
            "left_out": [{"name": n, "reason": why} for n, why in prepared.export.left_out]}
    return doc


def _plan_only(spec: JobSpec, prepared: Prepared, emit: Callable[[str], None]) -> JobResult:
    check_identical(prepared)  # the conversion compares them while hashing; a plan reads them
    run_dir = spec.context.run_dir
    plan_path = os.path.join(run_dir, "plan.json")
    peak = min(spec.run.max_memory, 2 * max((rp.largest_slice for rp in prepared.plan.ranks), default=0))
    doc = _plan_json(prepared, lazy=True)  # its per-rank lists made as they are written, a piece at a time
    doc["predicted_peak_memory"] = peak
    doc["missing"] = {str(k): v for k, v in sorted(prepared.missing.items())}
    with AtomicFile(plan_path, mode=0o644) as f:  # (300,000 parameters' plan as one string held 0.9 GB)
        for piece in iter_json(doc, indent=1):
            f.write(piece.encode("utf-8"))
    emit(plan_report(prepared.plan, predicted_peak=peak, missing=prepared.missing,
                     source_files=prepared.source_paths, checks=prepared.checks)
         + f"\n\nplan written to {plan_path} (nothing else was written)")
    if prepared.missing:
        raise MissingRankError(prepared.missing, prepared.source.checkpoints)
    return JobResult(STATUS_PLANNED, None, None, None, prepared.target.devices, plan_path)
