"""Preparing a conversion: find and index the sources, settle the target, cross-check, plan.

Shared by the batch job and the Python API. Everything here reads; nothing is written. The
cross-checks run before any output exists, so inputs that disagree (a strategy of another
network, rank folders that are shards of a model but come without its strategy, ranks beyond
the strategy that hold parameters no other rank has) end the job here with one line.

Which kind of source folder it is (MindSpore's ``rank_<r>/`` folders with a strategy file, a
MindFormers 2.x save, an export for inference) is the reader's business (``sources.base``): here
every kind is found, laid out and verified through one ``SourceReader``. A MindFormers save is the
one planned before its files open: its headers were read when it was loaded.

An export for inference (``target.format=safetensors_index``) is planned as one full target rank,
then split into shards here (``plan.export_shards.plan_export``), so the plan report, the checks
and the job's output bookkeeping know every shard before anything is written.
"""

from __future__ import annotations

import logging
import os
import operator
from dataclasses import dataclass, field

from reshard_job.sources.demo import ensure_demo
from reshard_job.errors import ConfigError, ReshardError
from reshard_job.sources.open_files import SourceFiles
from reshard_job.formats.hf_index import INDEX_FILE
from reshard_job.plan.export_shards import ExportLayout, plan_export
from reshard_job.sources.mindformers import MindFormersFolder
from reshard_job.sources.mindformers_save import MindFormersSource
from reshard_job.sources.file_digests import HashCache, default_cache_path
from reshard_job.sources.index_cache import IndexCache
from reshard_job.plan.model import Plan, RankPlan
from reshard_job.plan.planner import Planner
from reshard_job.core.tensor_meta import TensorMeta
from reshard_job.plan.checks import identical_mismatch
from reshard_job.plan.rank_list import source_ranks_for
from reshard_job.sources.base import SourceReader, reader_for
from reshard_job.sources.rank_folders import LoadedStrategy, RankFiles
from reshard_job.storage import StorageOptions, storage_for
from reshard_job.execute.tasks import FORMAT_SAFETENSORS_INDEX
from reshard_job.sources.open_files import files_of
from reshard_job.job.stages.extra_ranks import cross_check
from reshard_job.job.stages.replica_bytes import first_mismatch
from reshard_job.job.stages.omissions import warn_absent, warn_omitted, warn_target_only
from reshard_job.job.run.progress import Progress
from reshard_job.job.config.spec import SourceSpec, TargetSpec
from reshard_job.job.stages.target import Target, settle_target
from reshard_job.job.stages.select_names import (apply_selection, export_include, leave_out_unavailable,
                                                 narrow_target, optimizer_prefixes, record_in_plan, renamed_strategy,
                                                 select_index, selection_of, under_stored_names)
from reshard_job.plan.selection import Selected

log = logging.getLogger("reshard_job")


@dataclass
class Prepared:
    source: SourceSpec  # with the demo's paths filled in when it was used
    found: RankFiles
    strategy: LoadedStrategy
    readers: SourceFiles  # open and indexed; closed by close()
    index: dict[int, dict[str, TensorMeta]]
    target: Target
    plan: Plan
    missing: dict[int, list[int]] = field(default_factory=dict)
    checks: list[str] = field(default_factory=list)  # the cross-checks that ran
    mindformers: MindFormersSource | None = None  # the save, when the source is a MindFormers folder
    export: ExportLayout | None = None  # the shards, for target.format=safetensors_index
    every_file: RankFiles | None = None  # a MindFormers save's files, before narrowing to those the plan reads
    selected: Selected | None = None  # target.include/exclude/rename: what was kept, under which names
    one_device: RankPlan | None = None  # the sources' one-device plan (``prepare(one_device=True)``); taken once

    @property
    def source_paths(self) -> dict[int, str | tuple[str, ...]]:
        """Source rank -> its file, or the tuple of files read together as that rank."""
        return self.readers.paths

    def source_files(self) -> list[str]:
        """Every source checkpoint file, flat."""
        return [f for paths in self.source_paths.values() for f in files_of(paths)]

    def close(self) -> None:
        self.readers.close()

    def __enter__(self) -> "Prepared":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class HashWhileIndexing:
    """A conversion hashes every source it reads: remote ones are then hashed as they are indexed
    (one read of each object instead of two, ``sources.file_digests.DigestingReader``), unless the digest
    cache already knows them. Which ranks the plan reads is foreseen from the strategies."""

    use_cache: bool = True
    progress: bool | None = None


# target ranks x laid-out parameters worth working through to foresee reads (about 10 us each);
# beyond, every remote rank is hashed while indexed (a replica the plan skips is then read whole)
PREDICT_LIMIT = 100_000


