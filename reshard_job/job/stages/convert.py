"""Converting into an output directory: reuse, resume or start; run the rank tasks; manifest last.

The same job run again into its own output directory does no conversion work once its files
verify (``completed (already done)``); an interrupted one resumes, keeping the journaled files that
still verify. Each finished rank is journaled as it lands. Before the manifest is written, every
source the tasks read is checked to be unchanged since it was hashed, so what the manifest and
the lineage record name is what the outputs were made from.

Units of output. Each output file is journaled under an integer key: the target rank, or for an
export (``target.format=safetensors_index``) the file's number: shards ``0..n-1`` (written by rank
tasks whose ``part`` is that number), MindSpore's ``param_name_map.json`` ``n + 1`` when there are
several shards, and the index ``n`` (both written here once every shard is done, the index last).
Every export file belongs to target rank 0, the one full rank, and is recorded so in the manifest
(``rank`` 0, ``part`` the key) and in lineage. Manifest entries name each file relative to the
output directory (``file``), so a moved directory still verifies whatever its layout.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import replace

from reshard_job import __version__
from reshard_job.sources.open_files import current_identity, same_identity
from reshard_job.formats.hf_index import EXPORT_METADATA, INDEX_FILE, PARAM_NAME_MAP_FILE
from reshard_job.formats.registry import suffix_of
from reshard_job.formats.safetensors.header import DEDUPLICATED_METADATA
from reshard_job.lineage.file_records import FileRecord
from reshard_job.plan.model import Plan
from reshard_job.errors import OutputError
from reshard_job.storage import SourceChangedError
from reshard_job.execute.writer_tap import TargetSums
from reshard_job.execute.tasks import FORMAT_CKPT, FORMAT_SAFETENSORS, FORMAT_SAFETENSORS_INDEX, RankResult, RankTask, WriteOptions
from reshard_job.text import human_size
from reshard_job.job.stages.executor_choice import ExecutorChoice, choose_executor, cluster_layout
from reshard_job.job.run.local import Executor
from reshard_job.job.stages.integrity import SourceDigests
from reshard_job.job.output.journal import JournalEntry
from reshard_job.job.output.manifest import build_manifest, job_fingerprint
from reshard_job.job.output.node_outputs import node_manifest_records
from reshard_job.job.output.directory import COMPLETE, FRESH, PARTIAL, OutputDir
from reshard_job.job.stages.prepare import Prepared
from reshard_job.job.stages.select_names import export_include
from reshard_job.job.run import held_logs
from reshard_job.job.run.progress import Progress
from reshard_job.job.stages.proof import prove
from reshard_job.job.stages.record import LineageRecorder, NoRecorder
from reshard_job.job.stages.reuse import STATUS_COMPLETED, Outputs, reuse_if_intact  # noqa: F401 (Outputs re-exported)
from reshard_job.core.placement import PLACEMENT_PER_NODE
from reshard_job.job.config.spec import JobSpec

log = logging.getLogger("reshard_job")

def output_paths(plan: Plan, out_dir: str, prefix: str, fmt: str, storage) -> dict[int, str]:
    """``<out>/rank_<r>/<prefix><r>.<fmt>`` for every planned target rank (MindSpore's naming)."""
    return {rp.target_rank: storage.join(out_dir, f"rank_{rp.target_rank}", f"{prefix}{rp.target_rank}{suffix_of(fmt)}")
            for rp in plan.ranks}


def unit_paths(prepared: Prepared, out_dir: str, prefix: str, fmt: str, storage) -> dict[int, str]:
    """Every output file by its key (module docstring): target ranks, or an export's shards and index."""
    layout = prepared.export
    if layout is None:
        return output_paths(prepared.plan, out_dir, prefix, FORMAT_CKPT if fmt == FORMAT_SAFETENSORS_INDEX else fmt,
                            storage)
    paths = {i: storage.join(out_dir, shard.file_name) for i, shard in enumerate(layout.shards)}
    paths[len(layout.shards)] = storage.join(out_dir, INDEX_FILE)
    if layout.param_name_map_bytes() is not None:  # several shards: MindSpore's unified loader needs it
        paths[len(layout.shards) + 1] = storage.join(out_dir, PARAM_NAME_MAP_FILE)
    return paths


def rank_tasks(prepared: Prepared, paths: dict[int, str], options: WriteOptions,
               identities: dict[int, tuple] | None = None, storage=None) -> list[RankTask]:
    """One self-contained task per output file to produce (the API and the job alike): per target
    rank, or per shard of an export (an export's index is written by the caller)."""
    from reshard_job.storage import StorageOptions

    identities = identities if identities is not None else prepared.readers.identities
    storage = storage or StorageOptions()

    def task(rp, out_path: str, part: int | None, opts: WriteOptions) -> RankTask:
        ranks = rp.source_ranks
        return RankTask(rp.target_rank, rp, {r: prepared.source_paths[r] for r in ranks}, out_path, opts,
                        {r: identities[r] for r in ranks if r in identities}, storage, part, _renamed_in(rp))

    renamed = prepared.selected.renamed if prepared.selected is not None else {}

    def _renamed_in(rp) -> dict[str, str]:
        return {p.name: renamed[p.name] for p in rp.params if p.name in renamed} if renamed else {}

    if prepared.export is not None:
        shard_options = replace(options, format=FORMAT_SAFETENSORS, metadata=dict(EXPORT_METADATA))
        return [task(prepared.export.sub_plan(shard), paths[i], i, shard_options)
                for i, shard in enumerate(prepared.export.shards) if i in paths]
    return [task(rp, paths[rp.target_rank], None, options) for rp in prepared.plan.ranks if rp.target_rank in paths]


def write_export_documents(prepared: Prepared, paths: dict[int, str], storage) -> list[tuple[int, str, int, str]]:
    """Write an export's param_name_map.json (several shards), then model.safetensors.index.json,
    last, after the shards (a folder without the index is incomplete); (key, path, size, sha256) each."""
    key = len(prepared.export.shards)
    documents = [(key + 1, prepared.export.param_name_map_bytes()), (key, prepared.export.index_bytes())]
    out = []
    for k, data in documents:
        if data is not None:
            size, sha = storage.write_bytes(paths[k], data, mode=0o444)
            out.append((k, paths[k], size, sha))
    return out


def write_export_index(prepared: Prepared, paths: dict[int, str], storage) -> tuple[int, str, int, str]:
    """``write_export_documents``; (key, path, size, sha256) of the index."""
    return write_export_documents(prepared, paths, storage)[-1]


def convert(spec: JobSpec, prepared: Prepared, out: OutputDir, digests: SourceDigests,
            recorder: LineageRecorder | NoRecorder, executor: Executor | None = None) -> Outputs:
    held = prepared.target.strategy
    strategy_sha = held.sha256 if held is not None and held.size else None
    fingerprint = job_fingerprint(
        source_files=digests.files, source_strategy=_source_strategy(spec, prepared, digests),
        target_strategy_sha256=strategy_sha, target=_target_key(spec, prepared))
    choice = choose_executor(spec, prepared, out, fingerprint, executor)
    try:
        recorder.record_inputs(_input_records(digests, prepared))
        outputs = _convert_into(spec, prepared, out, digests, recorder, fingerprint, choice)
        outputs.nodes = choice.node_summary()  # printed in the job's final summary
        return outputs
    finally:
        choice.close()


def _convert_into(spec: JobSpec, prepared: Prepared, out: OutputDir, digests: SourceDigests, recorder,
                  fingerprint: str, choice: ExecutorChoice) -> Outputs:
    state = out.state(fingerprint)
    if state == COMPLETE:
        reused = reuse_if_intact(spec, out, fingerprint, recorder, choice.files, prepared.target.strategy_copied)
        if reused is not None:
            return reused
        state = PARTIAL
    digests = digests.settled()  # the sources' fingerprints, where hashing read nothing: for a conversion that runs
    resume = spec.run.resume and state == PARTIAL
    out.journal.start(fingerprint, keep=resume)
    removed = out.remove_temp_files()
    if removed:
        log.info("removed %d temporary file(s) left by an interrupted run", removed)
    strategy_out = _write_target_strategy(out, prepared)
    paths = unit_paths(prepared, out.path, spec.target.prefix, spec.target.format, out.storage)
    kept = choice.files.reusable(paths, resume=resume, fresh=state == FRESH)
    if kept:
        log.info("resuming: keeping %d target file(s) that verify: %s %s", len(kept),
                 "files" if prepared.export is not None else "ranks", sorted(kept))
    written = {r: _entry_as_file(out, e) for r, e in kept.items()}
    tapped = _run_ranks(spec, prepared, out, digests, paths, kept, written, choice)
    if prepared.export is not None and any(k not in kept for k in paths if k >= len(prepared.export.shards)):
        _journal_index(prepared, out, paths, written)
    _check_sources_unchanged(prepared, digests)
    return _finish(spec, prepared, out, digests, fingerprint, strategy_out, written, recorder, choice.files, tapped)


# ---------------------------------------------------------------------------------- pieces
def _source_strategy(spec: JobSpec, prepared: Prepared, digests: SourceDigests) -> dict | None:
    """The source strategy file(s) read; for a MindFormers save, its metadata.json (which holds the layouts)."""
    path = prepared.source.strategy
    if path is None and prepared.mindformers is not None and digests.strategies:
        path = prepared.mindformers.metadata_path
    if path is None:
        return None
    files = [{"path": d.path, "size": d.size, "sha256": d.sha256} for d in digests.strategies]
    out = {"path": path, "files": files}
    if len(files) == 1 and files[0]["path"] == path:
        out.update(size=files[0]["size"], sha256=files[0]["sha256"])
    if prepared.mindformers is not None:
        out["kind"] = "mindformers_metadata"
    return out


def _target_key(spec: JobSpec, prepared: Prepared) -> dict:
    t = spec.target
    key = {"devices": prepared.target.devices, "format": t.format, "prefix": t.prefix, "unmapped": t.unmapped,
           "crc": t.crc, "ranks": list(spec.run.ranks) if spec.run.ranks is not None else None}
    if t.format == FORMAT_SAFETENSORS_INDEX:
        key.update(max_shard_size=t.max_shard_size, include=export_include(t))
    if t.remove_redundancy:  # other files: another conversion (absent otherwise, keeping earlier keys)
        key["remove_redundancy"] = True
    if prepared.selected is not None:  # another selection of the same sources is another conversion
        key["selection"] = prepared.selected.selection.describe()
    if spec.output.placement == PLACEMENT_PER_NODE:  # the same files on other disks: another conversion
        key["placement"] = {"per_node": cluster_layout(spec, prepared.target.devices)}
    return key


def _input_records(digests: SourceDigests, prepared: Prepared) -> list[FileRecord]:
    records = [FileRecord(f["path"], f["sha256"], f["size"], "source_checkpoint", f["rank"]) for f in digests.files]
    records += [FileRecord(d.path, d.sha256, d.size, "strategy") for d in digests.strategies]
    copied = _copied_target_strategy(prepared)
    return records + ([copied] if copied is not None else [])


def _copied_target_strategy(prepared: Prepared) -> FileRecord | None:
    """The target strategy file the user gave, as an input, when the job copies it beside its outputs
    (its bytes, as read once: what was planned against and what the copy holds)."""
    t = prepared.target
    if not t.strategy_copied or t.strategy is None:
        return None
    return FileRecord(t.strategy_from, t.strategy.sha256, t.strategy.size, "strategy")


def _write_target_strategy(out: OutputDir, prepared: Prepared) -> dict | None:
    t = prepared.target
    if t.strategy is None:
        return None
    path = out.storage.join(out.path, t.strategy_file)
    size, sha = out.storage.write_bytes(path, t.strategy_bytes, mode=0o444)
    return {"path": path, "size": size, "sha256": sha, "from": t.strategy_from}


def _entry_as_file(out: OutputDir, e: JournalEntry) -> dict:
    return {"path": out.storage.join(out.path, e.path), "size": e.size, "sha256": e.sha256, "tensors": e.tensors}


def _run_ranks(spec: JobSpec, prepared: Prepared, out: OutputDir, digests: SourceDigests, paths: dict[int, str],
               kept: dict, written: dict, choice: ExecutorChoice) -> TargetSums:
    """Write the files not kept, journaling each as it lands; the partial fingerprints their rank
    tasks took from the bytes written, added up (``execute.writer_tap``)."""
    todo = {r: p for r, p in paths.items() if r not in kept}
    options = WriteOptions(spec.target.format, spec.run.max_memory, spec.target.crc, _metadata(spec),
                           fingerprints=_tap_wanted(spec))
    tasks = rank_tasks(prepared, todo, options, digests.identities, spec.storage)
    executor, how = choice.executor_for(len(tasks), sum(t.plan.bytes_written for t in tasks))
    total = sum(t.plan.bytes_written for t in tasks)
    what = "converting" if prepared.export is None else "exporting"
    bar = Progress(total, len(tasks), enabled=spec.run.progress, desc=what)
    log.info("%s %d %s %s: %s to write", what, len(tasks),
             "target rank(s)" if prepared.export is None else "shard(s) of target rank 0", how, human_size(total))

    tapped = TargetSums()

    def on_bytes(n: int) -> None:
        held_logs.release()  # the ranks run (a cluster answered): the job has accepted its inputs
        bar.add_bytes(n)

    def on_done(result: RankResult) -> None:
        held_logs.release()
        key = result.part if result.part is not None else result.target_rank
        _journal(out, written, key, result.path, result.size, result.sha256, result.tensors,
                 choice.files.identity(result))
        if result.fingerprints is not None:  # partial sums of the bytes written, added up at once (proof)
            tapped.add(result.fingerprints, key)
        bar.rank_done(result.target_rank, result.size, note="" if result.part is None else out.relative(result.path))

    try:
        executor.run(tasks, on_bytes=on_bytes, on_done=on_done)
    finally:
        bar.close()
    return tapped


def _tap_wanted(spec: JobSpec) -> bool:
    """Whether the rank tasks fingerprint what they write: the proof compares the outputs when the
    job writes every target rank (``job.stages.proof``)."""
    return bool(spec.run.fingerprints) and not spec.run.ranks


def _metadata(spec: JobSpec) -> dict | None:
    """Safetensors metadata beyond the format's own: MindSpore's mark of a redundancy-removed save
    (.ckpt files have no metadata: there the manifest says it)."""
    if spec.target.remove_redundancy and spec.target.format == FORMAT_SAFETENSORS:
        return dict(DEDUPLICATED_METADATA)
    return None


def _journal(out: OutputDir, written: dict, key: int, path: str, size: int, sha256: str, tensors: dict,
             identity: tuple | None = None) -> None:
    """One output file landed: journal it at once (a crash loses only files in flight)."""
    if identity is None:
        info = out.storage.info(path)
        identity = tuple(info.identity) if info is not None else ()
    out.journal.append(JournalEntry(key, out.relative(path), size, sha256, identity, tensors))
    written[key] = {"path": path, "size": size, "sha256": sha256, "tensors": tensors, "identity": identity}


def _journal_index(prepared: Prepared, out: OutputDir, paths: dict[int, str], written: dict) -> None:
    for key, path, size, sha in write_export_documents(prepared, paths, out.storage):
        _journal(out, written, key, path, size, sha, {})


def _check_sources_unchanged(prepared: Prepared, digests: SourceDigests) -> None:
    """Every source read must still be the file that was hashed, or the record would lie."""
    for r, identity in digests.identities.items():
        paths = prepared.source_paths[r]
        if not same_identity(current_identity(paths, prepared.readers.storage), identity):
            shown = paths if isinstance(paths, str) else ", ".join(paths)
            raise SourceChangedError(f"{shown}: source file of rank {r} changed while the job was running; its "
                                     "outputs may mix old and new bytes, so nothing is recorded: rerun once it is stable")


def _finish(spec: JobSpec, prepared: Prepared, out: OutputDir, digests: SourceDigests, fingerprint: str,
            strategy_out: dict | None, written: dict, recorder, files, tapped: TargetSums | None = None) -> Outputs:
    run_id = recorder.run_id
    target_files = [files.file_entry(_target_file(prepared, out, key, written[key])) for key in sorted(written)]
    proof = prove(spec, prepared, out.path, strategy_out["path"] if strategy_out else None,
                  {key: w["path"] for key, w in written.items()}, tapped, digests.fingerprints) \
        if spec.run.fingerprints else None  # job.fingerprints=false: neither computed nor recorded
    checks = prepared.checks + ["sources unchanged since hashed"]
    if proof is not None:
        recorder.record_fingerprints(proof)
    if proof is not None and proof.target is not None:
        checks.append("every converted parameter has the same fingerprint in the outputs as in the sources")
    build = functools.partial(
        build_manifest, run_id=run_id or "", tool_version=__version__, fingerprint=fingerprint, config=spec.config,
        source=_source_section(spec, prepared, digests), plan_summary=_plan_summary(prepared),
        checks=checks, fingerprints=proof.manifest_section() if proof else None,
        selection=_selection_section(prepared))
    target = {"devices": prepared.target.devices, "format": spec.target.format, "prefix": spec.target.prefix,
              "ranks": list(spec.run.ranks) if spec.run.ranks else None, "strategy": strategy_out,
              "files": target_files, **_export_section(prepared)}
    if spec.target.remove_redundancy:  # each block in one rank's file only: read them as one save
        target["remove_redundancy"] = True
    tensors = {str(r): written[r]["tensors"] for r in sorted(written)}
    if not files.per_node:
        _check_unchanged_since_written(out, written)
    target.update(files.publish(build, target, tensors, lambda: prepared.target.strategy_bytes))  # nodes first
    m_size, m_sha = out.write_manifest(build(target=target, tensors=tensors))
    out.seal_manifest(m_size, m_sha)
    outputs = [FileRecord(f["path"], f["sha256"], f["size"], "target_checkpoint", f["rank"]) for f in target_files]
    if strategy_out is not None:
        outputs.append(FileRecord(strategy_out["path"], strategy_out["sha256"], strategy_out["size"], "strategy",
                                  copied=prepared.target.strategy_copied))
    outputs += node_manifest_records(target)
    outputs.append(FileRecord(out.manifest_path, m_sha, m_size, "manifest"))
    recorder.complete(outputs)
    return Outputs(STATUS_COMPLETED, out.path, out.manifest_path, m_sha, run_id, target_files)


def _check_unchanged_since_written(out: OutputDir, written: dict) -> None:
    """Every output file is still the one this job wrote (same identity, else same size), just
    before the manifest says what they hold: a program writing into output.dir meanwhile (in spite of
    the lock) makes this a refusal, never a manifest describing bytes that are not there."""
    for w in written.values():
        info = out.storage.info(w["path"])
        identity = w.get("identity")
        if info is None or (tuple(info.identity) != tuple(identity) if identity else info.size != w["size"]):
            raise OutputError(f"{w['path']}: replaced or changed since this job wrote it (something else writes into "
                              f"output.dir {out.path}); nothing was committed: rerun once it is left alone")


def _export_section(prepared: Prepared) -> dict:
    layout = prepared.export
    if layout is None:
        return {}
    extra = {"param_name_map": PARAM_NAME_MAP_FILE} if layout.param_name_map_bytes() is not None else {}
    return {"export": {"index": INDEX_FILE, **extra, "max_shard_size": layout.max_shard_size,
                       "total_size": layout.total_size,
                       "shards": [s.file_name for s in layout.shards],
                       "left_out": [{"name": n, "reason": why} for n, why in layout.left_out]}}


def _target_file(prepared: Prepared, out: OutputDir, key: int, w: dict) -> dict:
    """A manifest entry of one output file (module docstring: keys, ranks and parts)."""
    entry = {"rank": key, "path": w["path"], "size": w["size"], "sha256": w["sha256"], "file": out.relative(w["path"])}
    if prepared.export is not None:
        entry.update(rank=prepared.export.target_rank, part=key)
    return entry


def _source_section(spec: JobSpec, prepared: Prepared, digests: SourceDigests) -> dict:
    topo = prepared.strategy.topology
    section = {"checkpoints": prepared.source.checkpoints, "select": prepared.source.select, "devices": topo.devices,
               "stage_devices": topo.stage_devices, "stages": topo.num_stages,
               "strategy": _source_strategy(spec, prepared, digests), "files": digests.files}
    save = prepared.mindformers
    if save is not None:
        section.pop("select")
        section["mindformers"] = {"folder": save.folder, "iteration": save.iteration,
                                  "rank_files": {str(r): list(f) for r, f in sorted(prepared.source_paths.items())},
                                  "not_in_metadata": sorted(save.extras())}
    return section


def _selection_section(prepared: Prepared) -> dict | None:
    """manifest.json's ``selection``: target.include/exclude/rename and how many parameters they left out."""
    selected = prepared.selected
    if selected is None:
        return None
    return {**selected.selection.describe(), "left_out": len(selected.left_out),
            "left_out_first": selected.summary()["left_out_first"], "renamed": len(selected.renamed)}


def _plan_summary(prepared: Prepared) -> dict:
    plan = prepared.plan
    return {"totals": plan.totals(), "omitted": plan.omitted, "notes": plan.notes,
            **({"not_in_sources": plan.target_only} if plan.target_only else {}),
            **({"selection": plan.selection} if plan.selection is not None else {}),
            "source_ranks": {str(rp.target_rank): rp.source_ranks for rp in plan.ranks}}
