"""Naming the inputs by content, and checking them: one read of every source file the plan needs.

Each needed source file is hashed (sha256, for the manifest, the lineage record and the resume
fingerprint), and in the same read the CRCs its format carries are checked: a `.ckpt` CRC32
trailer, MindSpore safetensors' ``crc_num`` (chained over the tensors in name order). The file's
identity while it was hashed goes to the rank tasks, which refuse a file that changed since.

A source rank made of several files (a MindFormers rank's model and opt files) is hashed file by
file: each is an input of its own, listed with its rank, and the rank's identity is the tuple of
its files' identities.
"""

from __future__ import annotations

import os
from functools import partial
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

import numpy as np

from reshard_job.errors import FormatError
from reshard_job.formats.base import whole_spans_of
from reshard_job.formats.ckpt import CRC_TRAILER_LEN, CheckpointReader
from reshard_job.formats.crc32 import chain_crc, crc32_combine
from reshard_job.formats.multifile import MultiFileReader
from reshard_job.formats.safetensors import SafetensorsReader
from reshard_job.sources.segment_crcs import SegmentTable
from reshard_job.sources.file_digests import FileDigest, HashCache, HashRequest, default_cache_path, digest_files, usable_digest
from reshard_job.storage import StorageOptions
from reshard_job.plan.checks import identical_mismatch
from reshard_job.job.stages.prepare import IDENTICAL_CHECKED, Prepared, identical_to_check
from reshard_job.job.run.progress import Progress


@dataclass(frozen=True)
class SourceDigests:
    files: list[dict]  # [{"rank", "path", "size", "sha256"}] of every source checkpoint file read
    strategies: list[FileDigest]  # the source strategy file(s)
    identities: dict[int, tuple]  # rank -> identity while hashed (a tuple of them for a multi-file rank)
    fingerprints: object = None  # ``proof.source_taps.SourceTaps`` fed by this read, where asked for
    # where this read read nothing: what makes and feeds them, for a conversion that runs (``settled``)
    pending: Callable[[], object] | None = field(default=None, compare=False, repr=False)

    def settled(self) -> "SourceDigests":
        """These digests with their fingerprints' taps made and fed, where they were left for later."""
        return self if self.pending is None else replace(self, fingerprints=self.pending(), pending=None)


def hash_sources(prepared: Prepared, *, use_cache: bool = True, progress: bool | None = None,
                 storage: StorageOptions | None = None, taps=None,
                 make_taps: Callable[[], object] | None = None) -> SourceDigests:
    """`taps` (``proof.source_taps.SourceTaps``): fed the bytes of the files they tap as they are
    hashed; those of files not hashed (digests cached) from their state kept in the cache, else
    from reads of their records. `make_taps` makes them where this pass reads a file; where it
    reads none, they are made and fed only for a conversion that runs (``SourceDigests.settled``):
    a rerun that finds its outputs complete does without (4 of a 300,000-parameter no-op's 17 s)."""
    needed = sorted(prepared.plan.source_ranks)
    # files are hashed under their own names (a selection renames what the plan sees, not the files)
    parts = [(r, reader) for r in needed for reader in _file_readers(prepared.readers.raw_reader(r))]
    identical = _under_stored_names(identical_to_check(prepared), prepared)
    compare = _to_compare(identical)
    requests, held = zip(*[_request(reader, compare.get(r, ())) for r, reader in parts]) if parts else ((), ())
    cache = HashCache(default_cache_path(), storage) if use_cache else None
    known = prepared.readers.digests  # remote sources hashed while they were indexed
    todo = sum(reader.size for (_, reader), q in zip(parts, requests)
               if usable_digest(known.get(q.path), q) is None and (cache is None or cache.get(q) is None))
    pending = None
    if make_taps is not None and taps is None:
        if todo:
            taps = make_taps()
        else:
            pending = partial(_fed, make_taps, cache, progress, storage, known)
    if taps is not None:
        requests = tuple(replace(q, tap=taps.tap(r, i)) for (r, i), q in zip(_file_keys(parts), requests))
    bar = Progress(todo, len(parts), enabled=progress, desc="hashing sources")
    try:
        digests = digest_files(requests, threads=2, progress=bar.add_bytes, cache=cache, storage_options=storage,
                               known=known)
        for (_, reader), d in zip(parts, digests):
            _check_crcs(reader, d)
            bar.step_done()
    finally:
        bar.close()
    if identical:
        _compare_identical(prepared, identical, compare, parts, requests, digests, held)
    strategies = digest_files([HashRequest(p) for p in prepared.strategy.files], threads=1, storage_options=storage)
    if cache is not None:
        cache.save()
    files = [{"rank": r, "path": d.path, "size": d.size, "sha256": d.sha256} for (r, _), d in zip(parts, digests)]
    if taps is not None:
        _feed_taps(taps, cache, progress, storage, known)
    return SourceDigests(files, strategies, _identities(prepared, parts, digests), taps, pending)


