"""Naming the inputs by content, and checking them: one read of every source file the plan needs.

Each needed source file is hashed (sha256, for the manifest, the lineage record and the resume
fingerprint), and in the same read the CRCs its format carries are checked: a `.ckpt` CRC32
trailer, MindSpore safetensors' ``crc_num`` (chained over the tensors in name order). The file's
identity while it was hashed goes to the rank tasks, which refuse a file that changed since.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import FormatError
from ..formats.ckpt import CRC_TRAILER_LEN, CheckpointReader
from ..formats.crc32 import chain_crc
from ..formats.safetensors import SafetensorsReader
from ..hashing import FileDigest, HashCache, HashRequest, default_cache_path, digest_files
from ..storage import StorageOptions
from .prepare import Prepared
from .progress import Progress


@dataclass(frozen=True)
class SourceDigests:
    files: list[dict]  # [{"rank", "path", "size", "sha256"}] of every source checkpoint read
    strategies: list[FileDigest]  # the source strategy file(s)
    identities: dict[int, tuple]  # rank -> identity while hashed


def hash_sources(prepared: Prepared, *, use_cache: bool = True, progress: bool | None = None,
                 storage: StorageOptions | None = None) -> SourceDigests:
    needed = sorted(prepared.plan.source_ranks)
    requests = [_request(prepared.readers.reader(r)) for r in needed]
    cache = HashCache(default_cache_path(), storage) if use_cache else None
    todo = sum(prepared.readers.reader(r).size for r, q in zip(needed, requests)
               if cache is None or cache.get(q) is None)
    bar = Progress(todo, len(needed), enabled=progress, desc="hashing sources")
    try:
        digests = digest_files(requests, threads=2, progress=bar.add_bytes, cache=cache, storage_options=storage)
        for r, d in zip(needed, digests):
            _check_crcs(prepared.readers.reader(r), d)
            bar.step_done()
    finally:
        bar.close()
    strategies = digest_files([HashRequest(p) for p in prepared.strategy.files], threads=1, storage_options=storage)
    if cache is not None:
        cache.save()
    files = [{"rank": r, "path": d.path, "size": d.size, "sha256": d.sha256} for r, d in zip(needed, digests)]
    return SourceDigests(files, strategies, {r: d.identity for r, d in zip(needed, digests)})


def _request(reader) -> HashRequest:
    """The CRC ranges a file's format asks to be checked, with its sha256."""
    # The identity the file had when indexed: one replaced since is refused, not hashed.
    seen = tuple(getattr(reader, "identity", ()) or ())
    if isinstance(reader, CheckpointReader) and reader.has_crc:
        return HashRequest(reader.path, ((0, reader.size - CRC_TRAILER_LEN),), seen)
    if isinstance(reader, SafetensorsReader) and reader.has_crc:
        reader.stored_crc()  # a garbled crc_num is refused before anything is read
        return HashRequest(reader.path, tuple((off, n) for off, n, _ in _tensor_spans(reader)), seen)
    return HashRequest(reader.path, identity=seen)


def _tensor_spans(reader: SafetensorsReader) -> list[tuple[int, int, str]]:
    """(file offset, length, name) of every tensor with data, in file order (empty ones add nothing)."""
    return sorted((e.pieces[0][0], e.pieces[0][1], e.name) for e in reader.entries.values()
                  if e.pieces and e.pieces[0][1] > 0)


def _check_crcs(reader, digest: FileDigest) -> None:
    if isinstance(reader, CheckpointReader) and reader.has_crc:
        if digest.crcs[0] != reader.crc_stored:
            raise FormatError(reader.path, f"CRC32 mismatch: trailer says {reader.crc_stored}, records give "
                                           f"{digest.crcs[0]} (file corrupted)")
    elif isinstance(reader, SafetensorsReader) and reader.has_crc:
        parts = {name: (crc, n) for (_, n, name), crc in zip(_tensor_spans(reader), digest.crcs)}
        for name in reader.entries:  # empty tensors have no bytes: CRC 0 over 0 bytes
            parts.setdefault(name, (0, 0))
        computed = chain_crc(parts)
        if computed != reader.stored_crc():
            raise FormatError(reader.path, f"CRC32 mismatch: metadata crc_num says {reader.stored_crc()}, the tensors "
                                           f"give {computed} (file corrupted)")