def prepare(source: SourceSpec, target: TargetSpec, *, ranks: tuple[int, ...] | None = None,
            storage: StorageOptions | None = None, demo_root: str | None = None,
            hashing: HashWhileIndexing | None = None, index_cache: IndexCache | None = None,
            one_device: bool = False) -> Prepared:
    """Sources found and indexed, target settled, inputs cross-checked, the plan made. With `hashing`,
    remote sources the plan will read are hashed while they are indexed; with `index_cache`, local
    `.ckpt` files it knows unchanged are not walked again; with `one_device`, the one-device plan of
    the sources is made too (``Prepared.one_device``)."""
    source = _with_demo(source, demo_root)
    reader = reader_for(source, storage)
    reader.check(source)
    if isinstance(reader, MindFormersFolder):  # absent files are refused here if the conversion needs them
        reader.absent_files_ok = True
    return prepare_from(reader, reader.discover(source), source, target, ranks=ranks, storage=storage,
                        hashing=hashing, index_cache=index_cache, one_device=one_device)


def prepare_from(reader: SourceReader, found: RankFiles, source: SourceSpec, target: TargetSpec, *,
                 ranks: tuple[int, ...] | None = None, storage: StorageOptions | None = None,
                 hashing: HashWhileIndexing | None = None, index_cache: IndexCache | None = None,
                 one_device: bool = False) -> Prepared:
    """Like ``prepare``, for the files `reader` found: every rank's, or those the API's per-rank
    conversion was given (then some of a rank's files only, for a MindFormers save)."""
    if isinstance(reader, MindFormersFolder):
        return _prepare_mindformers(reader, found, source, target, ranks=ranks, storage=storage, one_device=one_device)
    prepared = _prepare_files(found, reader.layouts(source.strategy), source, target, ranks=ranks, storage=storage,
                              hashing=hashing, index_cache=index_cache, one_device=one_device)
    try:
        prepared.checks += reader.verify(prepared.found, prepared.readers)
    except BaseException:
        prepared.close()
        raise
    return prepared


def _prepare_files(found: RankFiles, strategy: LoadedStrategy, source: SourceSpec, target: TargetSpec, *,
                   ranks: tuple[int, ...] | None, storage: StorageOptions | None, hashing: HashWhileIndexing | None,
                   index_cache: IndexCache | None, one_device: bool = False) -> Prepared:
    """Open and index the source files (rank -> file), cross-check them, settle the target, plan."""
    paths = _usable_ranks(found, strategy, source)
    remote = _remote_ranks(paths, storage) if hashing is not None else set()
    selection = selection_of(target, optimizer_prefixes(target))
    # the target strategy, read now to foresee the reads (and not read again for the plan)
    settled = settle_target(target, renamed_strategy(strategy, selection), {}, storage) \
        if remote and target.strategy is not None else None
    digest = _ranks_to_hash_now(remote, paths, renamed_strategy(strategy, selection), source, target, settled, ranks,
                                storage, hashing)
    bar = Progress(sum(found.sizes.get(r, 0) for r in digest), len(digest),
                   enabled=hashing.progress if hashing else False, desc="indexing and hashing sources", unit="files")
    readers = SourceFiles(paths, verify_crc=False, identities=found.identities, storage=storage,
                          digest_ranks=digest, digest_progress=bar if digest else None, index_cache=index_cache,
                          record_taps=_record_taps(strategy) if one_device and digest else None)
    try:
        try:
            index = readers.index()
        finally:
            bar.close()
        checks = cross_check(found, strategy, source, index, storage)
        strategy, index, selected = apply_selection(selection, strategy, readers, index)
        return _settle_and_plan(source, found, strategy, readers, index, target, ranks, storage, checks,
                                settled=settled, selected=selected, one_device=one_device)
    except BaseException:
        readers.close()
        raise


def _remote_ranks(paths: dict, storage: StorageOptions | None) -> set[int]:
    """Single-file ranks in an object store (a multi-file rank is hashed by the hash pass)."""
    return {r for r, p in paths.items() if isinstance(p, str) and storage_for(p, storage).scheme != "file"}


def _record_taps(strategy: LoadedStrategy):
    """rank -> a tap taking the fingerprints of its records as it is hashed while indexed (``proof.stream_taps``)."""
    from reshard_job.proof.record_boxes import RecordBoxes
    from reshard_job.proof.stream_taps import StreamTap

    return lambda rank: StreamTap(RecordBoxes(strategy.topology, rank))


