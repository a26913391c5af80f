"""One iteration of a MindFormers 2.x save read and checked: which iteration, ``metadata.json``,
and the header of every file it names (``MindFormersSource``).

A save is a folder with ``latest_checkpointed_iteration.txt`` and ``iteration_<8 digits>/``
subfolders, each holding ``metadata.json`` (parsed by ``formats.mindformers_metadata``),
``common.json`` and ``<prefix>-model|opt-<idx>-<total>.safetensors`` files of local slices.

What is checked before anything is read: every part of ``metadata.json`` (refused unread when
larger than the folder's files can need, ``metadata_size_limit``, and read a window at a time),
that the number in each file's name fits the rank ``storage_data`` says wrote it (``_check_files``:
a rank's slices in another rank's file would convert silently wrong), and the header of every
file ``storage_data`` names (present, holding each shard with the dtype and shape the metadata
gives, and nothing ``metadata.json`` places elsewhere). Only headers are read, so this costs one
small read per file, not the checkpoint's size.

Redundancy-removed saves (``save_remove_redundancy: True``) store each shard once, so file
numbers are not ranks and most ranks hold only some of a parameter's shards; ``storage_data`` is
the only map. They are described exactly here (``holders``, ``stored_by``, ``deduplicated``), but
the planner still expects every rank of a stage to hold its own slice: it refuses such a source
with a ``PlanError`` naming a rank that lacks a parameter, never a wrong output.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from reshard_job.core.tensor_meta import TensorMeta
from reshard_job.core.topology import Topology
from reshard_job.core.strategy_model import StrategyFile
from reshard_job.formats.mindformers_metadata import (METADATA_FILE, SHARD_FILE, MindFormersFormatError,
                                                      ParamMetadata, brief, is_int, read_metadata, short_name)
from reshard_job.formats.safetensors.header import MAX_HEADER_BYTES, header_scaled_limit
from reshard_job.formats.index import IndexView
from reshard_job.formats.multifile import MultiFileReader, MultiFileSources
from reshard_job.formats.safetensors import SafetensorsReader
from reshard_job.json_stream import JsonProblem, file_reader, loads_bounded
from reshard_job.sources.mindformers_absent import NOT_REGULAR, without_absent_files
from reshard_job.sources.mindformers_layouts import synthesize_strategy
from reshard_job.storage import StorageError, StorageOptions, absolute, storage_for

TRACKER_FILE = "latest_checkpointed_iteration.txt"
COMMON_FILE = "common.json"
ITERATION_DIR = re.compile(r"^iteration_(\d{8})$")
SAFETENSORS_SUFFIX = ".safetensors"
MAX_COMMON_BYTES = 1 << 20  # common.json: a few counters
# How large a metadata.json may be: it describes the shards of the folder's .safetensors files,
# whose headers list them (at most MAX_HEADER_BYTES each). A parameter's entries (layout, rank
# lists, one location per holder with its rank group) take at most some hundred times the bytes of
# its header entries even for stages of thousands of ranks, so: a base, plus 256 bytes per byte of
# each file up to MAX_HEADER_BYTES. A sparse or padded gigabyte beside a small save is refused
# at once; a real 200 MB document beside its shards is read (in windows, never whole).
METADATA_BASE_BYTES = 64 << 20
MIN_HEADER_ENTRY = 48  # bytes of the shortest tensor entry of a header: '"a":{"dtype":"U8","shape":[],...}'
METADATA_BYTES_PER_HEADER_BYTE = 256


def metadata_size_limit(file_sizes) -> tuple[int, str]:
    """(bytes, why) a metadata.json beside .safetensors files of `file_sizes` bytes may have."""
    return header_scaled_limit(file_sizes, METADATA_BASE_BYTES, METADATA_BYTES_PER_HEADER_BYTE, "its")


def iteration_folder_name(iteration: int) -> str:
    return f"iteration_{iteration:08d}"


def available_iterations(root: str, storage: StorageOptions | None = None) -> list[int]:
    try:
        listing = storage_for(root, storage).listdir(root)
    except (OSError, StorageError):
        return []
    return sorted(int(m.group(1)) for e in listing if (m := ITERATION_DIR.match(e.name)) and e.is_dir)


def _why(e: Exception) -> str:
    """What went wrong reading: the OS's words for a local file, the storage's line otherwise."""
    return getattr(e, "strerror", None) or str(e)


def _is_dir(path: str, storage: StorageOptions | None) -> bool:
    info = storage_for(path, storage).info(path)
    return info is not None and info.is_dir


def resolve_iteration(root: str | os.PathLike, iteration: int | None = None,
                      storage: StorageOptions | None = None) -> tuple[str, int | None]:
    """The iteration folder to read and its number (None when `root` is taken as the folder itself).

    The tracker file's iteration by default; `iteration` picks another. Without a tracker, a
    folder holding metadata.json or shard files is itself the iteration folder (spec §1).
    """
    root = absolute(root)
    where = storage_for(root, storage)
    if not _is_dir(root, storage):
        raise MindFormersFormatError(root, "not a directory (expected a MindFormers checkpoint folder)")
    tracker = where.join(root, TRACKER_FILE)
    if iteration is not None:
        if not is_int(iteration) or iteration < 0:
            raise MindFormersFormatError(root, f"iteration must be a non-negative integer, got {brief(iteration)}")
        folder = where.join(root, iteration_folder_name(iteration))
        if not _is_dir(folder, storage):
            found = available_iterations(root, storage)
            raise MindFormersFormatError(
                root, f"iteration {iteration} does not exist (no {iteration_folder_name(iteration)}/; "
                      f"available: {found or 'none'})")
        return folder, iteration
    info = where.info(tracker)
    if info is not None and info.is_file:
        try:
            with where.open_read(tracker) as f:
                head = bytearray(min(64, f.size))
                text = bytes(head[:f.pread_into(0, memoryview(head))])
        except (OSError, StorageError) as e:
            raise MindFormersFormatError(tracker, f"cannot read ({_why(e)})") from None
        value = text.decode("ascii", "replace").strip()
        if not value.isdigit() or not value.isascii():
            raise MindFormersFormatError(tracker, f"expected a decimal iteration number, got {brief(value)}")
        number = int(value)
        folder = where.join(root, iteration_folder_name(number))
        if not _is_dir(folder, storage):
            found = available_iterations(root, storage)
            raise MindFormersFormatError(
                tracker, f"names iteration {number}, but {iteration_folder_name(number)}/ is missing "
                         f"(available: {found or 'none'}; choose one with source.iteration)")
        return folder, number
    found = available_iterations(root, storage)
    if found:
        raise MindFormersFormatError(
            root, f"no {TRACKER_FILE} to say which iteration to read; choose one of {found} with source.iteration")
    return root, None


@dataclass
class MindFormersSource:
    """One iteration of a MindFormers save, as the planner and the executor need it."""

    root: str  # the folder the user named
    folder: str  # the iteration folder read
    iteration: int | None
    params: dict[str, ParamMetadata]  # metadata.json, in its order ({} for a single-rank save)
    strategy: StrategyFile | None  # the layouts as a strategy file; None when nothing is sharded
    rank_files: dict[int, tuple[str, ...]]  # storage rank -> its files (absolute paths)
    file_tensors: dict[str, Mapping[str, TensorMeta]]  # file -> what its header lists
    unreferenced: tuple[str, ...] = ()  # .safetensors files in the folder that storage_data never names
    storage: StorageOptions | None = None  # how the folder is reached (a bucket's endpoint and options)
    # parameters left out of `params` because their files are absent -> (the file, why) (``absent_files_ok``)
    unavailable: dict[str, tuple[str, str]] = field(default_factory=dict)
    absent_files: tuple[str, ...] = ()  # the files metadata.json places that are not there

    @property
    def parsed(self) -> dict[str, SafetensorsReader]:
        """The readers that parsed each file's header, by path (``SourceFiles``' `parsed`)."""
        return {path: view.reader for path, view in self.file_tensors.items() if isinstance(view, IndexView)}

    @property
    def metadata_path(self) -> str:
        return storage_for(self.folder, self.storage).join(self.folder, METADATA_FILE)

    @property
    def topology(self) -> Topology:
        return Topology.unsharded() if self.strategy is None else Topology.from_strategy(self.strategy)

    @property
    def devices(self) -> int:
        return self.topology.devices

    @property
    def deduplicated(self) -> bool:
        """True for a redundancy-removed save: some shard held by several ranks is stored by fewer."""
        return any(len(locs) < len(locs[0].rank_group)
                   for p in self.params.values() for locs in p.locations)

    def index(self) -> dict[int, dict[str, TensorMeta]]:
        """What each storage rank's files hold (rank -> name -> TensorMeta), from the headers."""
        out = {}
        for rank, files in sorted(self.rank_files.items()):
            if len(files) == 1:  # the header as it was read, not a copy (600,000 entries)
                out[rank] = self.file_tensors[files[0]]
                continue
            merged: dict[str, TensorMeta] = {}
            for f in files:
                merged.update(self.file_tensors[f])
            out[rank] = merged
        return out

    def holders(self, name: str) -> dict[int, tuple[int, ...]]:
        """Shard index -> the storage ranks whose files hold that shard of parameter `name`."""
        p = self.params[name]
        return {k: p.holders(k) for k in range(p.shard_count)}

    def stored_by(self, rank: int) -> dict[str, int]:
        """The shards storage rank `rank` wrote: parameter name -> shard index."""
        out = {}
        for p in self.params.values():
            for k, locs in enumerate(p.locations):
                if any(loc.storage_rank == rank for loc in locs):
                    out[p.name] = k
        return out

    def extras(self) -> dict[str, list[int]]:
        """Tensors in the files that metadata.json does not describe (``global_step``, ``learning_rate``)."""
        out: dict[str, list[int]] = {}
        for rank, names in self.index().items():
            for name in names:
                if name not in self.params:
                    out.setdefault(name, []).append(rank)
        return out

    def reader(self, rank: int, *, verify_crc: bool = True) -> MultiFileReader:
        return MultiFileReader(self.rank_files[rank], verify_crc=verify_crc)

    def sources(self, *, verify_crc: bool = True) -> MultiFileSources:
        """The storage ranks' files as ``execute.rank_task.execute_rank`` reads them."""
        return MultiFileSources(self.rank_files, verify_crc=verify_crc)

    def read_common(self) -> dict | None:
        """common.json (epoch, step, global_step, ...), or None when the folder has none."""
        where = storage_for(self.folder, self.storage)
        path = where.join(self.folder, COMMON_FILE)
        info = where.info(path)
        if info is None or not info.is_file:
            return None
        try:
            doc = loads_bounded(where.read_bytes(path, MAX_COMMON_BYTES))
        except (OSError, StorageError, JsonProblem) as e:
            raise MindFormersFormatError(path, f"cannot be read as JSON ({e})") from None
        if not isinstance(doc, dict):
            raise MindFormersFormatError(path, "expected a JSON object")
        return doc