def _fed(make_taps: Callable[[], object], cache: HashCache | None, progress: bool | None, storage, streamed):
    taps = make_taps()
    if taps is not None:  # None: no fingerprints asked for (``job.fingerprints=false``)
        _feed_taps(taps, cache, progress, storage, streamed)
    return taps


def _file_keys(parts) -> list[tuple[int, int]]:
    """(rank, index of the file in its rank) of each of `parts`, which lists a rank's files together."""
    keys, last, i = [], None, 0
    for r, _ in parts:
        i = i + 1 if r == last else 0
        keys.append((r, i))
        last = r
    return keys


def _feed_taps(taps, cache: HashCache | None, progress: bool | None, storage, streamed) -> None:
    """The taps the hash pass did not feed: from what remote files gave as they were indexed
    (`streamed`, ``proof.stream_taps``), from the states the cache kept, else from their records."""
    from reshard_job.proof.stream_taps import serve_taps
    from reshard_job.sources.byte_taps import TapCache

    serve_taps(taps, streamed)
    tap_cache = TapCache(os.path.join(cache.folder, "taps")) if cache is not None else None
    todo = taps.unfed(tap_cache)
    bar = Progress(sum(n for tap in todo for _, n in tap.ranges()), len(todo), enabled=progress if todo else False,
                   desc="fingerprinting sources")
    try:
        taps.feed(todo, storage=storage, progress=bar.add_bytes)
    finally:
        bar.close()
    if tap_cache is not None:
        taps.keep(tap_cache)
    taps.settle()


def _file_readers(reader) -> tuple:
    """The per-file readers of one source rank (one, or one per file of a multi-file rank)."""
    return tuple(reader.readers) if isinstance(reader, MultiFileReader) else (reader,)


def _under_stored_names(identical: dict, prepared: Prepared) -> dict:
    """The plan's ``identical`` groups under the files' own names (``target.rename``)."""
    renamed = prepared.selected.renamed if prepared.selected is not None else {}
    return {renamed.get(name, name): groups for name, groups in identical.items()} if renamed else identical


def _identities(prepared: Prepared, parts, digests: list[FileDigest]) -> dict[int, tuple]:
    """rank -> identity while hashed: the file's, or for a rank of several files the tuple of theirs."""
    by_rank: dict[int, list[tuple]] = {}
    for (r, _), d in zip(parts, digests):
        by_rank.setdefault(r, []).append(tuple(d.identity))
    return {r: ids[0] if isinstance(prepared.source_paths[r], str) else tuple(ids) for r, ids in by_rank.items()}


def _format_segments(reader) -> tuple[tuple[int, int], ...]:
    """The byte ranges whose CRC32 the file's format records (checked in the same read)."""
    if isinstance(reader, CheckpointReader) and reader.has_crc:
        return ((0, reader.size - CRC_TRAILER_LEN),)
    if isinstance(reader, SafetensorsReader) and reader.has_crc:
        reader.stored_crc()  # a garbled crc_num is refused before anything is read
        return tuple((off, n) for off, n, _ in _tensor_spans(reader))
    return ()


