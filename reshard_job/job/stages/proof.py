"""The proof stage: every converted parameter has the same fingerprint in the sources as in the
outputs, checked before the manifest commits the conversion.

The sources' side comes from the bytes the hash pass reads (``proof.source_taps``): a one-device
plan over the sources, independent of the conversion's own, names the records that make up each
global tensor once, and each is fed to a partial fingerprint as the hash pass reads its file (or
taken from the digest cache, or read alone where the file's sha256 was cached); what taps cannot
take is read by pieces (``proof.pieces``). The outputs' side comes from the bytes written
(``execute.writer_tap``): each rank task fingerprints the tensors it counts (one rank per distinct
box of the global tensor, ``plan.counting``) in the thread that hashes them for the per-tensor
sha256, and returns partial sums, which are added up per parameter here, after checking that every
byte of each parameter was counted exactly once. A conversion that misplaced, dropped or altered any byte of a parameter on
its way into a file therefore fails here (``ProofError``, naming it) instead of committing. The
fingerprints go into ``manifest.json`` (``fingerprints``: algorithm, source, target) and the
lineage database.

Which outputs are read back instead:

* files the job did not write in this run (kept by a resumed run, whose journal vouches for their
  identity but holds no fingerprints): each is read back alone, its counted tensors only, with the
  same places;
* every output, when the plan does not say which rank counts what (a plan from elsewhere than the
  planner) or a rank task could not tap a tensor: the output directory is read back as a source,
  through a one-device plan over the files just written and the target strategy beside them.

Exports (``target.format=safetensors_index``: each shard is a rank task over a slice of the one full
rank) and outputs on object storage (the same writers over a multipart upload) are tapped like rank
files; a kept export shard or object is read back alone as above.

The outputs are not checked when the job wrote only some target ranks (``job.ranks``), or when they
stay on the target nodes (``output.placement=per_node``) and some were not written in this run
(a resumed run: they cannot be read back from here): then only the source side is recorded, and
the manifest says why under ``fingerprints.target_unchecked``.

What the tap trusts: the bytes it sees are those handed to the file's writer and hashed into its
sha256; a file damaged after that is caught by its sha256 (``audit verify``), not here. Where each
tensor lies in the global tensor is the plan's (``Place``), computed from the target strategy as
the read-back's plan is.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter

from reshard_job.core.digest_table import DigestTable, differing
from reshard_job.core.fingerprint import ALGORITHM
from reshard_job.text import listed
from reshard_job.execute.writer_tap import TargetSums, fingerprint_written
from reshard_job.errors import ProofError
from reshard_job.job.config.spec import PLACEMENT_SHARED, JobSpec, SourceSpec, TargetSpec
from reshard_job.job.run.local import default_workers, run_forked
from reshard_job.job.run.memory import heap_top_kept
from reshard_job.job.run.progress import Progress
from reshard_job.plan.model import UNMAPPED_FULL
from reshard_job.sources.open_files import SourceFiles
from reshard_job.proof.collect import Fingerprints, quiet, single_device_plan
from reshard_job.proof.source_taps import SourceTaps, plan_source_taps
from reshard_job.proof.pieces import PartFingerprints, fingerprint_part, merge_parts, plan_bytes
from reshard_job.storage import StorageOptions

log = logging.getLogger("reshard_job")


@dataclass
class ProofResult:
    source: Mapping[str, str]  # a dict, or a DigestTable
    target: Mapping[str, str] | None
    unchecked: str | None = None  # why the target side was not read back
    algorithm: str = ALGORITHM
    differ: list[str] = field(default_factory=list)

    def manifest_section(self) -> dict:
        section = {"algorithm": self.algorithm, "source": _sorted(self.source), "target": _sorted(self.target or {})}
        if self.unchecked:
            section["target_unchecked"] = self.unchecked
        return section


def _sorted(digests: Mapping[str, str]) -> Mapping[str, str]:
    return digests if isinstance(digests, DigestTable) else _Sorted(digests)  # (a table is in name order)


class _Sorted(Mapping):
    """A dict read in the order of its keys, without a sorted copy of it: the manifest writes a
    section of 600,000 fingerprints a chunk at a time (``jsonchunks.iter_json``) from this."""

    def __init__(self, items: dict):
        self._items = items

    def __iter__(self):
        return iter(sorted(self._items))

    def __getitem__(self, key):
        return self._items[key]

    def __len__(self) -> int:
        return len(self._items)


def checkpoint_fingerprints(source: SourceSpec, *, storage: StorageOptions | None = None, wanted=None,
                            progress: bool | None = False, desc: str = "fingerprinting",
                            check_replicas: bool = False, files: dict[int, str] | None = None,
                            workers: int | None = 1) -> Fingerprints:
    """The fingerprints of the checkpoint `source` names (any kind the job reads), read through a
    one-device plan; `wanted`: only these parameters. The plan reads one copy of each replicated
    block: `check_replicas` also compares the other copies with it (``source.verify_replicas``),
    so that one checkpoint whose replicas disagree is refused rather than fingerprinted.
    `files`: exactly these files (rank -> local path) with `source.strategy`, not what else lies
    beside them; `workers`: processes that share the reading (None: one per CPU)."""
    from reshard_job.job.stages.prepare import check_identical, prepare
    from reshard_job.errors import MissingRankError

    with quiet():
        prepared = _prepare_files(source, files, storage) if files else \
            prepare(source, TargetSpec(devices=1), storage=storage)
    with prepared:
        if prepared.missing:
            raise MissingRankError(prepared.missing, prepared.source.checkpoints)
        if check_replicas:
            if wanted is not None:  # what is not fingerprinted is not compared either
                prepared.plan.identical = {n: g for n, g in prepared.plan.identical.items() if n in wanted}
            check_identical(prepared)
        return _fingerprint(prepared.plan.rank(0), prepared.readers, wanted, progress, desc, workers)


def _fingerprint(rank_plan, readers, wanted, progress: bool | None, desc: str, workers: int | None = 1) -> Fingerprints:
    """The fingerprints of a one-device plan's tensors, with a progress bar over the bytes read.
    The plan's bytes are shared out among worker processes (at most `workers`, None: one per CPU,
    and none for less than ``WORKER_BYTES`` each), each reading its part of the pieces; parameters
    cut between parts are merged here."""
    total = plan_bytes(rank_plan, wanted)
    parts = default_workers(workers or os.cpu_count() or 1, total)
    bar = Progress(total, 1, enabled=progress, desc=desc)

    def part(k: int, report) -> PartFingerprints:
        return fingerprint_part(rank_plan, readers, wanted=wanted, part=k, parts=parts, progress=report)

    try:
        with heap_top_kept():  # the kernel's step buffers stay mapped (forked workers inherit it)
            return Fingerprints(merge_parts(run_forked(part, parts, parts, bar.add_bytes)))
    finally:
        bar.close()


def _prepare_files(source: SourceSpec, files: dict[int, str], storage):
    """A one-device plan over exactly `files` (rank -> local path) with `source.strategy`: what a
    job wrote, not whatever else lies in its output directory (rank folders of an earlier run)."""
    from reshard_job.job.stages.prepare import prepare_from
    from reshard_job.sources.base import reader_for_files

    reader = reader_for_files({r: (p,) for r, p in files.items()}, source.strategy)
    given = SourceSpec(None, source.strategy)
    return prepare_from(reader, reader.discover(given), given, TargetSpec(devices=1), storage=storage)


def converted_names(prepared) -> set[str]:
    """The tensors the job writes into any target rank."""
    names: set[str] = set()
    for tensors in _planned_tensors(prepared):
        names.update(map(_name, tensors))
    return names


_name = attrgetter("name")


class _ConvertedNames:
    """``converted_names``, worked out when first asked: where both sides' fingerprints are tables
    of the same names only a difference asks (600,000 names are a set of 40 MiB at the job's peak)."""

    def __init__(self, prepared):
        self._prepared, self._names = prepared, None

    def get(self) -> set[str]:
        if self._names is None:
            self._names = converted_names(self._prepared)
        return self._names

    def __iter__(self):
        return iter(self.get())

    def __contains__(self, name) -> bool:
        return name in self.get()


def _planned_tensors(prepared) -> list:
    """The facts of the tensors of each target rank's plan (``TensorFacts``), each list once
    (target ranks whose plans are alike share one)."""
    lists: dict[int, list] = {}
    for rank_plan in prepared.plan.ranks:
        params = rank_plan.params
        tensors = getattr(params, "tensors", None)
        if tensors is None:
            tensors = [p.tensor for p in params]
        lists.setdefault(id(tensors), tensors)
    return list(lists.values())


def prove(spec: JobSpec, prepared, out_path: str, strategy_path: str | None,
          written: dict[int, str] | None = None, tapped: TargetSums | None = None,
          source_taps: SourceTaps | None = None) -> ProofResult:
    """Fingerprint the converted parameters on both sides and compare them; ProofError on a
    difference. `written`: output file key (target rank, or an export's part) -> the file the job
    wrote; `tapped`: the partial fingerprints the rank tasks took from the bytes they wrote
    (``RankResult.fingerprints``), added up, with the keys of their files (``units``). The outputs'
    side is that sum, files without partials read back alone and added; where the plan cannot say
    which rank counts what, the output directory is read back as a source (local files as exactly
    the files written). `source_taps`: the sources' side as the hash pass took it (``source_taps``)."""
    names = _ConvertedNames(prepared)
    source = _source_fingerprints(spec, prepared, names.get, source_taps)
    unchecked = _why_unchecked(spec)
    tapped = tapped if tapped is not None else TargetSums()
    if unchecked and not (not spec.run.ranks and _all_tapped(prepared, tapped)):
        log.info("fingerprints: sources only (%s)", unchecked)
        return ProofResult(source, None, unchecked)
    target = _tapped_fingerprints(spec, prepared, written or {}, tapped)
    if target is None:
        local = written if written and prepared.export is None and not any("://" in p for p in written.values()) \
            else None
        target = checkpoint_fingerprints(SourceSpec(out_path, strategy_path), storage=spec.storage, files=local,
                                         progress=spec.run.progress, desc="fingerprinting outputs",
                                         workers=spec.run.workers).digests
    result = ProofResult(source, _sharing(target, source))
    result.differ = differing(names, source, target)
    if result.differ:
        raise ProofError(f"{out_path}: parameter {listed(result.differ, 5, repr)} does not hold in the outputs what it holds in the "
                         f"sources ({ALGORITHM} fingerprints differ); nothing was committed: rerun, and report it "
                         f"if it persists")
    return result


def _sharing(target: dict[str, str], source: dict[str, str]) -> dict[str, str]:
    """`target` with each digest equal to the source's replaced by the source's own string: the
    two sides are equal where the proof holds, and a model of 600,000 parameters then keeps one
    set of digest strings in memory, not two (tens of MiB). (A ``DigestTable`` holds no strings.)"""
    if not isinstance(target, dict):
        return target
    for name, digest in target.items():
        same = source.get(name)
        if same == digest:
            target[name] = same
    return target


def _output_units(prepared) -> dict[int, object]:
    """Output file key -> the rank plan its file was written from (files holding tensors only)."""
    if prepared.export is not None:
        return {i: prepared.export.sub_plan(shard) for i, shard in enumerate(prepared.export.shards)}
    return {rp.target_rank: rp for rp in prepared.plan.ranks}


def _all_tapped(prepared, tapped: TargetSums) -> bool:
    """Whether every output file's rank task returned its partial fingerprints (nothing to read)."""
    units = _output_units(prepared)
    return all(rp.counting is not None and key in tapped.units for key, rp in units.items())


def _tapped_fingerprints(spec: JobSpec, prepared, written: dict[int, str],
                         sums: TargetSums) -> Mapping[str, str] | None:
    """The outputs' fingerprints from the rank tasks' partial sums, with the files written in an
    earlier run (resumed, or kept) read back one by one; None when the plan does not say which
    rank counts what (then the whole output is read back)."""
    units = _output_units(prepared)
    if any(rp.counting is None for rp in units.values()) or any(k not in written for k in units):
        return None
    read_back = 0
    for key, rank_plan in sorted(units.items()):
        if key not in sums.units:
            read_back += 1
            partials = _read_back(rank_plan, written[key], spec.storage)
            if partials is None:
                return None
            sums.add(partials, key)
    log.debug("fingerprints: %d output file(s) from the bytes written, %d read back", len(units) - read_back,
              read_back)
    digests, uncovered = sums.digests(chain.from_iterable(_planned_tensors(prepared)))
    if uncovered:
        shown = ", ".join(repr(n) for n in sorted(uncovered)[:5])
        raise ProofError(f"parameter {shown}: the target files do not hold each of its bytes exactly once "
                         f"(the plan's boxes do not tile it); nothing was committed: report it")
    return digests


def _read_back(rank_plan, path: str, storage):
    """The partial fingerprints of one file written earlier, read back from it alone."""
    files = SourceFiles({0: path}, verify_crc=False, storage=storage)
    try:
        return fingerprint_written(rank_plan, files.reader(0))
    finally:
        files.close()


def source_taps(spec: JobSpec, prepared) -> SourceTaps | None:
    """The taps that take the converted parameters' fingerprints from the bytes the hash pass reads
    (``proof.source_taps``); None with ``job.fingerprints=false``."""
    if not spec.run.fingerprints:
        return None
    rank_plan, prepared.one_device = prepared.one_device, None  # made with the conversion's plan, if it was
    if rank_plan is None:
        rank_plan = single_device_plan(prepared.strategy, prepared.index, unmapped=UNMAPPED_FULL)
    with _proof_sources(prepared, spec.storage) as sources:
        return plan_source_taps(rank_plan, sources, converted_names(prepared))


def _source_fingerprints(spec: JobSpec, prepared, names: Callable[[], set[str]],
                         taps: SourceTaps | None = None) -> Mapping[str, str]:
    """The converted parameters' fingerprints in the sources: what `taps` took in the hash pass,
    and the rest (all without taps) read by pieces through the files the job has open and indexed
    already. A MindFormers save's rank keeps open only the files the conversion reads; the
    one-device plan may read a replica from another file, which is opened beside them (the save
    itself, its metadata and headers, is not loaded a second time: for 600,000 parameters that was
    hundreds of MiB)."""
    digests: Mapping[str, str] = {}
    if taps is not None:
        digests, names = taps.digests()
        log.debug("fingerprints: %d source parameter(s) from the hash pass, %d read by pieces", len(digests), len(names))
        if not names:
            return digests
    else:
        names = names()
    rank_plan = single_device_plan(prepared.strategy, prepared.index, unmapped=UNMAPPED_FULL)
    with _proof_sources(prepared, spec.storage) as sources:
        found = _fingerprint(rank_plan, sources, names, spec.run.progress, "fingerprinting sources",
                             spec.run.workers).digests
    found.update(digests)
    return found


def _proof_sources(prepared, storage):
    """The readers the one-device plan of the sources reads through (see ``_WiderSources``)."""
    if prepared.every_file is None:
        return nullcontext(prepared.readers)
    return _WiderSources(prepared.readers, prepared.every_file, storage)


class _WiderSources:
    """The job's open readers where a rank's files are all open, else that rank's every file."""

    def __init__(self, readers, every_file, storage):
        self.readers = readers
        wider = {r: files for r, files in every_file.files.items()
                 if readers.paths.get(r) != (files if isinstance(files, str) else tuple(files))}
        identities = {r: every_file.identities[r] for r in wider if r in every_file.identities}
        # under the selection's names too (target.include/exclude/rename), as the job's own readers
        self.others = SourceFiles(wider, verify_crc=False, identities=identities, storage=storage,
                                  names=readers.names, only_named=readers.only_named, parsed=readers.parsed)
        self.storage = getattr(readers, "storage", None)

    def reader(self, rank: int):
        return self.others.reader(rank) if rank in self.others.paths else self.readers.reader(rank)

    def raw_reader(self, rank: int):
        return self.others.raw_reader(rank) if rank in self.others.paths else self.readers.raw_reader(rank)

    @property
    def names(self):
        return self.readers.names

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.others.close()


def _why_unchecked(spec: JobSpec) -> str | None:
    """Why the outputs cannot be read back whole by this process (None: they can)."""
    if spec.run.ranks:
        return "job.ranks wrote some target ranks only"
    if spec.output.placement != PLACEMENT_SHARED:
        return f"output.placement={spec.output.placement} keeps the outputs on the target nodes"
    return None