def load_mindformers(path: str | os.PathLike, iteration: int | None = None,
                     storage: StorageOptions | None = None, *, absent_files_ok: bool = False) -> MindFormersSource:
    """Read one iteration of a MindFormers save (a folder, or a prefix in a bucket): metadata,
    layouts, and every file's header, all checked.

    `absent_files_ok`: files metadata.json places that are not there (a save whose ``opt-`` files
    were deleted) leave their parameters out, listed in ``unavailable``, where every shard of each
    such parameter lies in absent files; the caller then refuses a conversion that needs one of
    them (``unavailable_error``). Otherwise, and for a parameter some present file holds part of,
    an absent file is refused here."""
    root = absolute(path)
    folder, number = resolve_iteration(root, iteration, storage)
    where = storage_for(folder, storage)
    metadata_path = where.join(folder, METADATA_FILE)
    try:
        listing = where.listdir(folder)
    except (OSError, StorageError) as e:
        raise MindFormersFormatError(folder, f"cannot list the folder ({_why(e)})") from None
    shards = [e for e in listing if e.name.endswith(SAFETENSORS_SUFFIX) and e.is_file]
    present = {e.name for e in shards}
    odd = {e.name for e in listing if not e.is_file and not e.is_dir}  # FIFOs, devices (links to them)
    if METADATA_FILE in odd:
        raise MindFormersFormatError(where.join(folder, METADATA_FILE), NOT_REGULAR)
    if not any(e.name == METADATA_FILE and e.is_file for e in listing):
        return _single_rank_save(root, folder, number, sorted(present), storage)
    params = _read_metadata(where, metadata_path, [e.size for e in shards])
    _check_files(params, metadata_path)
    params, unavailable, absent = without_absent_files(params, present, odd, absent_files_ok, where, folder)
    strategy = synthesize_strategy(params, metadata_path)

    rank_names: dict[int, set[str]] = {}
    for p in params.values():
        for locs in p.locations:
            for loc in locs:
                rank_names.setdefault(loc.storage_rank, set()).add(loc.file_name)
    named = sorted(set().union(*rank_names.values()))
    file_tensors = {where.join(folder, n): _header(where.join(folder, n), storage) for n in named}
    _check_files_against_metadata(params, folder, file_tensors, where, unavailable)
    rank_files = {r: tuple(where.join(folder, n) for n in sorted(names)) for r, names in sorted(rank_names.items())}
    _check_no_name_twice_per_rank(rank_files, file_tensors)
    return MindFormersSource(root, folder, number, params, strategy, rank_files, file_tensors,
                             tuple(where.join(folder, n) for n in sorted(present - set(named))), storage,
                             unavailable, absent)