def _request(reader, names) -> tuple[HashRequest, tuple[list[str], dict[str, int]]]:
    """One read of the file for its sha256, its format's CRCs, and the CRC of every tensor to be
    compared across ranks (its pieces, in order); returns the request, the names it holds of those
    and the number of pieces of the ones stored in more than one."""
    segments = list(_format_segments(reader))
    several: dict[str, int] = {}
    held: list[str] = []  # (a rank of several files holds each in one of them)
    # records' ranges straight from the index columns: no entry built for each of a million small tensors
    ranges = reader.record_ranges(names) if names and hasattr(reader, "record_ranges") else None
    spans = whole_spans_of(reader, names) if ranges is None else ()
    if ranges is None and names and None not in spans:
        ranges = [(span[2], span[3]) for span in spans]
    if ranges is not None:  # each one record of its own (the many-small-tensors case): at once, as a table
        segments = SegmentTable(np.concatenate([np.array(segments, np.int64).reshape(-1, 2),
                                                np.array(ranges, np.int64).reshape(-1, 2)]))
        held = list(names)
    else:
        for name, span in zip(names, spans):
            if span is not None:
                segments.append((span[2], span[3]))
            elif name in reader.entries:
                pieces = reader.entries[name].pieces
                segments.extend(pieces)
                if len(pieces) != 1:
                    several[name] = len(pieces)
            else:
                continue
            held.append(name)
    # the identity the file had when indexed: one replaced since is refused, not hashed
    seen = tuple(getattr(reader, "identity", ()) or ())
    table = segments if isinstance(segments, SegmentTable) else tuple(segments)
    return HashRequest(reader.path, table if len(table) else None, seen), (held, several)


def _tensor_spans(reader: SafetensorsReader) -> list[tuple[int, int, str]]:
    """(file offset, length, name) of every tensor with data, in file order (empty ones add nothing)."""
    return sorted((e.pieces[0][0], e.pieces[0][1], e.name) for e in reader.entries.values()
                  if e.pieces and e.pieces[0][1] > 0)


def _to_compare(identical: dict) -> dict[int, list[str]]:
    """rank -> the tensors it holds that the plan says other ranks hold identically."""
    # by group first: a million replicated tensors of one group are one list, extended per rank
    by_group: dict[tuple, list[str]] = {}
    for name, groups in identical.items():
        for group in groups:
            by_group.setdefault(group, []).append(name)
    out: dict[int, list[str]] = {}
    for group, names in by_group.items():
        for r in group:
            out.setdefault(r, []).extend(names)
    return out


