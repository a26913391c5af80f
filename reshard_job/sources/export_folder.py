"""Export folders as sources: safetensors shards named by ``model.safetensors.index.json``, read
back as one unsharded source rank (rank 0 is every shard the index names): ``ExportFolder``."""

from __future__ import annotations

import os

from reshard_job.errors import ConfigError, FormatError
from reshard_job.formats.hf_index import (INDEX_FILE, ExportIndex, check_against_index, index_size_limit,
                                          read_index_document, shard_header_limit)
from reshard_job.formats.safetensors.header import MAX_HEADER_BYTES
from reshard_job.formats.multifile import MultiFileSources
from reshard_job.json_stream import file_reader
from reshard_job.sources.open_files import SourceFiles
from reshard_job.sources.rank_folders import LoadedStrategy, RankFiles, check_no_iteration, load_strategy
from reshard_job.storage import StorageError, StorageOptions, absolute, storage_for


def read_index(out_dir: str | os.PathLike, storage: StorageOptions | None = None) -> dict[str, str]:
    """The weight map of an export folder's index (tensor -> shard file), checked for shape."""
    return read_export_index(out_dir, storage).weight_map


def read_export_index(out_dir: str | os.PathLike, storage: StorageOptions | None = None) -> ExportIndex:
    """An export folder's index (weight map, declared total size), checked for shape; refused
    unread when larger than what the folder's shards can need (``index_size_limit``)."""
    out_dir = absolute(out_dir)
    where = storage_for(out_dir, storage)
    path = where.join(out_dir, INDEX_FILE)
    try:
        shards = [e.size for e in where.listdir(out_dir) if e.is_file and e.name.endswith(".safetensors")]
        with where.open_read(path) as f:
            limit, why = index_size_limit(shards)
            if f.size > limit:
                raise FormatError(path, f"{f.size} bytes, more than an index of this folder can need: {limit} bytes "
                                        f"({why})")
            return read_index_document(file_reader(f), path)
    except FileNotFoundError:
        raise FormatError(path, "index not found (not a safetensors export folder, or an incomplete one)") from None
    except (OSError, StorageError) as e:
        raise FormatError(path, f"cannot be read ({getattr(e, 'strerror', None) or e})") from None


def export_files(out_dir: str | os.PathLike, storage: StorageOptions | None = None,
                 weight_map: dict[str, str] | None = None) -> tuple[str, ...]:
    """The shard files an export folder's index (or its `weight_map`) names (absolute, sorted);
    FormatError if one is absent."""
    out_dir = absolute(out_dir)
    where = storage_for(out_dir, storage)
    present = {e.name for e in where.listdir(out_dir) if e.is_file}
    names = sorted(set((read_index(out_dir, storage) if weight_map is None else weight_map).values()))
    for name in names:
        if name not in present:
            raise FormatError(where.join(out_dir, INDEX_FILE), f"names {name}, which is not in the folder")
    return tuple(where.join(out_dir, name) for name in names)


def open_export(out_dir: str | os.PathLike, *, verify_crc: bool = True) -> MultiFileSources:
    """An export folder as one unsharded source rank (rank 0), its files checked against the index."""
    out_dir = os.path.abspath(os.fspath(out_dir))
    index = read_export_index(out_dir)
    files = export_files(out_dir, weight_map=index.weight_map)
    check_shard_headers(storage_for(out_dir), files, index.weight_map)
    sources = MultiFileSources({0: files}, verify_crc=verify_crc)
    try:
        check_against_index(sources.reader(0), index, os.path.join(out_dir, INDEX_FILE))
    except BaseException:
        sources.close()
        raise
    return sources


def is_export_source(src_dir: str | None, storage_options: StorageOptions | None = None) -> bool:
    """Whether `src_dir` (a folder, or a prefix in a bucket) holds safetensors shards with
    ``model.safetensors.index.json``."""
    if src_dir is None:
        return False
    src_dir = absolute(src_dir)
    where = storage_for(src_dir, storage_options)
    try:
        info = where.info(where.join(src_dir, INDEX_FILE))
    except (OSError, StorageError):
        return False
    return info is not None and info.is_file


def discover_export(src_dir: str, storage_options: StorageOptions | None = None) -> RankFiles:
    """An export folder as one unsharded source rank: rank 0 is every shard its index names."""
    src_dir = absolute(src_dir)
    weight_map = read_index(src_dir, storage_options)
    files = export_files(src_dir, storage_options, weight_map)
    storage = storage_for(src_dir, storage_options)
    check_shard_headers(storage, files, weight_map)
    identities = tuple(tuple(i.identity) if (i := storage.info(f)) is not None else () for f in files)
    return RankFiles(storage.parent(files[0]), {0: files}, "safetensors", {}, {0: identities})


def check_shard_headers(storage, files: tuple[str, ...], weight_map: dict[str, str]) -> None:
    """Each shard's declared header length is within what the tensors the index lists in it can
    need (``shard_header_limit``), read from its first 8 bytes before any header is parsed."""
    listed: dict[str, list[str]] = {}
    for name, file_name in weight_map.items():
        listed.setdefault(file_name, []).append(name)
    for path in files:
        names = listed.get(storage.basename(path), ())
        with storage.open_read(path) as f:
            first = bytearray(8)
            if f.size < 8 or f.pread_into(0, memoryview(first)) < 8:
                continue  # too short: the safetensors reader says so
        declared, limit = int.from_bytes(first, "little"), shard_header_limit(names)
        if limit < declared <= MAX_HEADER_BYTES:  # (beyond that the reader's own limit names it)
            raise FormatError(path, f"header length {declared} is more than the {len(names)} tensor(s) {INDEX_FILE} "
                                    f"lists in it can need ({limit} bytes): the header describes tensors the index "
                                    f"does not list")


class ExportFolder:
    """An export for inference (shards + index) as a ``SourceReader``: the full model, so no source
    strategy; its files are checked against the index once they are opened."""

    def __init__(self, root: str, storage: StorageOptions | None = None):
        self.root = root
        self.storage = storage

    @classmethod
    def detect(cls, path: str | None, storage: StorageOptions | None = None) -> bool:
        return is_export_source(path, storage)

    def check(self, source) -> None:
        check_no_iteration(source)
        if source.strategy is not None:
            raise ConfigError(f"{source.checkpoints} holds {INDEX_FILE}: an export of the full model, which has no "
                              f"source strategy; set source.strategy=null (got {source.strategy})")

    def discover(self, source) -> RankFiles:
        return discover_export(self.root, self.storage)

    def layouts(self, strategy: str | None) -> LoadedStrategy:
        return load_strategy(strategy, self.storage)

    def verify(self, found: RankFiles, files: SourceFiles) -> list[str]:
        """Every tensor of the opened shards is where the index says, and the index lists no other."""
        folder = found.root
        check_against_index(files.raw_reader(0), read_export_index(folder, self.storage),
                            storage_for(folder, self.storage).join(folder, INDEX_FILE))
        return [f"every tensor is in the shard {INDEX_FILE} names"]