def _read_metadata(where, path: str, shard_sizes: list[int]) -> dict[str, ParamMetadata]:
    """metadata.json read a window at a time (``read_metadata``), refused unread when larger than
    the folder's .safetensors files (of `shard_sizes` bytes) can need, and as soon as it places
    more shards than their headers can list (an entry takes ``MIN_HEADER_ENTRY`` bytes at least)."""
    limit = metadata_size_limit(shard_sizes)
    max_shards = sum(min(size, MAX_HEADER_BYTES) for size in shard_sizes) // MIN_HEADER_ENTRY
    try:
        with where.open_read(path) as f:
            if f.size > limit[0]:
                raise MindFormersFormatError(path, f"{f.size} bytes, more than a metadata.json of this folder can "
                                                   f"need: {limit[0]} bytes ({limit[1]})")
            if f.size == 0:
                raise MindFormersFormatError(path, "is empty (expected MindFormers' metadata JSON)")
            return read_metadata(file_reader(f), path, max_shards)
    except (OSError, StorageError) as e:
        raise MindFormersFormatError(path, f"cannot read ({_why(e)})") from None


def _single_rank_save(root: str, folder: str, number: int | None, files: list[str],
                      storage: StorageOptions | None = None) -> MindFormersSource:
    """No metadata.json: a single-rank job wrote full tensors (spec §1), unless the names say otherwise."""
    where = storage_for(folder, storage)
    if not files:
        raise MindFormersFormatError(
            where.join(folder, METADATA_FILE), "not found, and the folder holds no .safetensors files "
                                                 "(not a MindFormers checkpoint iteration)")
    totals = {int(m.group("total")) for n in files if (m := SHARD_FILE.match(n))}
    if any(t > 1 for t in totals):
        raise MindFormersFormatError(
            where.join(folder, METADATA_FILE),
            f"not found, but the file names say {max(totals)} ranks wrote this save; without it the "
            f"shards cannot be placed (copy metadata.json back from the save)")
    paths = tuple(where.join(folder, n) for n in files)
    file_tensors = {p: _header(p, storage) for p in paths}
    _check_no_name_twice_per_rank({0: paths}, file_tensors)
    return MindFormersSource(root, folder, number, {}, None, {0: paths}, file_tensors, (), storage)