def _ranks_to_hash_now(remote: set[int], paths: dict, strategy: LoadedStrategy, source: SourceSpec,
                       target: TargetSpec, settled: Target | None, ranks, storage: StorageOptions | None,
                       hashing: HashWhileIndexing | None) -> set[int]:
    """The remote ranks to hash while indexing: those the plan will likely read and the digest
    cache does not know. Local files are left to the hash pass (reading them again costs the
    page cache, not the network)."""
    if hashing is None or not remote:
        return set()
    read = ranks_likely_read(strategy, source, target, settled, ranks)
    if read is not None:
        remote = remote & read
    if hashing.use_cache and remote:
        cache = HashCache(default_cache_path(), storage)
        remote = {r for r in remote if not cache.knows(paths[r])}
    return remote


def ranks_likely_read(strategy: LoadedStrategy, source: SourceSpec, target: TargetSpec, settled: Target | None,
                      ranks) -> set[int] | None:
    """The source ranks the plan will read, foreseen from the strategies alone (``source_ranks_for``;
    `settled` is the target read from ``target.strategy``); None when only the index can tell (a
    declarative target layout, no source strategy) or working it out would take long. A wrong
    guess costs a read, never a wrong output."""
    if source.strategy is None or target.layout is not None or (target.strategy is not None and settled is None):
        return None
    dst = settled.topology if settled is not None else None
    targets = list(ranks) if ranks is not None else list(range(dst.devices if dst is not None else 1))
    if len(targets) * max(1, len(strategy.topology.layouts)) > PREDICT_LIMIT:
        return None
    read: set[int] = set()
    try:
        for t in targets:
            read.update(source_ranks_for(strategy.topology, dst, t, unmapped=target.unmapped))
    except ReshardError:
        return None  # the planner names what is wrong
    return read


def _prepare_mindformers(reader: MindFormersFolder, found: RankFiles, source: SourceSpec, target: TargetSpec, *,
                         ranks: tuple[int, ...] | None, storage: StorageOptions | None,
                         one_device: bool = False) -> Prepared:
    """A MindFormers save: layouts from its metadata.json, no strategy file.

    The headers were read and checked when the save was loaded, so the plan is made before any
    reader opens, and each rank keeps only the files the plan reads (an export of the weights or a
    target without optimizer states reads, hashes and records no opt file).
    """
    reader.log_found()
    selection = selection_of(target, optimizer_prefixes(target))
    absent, not_exported = leave_out_unavailable(reader.save, target, selection)
    strategy, index, selected = select_index(selection, reader.layouts(), reader.index(found), absent)
    tgt = narrow_target(settle_target(target, strategy, index, storage), selected)
    plan, missing, one = _plan(strategy, tgt, target, index, ranks, one_device)
    export = _export_layout(target, plan)
    plan.omitted.extend({"name": n, "reason": "not exported: training state, in a file absent from the save"}
                        for n in not_exported)  # listed as the export's other omissions are
    warn_omitted(plan, missing)
    warn_target_only(plan)
    record_in_plan(plan, selected)
    every_file, found = found, reader.files_read(found, under_stored_names(plan, selected))
    readers = SourceFiles(found.files, verify_crc=False, identities=found.identities, storage=storage,
                          names=selected.stored if selected else None, only_named=True, parsed=reader.save.parsed)
    try:
        checks = ["MindFormers metadata.json agrees with every file's header (dtypes, shapes, placement)"]
        checks += list(plan.checks)
        return Prepared(source, found, strategy, readers, index, tgt, plan, missing, checks, reader.save, export,
                        every_file, selected, one)
    except BaseException:
        readers.close()
        raise


def _settle_and_plan(source: SourceSpec, found: RankFiles, strategy: LoadedStrategy, readers: SourceFiles, index,
                     target: TargetSpec, ranks, storage, checks: list[str], *, settled: Target | None = None,
                     selected: Selected | None = None, one_device: bool = False) -> Prepared:
    tgt = narrow_target(settled if settled is not None else settle_target(target, strategy, index, storage), selected)
    plan, missing, one = _plan(strategy, tgt, target, index, ranks, one_device)
    record_in_plan(plan, selected)
    checks += list(plan.checks)
    export = _export_layout(target, plan)
    warn_omitted(plan, missing)
    warn_target_only(plan)
    return Prepared(source, found, strategy, readers, index, tgt, plan, missing, checks, export=export,
                    selected=selected, one_device=one)