def _compare_identical(prepared: Prepared, identical: dict, compare: dict[int, list[str]], parts, requests, digests,
                       held) -> None:
    """Tensors that must be the same bytes on several ranks, compared by the CRC32 and length taken
    while hashing: no extra read, and a rank-local slice taken for a whole tensor is refused.

    Each rank's (CRC, length) is compared with the first one read of its group, and only that one
    is kept: a million replicated small tensors cost one entry each, not one per rank."""
    hashed, found = {r for r, _ in parts}, {}
    for (r, _), (names, _) in zip(parts, held):  # how many its files were asked for and hold
        found[r] = found.get(r, 0) + len(names)
    for r, names in compare.items():  # a rank of a group without the tensor differs from the rest
        if found.get(r) == len(names):
            continue
        entries = prepared.readers.raw_reader(r).entries if r in hashed else {}
        absent = set(names).difference(entries.keys())  # (a dict's keys where the reader has them)
        if absent:
            lacking = next(name for name in names if name in absent)
            raise identical_mismatch(lacking, next(g for g in identical[lacking] if r in g), prepared.source.strategy)
    first: dict = {}  # name, or (name, group) for a tensor of several groups -> (crc, length) of the first read
    reference = None  # the first file whose tensors are one record each: (names, values, of one group)
    in_first = False  # whether the reference's tensors of one group are in `first` too
    in_several_groups = {name for name, groups in identical.items() if len(groups) > 1}
    for (r, reader), request, d, (names, several) in zip(parts, requests, digests, held):
        skip = len(_format_segments(reader))
        segments, crcs = (request.segments or ())[skip:], (d.crcs or ())[skip:]
        if several or not names:
            chosen = None
        else:  # (CRC, length) of each; tensors of one group are compared file with file, at once
            lengths = segments.array[:, 1] if isinstance(segments, SegmentTable) else [n for _, n in segments]
            values = np.array([crcs, lengths], dtype=np.int64)
            alone = ~np.fromiter(map(in_several_groups.__contains__, names), bool, len(names))
            chosen = (names, values, alone)
            if reference is None:
                reference = chosen
            elif names == reference[0]:  # the same tensors in the same order (replicas)
                differ = np.flatnonzero(alone & (values != reference[1]).any(axis=0))
                if len(differ):
                    name = names[int(differ[0])]
                    raise identical_mismatch(name, identical[name][0], prepared.source.strategy)
            else:
                chosen = None
        if chosen is not None:  # the rest one by one
            _compare_one_by_one(prepared, identical, *_spill((names, values, ~alone)), r, first)
            continue
        if reference is not None and not in_first:
            _compare_one_by_one(prepared, identical, *_spill(reference), None, first)
            in_first = True
        pieces = zip((n for _, n in segments), crcs)
        _compare_one_by_one(prepared, identical, names, several, pieces, r, first)
    prepared.checks.append(IDENTICAL_CHECKED)


def _spill(chosen: tuple) -> tuple[list[str], dict, Iterator]:
    """(names, no pieces, (length, CRC) of each) of the tensors a (names, values, mask) triple selects."""
    names, values, mask = chosen
    at = np.flatnonzero(mask)
    picked = values[:, at].tolist()
    return [names[i] for i in at.tolist()], {}, zip(picked[1], picked[0])


def _compare_one_by_one(prepared: Prepared, identical: dict, names: list[str], several: dict[str, int], pieces, rank,
                        first: dict) -> None:
    """Each of `names` (its `several` pieces, else one; `pieces` gives (length, CRC) in order) with the
    first one read of its group, kept in `first`."""
    for name in names:
        count = several.get(name, 1)
        crc, total = 0, 0
        for _ in range(count):
            length, piece_crc = next(pieces)
            crc, total = crc32_combine(crc, piece_crc, length) if count > 1 else piece_crc, total + length
        value = (crc, total)
        groups = identical[name]
        group = groups[0] if len(groups) == 1 else next(g for g in groups if rank in g)
        key = name if len(groups) == 1 else (name, group)
        if first.setdefault(key, value) != value:
            raise identical_mismatch(name, group, prepared.source.strategy)


def _check_crcs(reader, digest: FileDigest) -> None:
    if isinstance(reader, CheckpointReader) and reader.has_crc:
        if digest.crcs[0] != reader.crc_stored:
            raise FormatError(reader.path, f"CRC32 mismatch: trailer says {reader.crc_stored}, records give "
                                           f"{digest.crcs[0]} (file corrupted)")
    elif isinstance(reader, SafetensorsReader) and reader.has_crc:
        parts = {name: (crc, n) for (_, n, name), crc in zip(_tensor_spans(reader), digest.crcs)}
        for name in reader.entries:  # empty tensors have no bytes: CRC 0 over 0 bytes
            parts.setdefault(name, (0, 0))
        parts.update(reader.scalar_crc_parts())  # a 0-d integer is hashed as its value in zero bytes
        computed = chain_crc(parts)
        if computed != reader.stored_crc():
            raise FormatError(reader.path, f"CRC32 mismatch: metadata crc_num says {reader.stored_crc()}, the tensors "
                                           f"give {computed} (file corrupted)")