def _header(path: str, storage: StorageOptions | None = None) -> Mapping[str, TensorMeta]:
    """What a file's header lists, over the (closed) reader that parsed it: the job's readers of
    the file take that header rather than parse it again (``MindFormersSource.parsed``)."""
    with SafetensorsReader(storage_for(path, storage).open_read(path), verify_crc=False) as reader:
        return IndexView(reader)


def _check_files_against_metadata(params: dict[str, ParamMetadata], folder: str,
                                  file_tensors: dict[str, dict[str, TensorMeta]], where,
                                  unavailable: Mapping[str, tuple] = {}) -> None:
    """Every shard in the file metadata.json places it in, with its dtype and shape, and no file
    holding a parameter none of whose shards metadata.json places there. Nothing is kept per
    parameter: the files a parameter's shards lie in are worked out once per distinct locations."""
    paths: dict[str, str] = {}  # file name -> its path
    for p in params.values():
        for k, locs in enumerate(p.locations):
            for loc in locs:
                path = paths.get(loc.file_name)
                if path is None:
                    path = paths[loc.file_name] = where.join(folder, loc.file_name)
                meta = file_tensors[path].get(p.name)
                if meta is None:
                    raise MindFormersFormatError(
                        path, f"lacks parameter {short_name(p.name)!r}, whose shard {k} metadata.json places there")
                want = p.local_shape
                if meta.dtype != p.dtype or meta.shape != want:
                    raise MindFormersFormatError(
                        path, f"parameter {short_name(p.name)!r} is {meta.dtype} {list(meta.shape)} in the file, "
                              f"but metadata.json says shard {k} is {p.dtype} {list(want)}")
    placed: dict[int, set[str]] = {}  # id of a parameter's locations -> the files they name
    for path, tensors in file_tensors.items():
        for name in tensors:
            p = params.get(name)
            if p is None:
                if name in unavailable:  # all its shards are placed in absent files
                    raise MindFormersFormatError(
                        path, f"holds parameter {short_name(name)!r}, but metadata.json places none of its shards "
                              f"in this file")
                continue
            files = placed.get(id(p.locations))
            if files is None:
                files = placed[id(p.locations)] = {paths[loc.file_name] for locs in p.locations for loc in locs}
            if path not in files:
                raise MindFormersFormatError(
                    path, f"holds parameter {short_name(name)!r}, but metadata.json places none of its shards in "
                          f"this file")