def _export_layout(target: TargetSpec, plan: Plan) -> ExportLayout | None:
    """The shards of an export (None for other formats, or when ``job.ranks`` leaves the full rank
    out). The full rank's plan keeps only what is exported; what is left out joins ``plan.omitted``."""
    if target.format != FORMAT_SAFETENSORS_INDEX or not plan.ranks:
        return None
    rank_plan = plan.ranks[0]
    layout = plan_export(rank_plan, max_shard_size=target.max_shard_size, include=export_include(target))
    exported = set(layout.weight_map())
    rank_plan.params = [p for p in rank_plan.params if p.name in exported]
    plan.omitted.extend({"name": name, "reason": f"not exported: {why}"} for name, why in layout.left_out)
    plan.notes.append(f"export: {len(layout.shards)} shard(s) of at most {layout.max_shard_size} bytes of tensor "
                      f"data, {layout.total_size} bytes in all, with {INDEX_FILE}")
    return layout


def _with_demo(source: SourceSpec, demo_root: str | None) -> SourceSpec:
    if source.checkpoints is not None:
        return source
    if demo_root is None:
        raise ConfigError("source.checkpoints is not set")
    checkpoints, strategy = ensure_demo(demo_root)
    log.info("no source.checkpoints given: using the built-in demo (MLP 784-512-512-10 on 8 ranks), "
             "built once in the user's cache folder and reused: %s",
             checkpoints)
    return SourceSpec(checkpoints, strategy, source.select, source.unsharded, source.iteration)


def _usable_ranks(found: RankFiles, strategy: LoadedStrategy, source: SourceSpec) -> dict[int, str]:
    devices = strategy.topology.devices
    for rank, others in sorted(found.ignored.items())[:8]:
        if rank < devices:
            log.info("rank_%d: using %s, ignoring %s", rank, os.path.basename(str(found.files[rank])),
                     ", ".join(others))
    return {r: p for r, p in found.files.items() if r < devices}


def _plan(strategy: LoadedStrategy, tgt: Target, spec: TargetSpec, index, ranks,
          one_device: bool = False) -> tuple[Plan, dict, RankPlan | None]:
    planner = Planner(strategy.topology, tgt.topology, index, unmapped=spec.unmapped,
                      remove_redundancy=spec.remove_redundancy)
    planner.notes.extend(tgt.notes)
    missing: dict[int, list[int]] = {}
    plan = planner.plan(list(ranks) if ranks is not None else None, missing=missing)
    # after planning: a refused plan prints its one line and nothing else
    warn_absent(strategy, index)  # the API's per-rank path may be given some of a rank's files only
    if not one_device or missing:
        return plan, missing, None
    return plan, missing, _own_plan_if_one_device(plan, tgt) or planner.one_device()


def _own_plan_if_one_device(plan: Plan, tgt: Target) -> RankPlan | None:
    """The conversion's own plan of rank 0 where the target is one device: it already puts every
    converted parameter whole onto that device, from the same records (a second plan of 600,000
    parameters cost 2 s and 60 MiB). The fingerprints only look at the converted parameters."""
    devices = 1 if tgt.topology is None else tgt.topology.devices
    if devices != 1 or len(plan.ranks) != 1 or plan.ranks[0].target_rank != 0:
        return None
    return plan.ranks[0]


IDENTICAL_CHECKED = "tensors that must be identical across source ranks compared by content"


def identical_to_check(prepared: Prepared) -> dict:
    """The plan's ``identical`` groups for the tensors the conversion reads (an export of weights
    reads no optimizer state, and may not have opened the files holding it)."""
    if not prepared.source.verify_replicas or not prepared.plan.identical:
        return {}
    read: set[str] = set()
    shared = set()  # target ranks whose plans are alike share their parameters: each is read once
    for rp in prepared.plan.ranks:
        if id(rp.params) not in shared:  # names from the plan's table of facts: no view made each
            shared.add(id(rp.params))
            read.update(map(operator.attrgetter("name"), getattr(rp.params, "tensors", None) or rp.params))
    return {name: groups for name, groups in prepared.plan.identical.items() if name in read}


def check_identical(prepared: Prepared) -> None:
    """Compare, by reading them, the tensors the plan says several source ranks hold identically
    (replicas of one block, tensors the source strategy does not lay out). A rank-local slice taken
    for a whole tensor is how a wrong strategy turns into a wrong checkpoint. The batch job does the
    same while it hashes the sources (``integrity``), without a read of its own."""
    identical = identical_to_check(prepared)
    if not identical:
        return
    mismatch = first_mismatch(identical, prepared.readers.reader)
    if mismatch is not None:
        raise identical_mismatch(*mismatch, prepared.source.strategy)
    prepared.checks.append(IDENTICAL_CHECKED)
