"""A complete output directory of this very job: nothing to do while everything it lists still
verifies (every file, the target strategy beside them, and the manifest itself: the one this tool
committed there, by its seal); otherwise back to partial, keeping what verifies."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from reshard_job.lineage.file_records import FileRecord
from reshard_job.job.output.directory import OutputDir, still_holds
from reshard_job.job.output.journal import JournalEntry
from reshard_job.job.output.node_outputs import node_manifest_records
from reshard_job.job.config.spec import JobSpec

log = logging.getLogger("reshard_job")

STATUS_COMPLETED = "completed"
STATUS_REUSED = "completed (already done)"


@dataclass
class Outputs:
    status: str
    out_dir: str
    manifest_path: str
    manifest_sha256: str  # of the file, as sha256sum prints it
    run_id: str | None = None
    files: list[dict] = field(default_factory=list)
    nodes: list[dict] | None = None  # per Ray node: ranks, bytes, seconds (job.executor=ray)


def reuse_if_intact(spec: JobSpec, out: OutputDir, fingerprint: str, recorder, files,
                     strategy_copied: bool) -> Outputs | None:
    """A complete directory of this very job: nothing to do if every listed file still verifies
    (same identity as journaled, else re-hashed; on its node for per-node outputs); otherwise back
    to partial, keeping what verifies."""
    from reshard_job.sources.file_digests import digest_file

    manifest = out.read_manifest() or {}
    listed = out.listed_outputs(manifest)
    damaged, whole = files.verify_complete(listed, manifest)
    m = digest_file(out.manifest_path)
    sealed = out.manifest_sealed(m.size, m.sha256)
    strategy_ok = _strategy_intact(out, manifest)
    if spec.run.resume and not damaged and whole and sealed and strategy_ok:
        log.info("nothing to do: %s already holds this conversion (run %s)", out.path, manifest.get("run_id"))
        return _record_reuse(out, manifest, listed, recorder, strategy_copied, m)
    if spec.run.resume:
        problems = [f"{len(damaged)} file(s) listed in its manifest are missing or changed "
                    f"({', '.join(e.path for e in damaged[:8])})"] if damaged else []
        problems += [] if sealed else ["manifest.json is not the one this tool committed there"]
        problems += [] if strategy_ok else ["strategy.ckpt is missing or changed"]
        log.warning("%s: %s; redoing what does not verify", out.path, "; ".join(problems or ["files to write again"]))
    else:
        log.info("job.resume=false: redoing the conversion already complete in %s", out.path)
    keep = [e for e in listed if e not in damaged] if spec.run.resume else []
    for e in keep:  # per-tensor digests from the manifest only where it is the one committed, else the journal's
        e.tensors = manifest.get("tensors", {}).get(str(e.rank), {}) if sealed else out.journal.tensors(e)
    out.uncommit(fingerprint, [e for e in keep if e.tensors is not None])
    return None


def _listed_strategy(out: OutputDir, manifest: dict) -> tuple[str, dict] | None:
    """(where it lies now, its manifest entry) of the target strategy written beside the ranks, if any."""
    strat = (manifest.get("target") or {}).get("strategy")
    if not strat:
        return None
    return out.storage.join(out.path, out.storage.basename(str(strat.get("path", "")))), strat


def _strategy_intact(out: OutputDir, manifest: dict) -> bool:
    """Whether the target strategy the manifest lists still holds what it lists."""
    listed = _listed_strategy(out, manifest)
    return listed is None or still_holds(out.storage, listed[0], listed[1].get("size"), listed[1].get("sha256"), ())


def _record_reuse(out: OutputDir, manifest: dict, listed: list[JournalEntry], recorder,
                  strategy_copied: bool, m) -> Outputs:
    # the target rank of each file, as its manifest entry says (an export's files are all rank 0's)
    ranks = [f.get("rank", e.rank) for f, e in zip(manifest.get("target", {}).get("files", []), listed)]
    outputs = [FileRecord(out.storage.join(out.path, e.path), e.sha256, e.size, "target_checkpoint", rank)
               for e, rank in zip(listed, ranks)]
    listed_strategy = _listed_strategy(out, manifest)
    if listed_strategy is not None:
        path, strat = listed_strategy
        outputs.append(FileRecord(path, strat["sha256"], strat["size"], "strategy", copied=strategy_copied))
    outputs += node_manifest_records(manifest.get("target") or {})
    outputs.append(FileRecord(out.manifest_path, m.sha256, m.size, "manifest"))
    run_id = recorder.complete(outputs)
    return Outputs(STATUS_REUSED, out.path, out.manifest_path, m.sha256, run_id,
                   [{"rank": rank, "path": out.storage.join(out.path, e.path), "size": e.size, "sha256": e.sha256}
                    for e, rank in zip(listed, ranks)])