def _check_no_name_twice_per_rank(rank_files: dict[int, tuple[str, ...]],
                                  file_tensors: dict[str, dict[str, TensorMeta]]) -> None:
    for rank, files in rank_files.items():
        seen: dict[str, str] = {}
        for f in files:
            for name in file_tensors[f]:
                if name in seen:
                    raise MindFormersFormatError(
                        f, f"tensor {short_name(name)!r} is also in {os.path.basename(seen[name])}; "
                           f"rank {rank}'s files must not hold it twice")
                seen[name] = f


def _check_files(params: dict[str, ParamMetadata], path: str) -> None:
    """A file holds one rank's slices, and its name's number fits that rank (``_check_file_numbers``);
    each distinct tuple of locations is looked at once."""
    first: dict[str, tuple[int, str, int]] = {}  # file -> (storage rank, parameter, shard) naming it first
    looked: set[int] = set()
    deduplicated = False
    for p in params.values():
        for k, locs in enumerate(p.locations):
            if id(locs) in looked:
                continue
            looked.add(id(locs))
            deduplicated = deduplicated or len(locs) < len(locs[0].rank_group)
            for loc in locs:
                rank = first.setdefault(loc.file_name, (loc.storage_rank, p.name, k))[0]
                if rank != loc.storage_rank:
                    raise MindFormersFormatError(
                        path, f"storage_data places slices of ranks {rank} and {loc.storage_rank} in one file "
                              f"{loc.file_name} (parameter {short_name(p.name)!r}); a file holds one rank's slices")
    _check_file_numbers(first, deduplicated, path)


def _check_file_numbers(first: dict[str, tuple[int, str, int]], deduplicated: bool, path: str) -> None:
    """The number in each ``<prefix>-model|opt-<idx>-<total>`` file name against the rank that
    storage_data says wrote it (spec §1): without redundancy removal ``<idx>`` is that rank; with it,
    the ranks writing each kind of file are numbered 0, 1, ... in rank order and ``<total>`` counts
    them. A save that looks complete may use either. Names of other patterns are not checked."""
    groups: dict[tuple, list[tuple[int, int, int, str]]] = {}
    for file_name, (rank, _, _) in first.items():
        if m := SHARD_FILE.match(file_name):
            groups.setdefault((m["prefix"], m["kind"]), []).append((rank, int(m["index"]), int(m["total"]), file_name))
    for (_, kind), files in groups.items():
        files.sort()
        if all(index == i and total == len(files) for i, (_, index, total, _) in enumerate(files)) or (
                not deduplicated and all(index == rank < total == files[0][2] for rank, index, total, _ in files)):
            continue
        i, (rank, index, total, file_name) = next(
            ((i, f) for i, f in enumerate(files) if f[1] != (i if deduplicated else f[0]) or f[1] >= f[2]), (0, files[0]))
        if deduplicated:
            rule = (f"with redundancy removal the {len(files)} rank(s) writing {kind} files are numbered 0, 1, ... "
                    f"in rank order, which makes rank {rank}'s file number {i} of {len(files)}")
        else:
            rule = f"in a save without redundancy removal {kind} file n is the one rank n wrote"
        _, name, k = first[file_name]
        raise MindFormersFormatError(
            path, f"parameter {short_name(name)!r} shard {k}: storage_data says rank {rank} stored it in {file_name}, "
                  f"whose name makes it file {index} of {total}; {rule} (files renamed, or from another save?)")
