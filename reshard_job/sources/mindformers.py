"""MindFormers 2.x distributed checkpoints (``iteration_XXXXXXXX/`` + ``metadata.json``) as a source.

Spec: ``spec/mindformers-checkpoint-format.md``. A save is a folder with
``latest_checkpointed_iteration.txt`` and ``iteration_<8 digits>/`` subfolders, each holding
``metadata.json`` (every parameter's global shape, dtype, layout, shards, and which file holds
each shard), ``common.json`` and ``<prefix>-model|opt-<idx>-<total>.safetensors`` files of local
slices. No strategy file and no ``rank_<r>/`` folders are involved.

How it meets the rest of the package. The planner understands MindSpore strategy files, so the
metadata layouts are turned into a ``StrategyFile`` of ``ParamLayout``s (keys ``"<stage>-<name>"``
when there are pipeline stages). That is exact, not an approximation: MindFormers' layouts already
have the optimizer split folded into the tensor map (extra axes on dimension 0, sometimes a split
device axis), and ``reshard_job.core.layout.Layout`` reads a multi-axis tensor map the same way the
spec computes a shard (first-listed axis most significant, axes counted from the right), so the
synthesized layouts carry no optimizer-shard fields. A "source rank" is a storage rank: the files
``storage_data`` says that rank wrote (a model file and an opt file), read as one through
``MultiFileReader``.

What is checked before anything is read: every part of ``metadata.json`` (types, layouts against
global shapes and ``axis_fragmentations``, chunks, ``storage_data`` keys and ranks against the
layout's shard rule), and the header of every file ``storage_data`` names (present, holding each
shard with the dtype and shape the metadata gives, and nothing ``metadata.json`` places
elsewhere). Only headers are read, so this costs one small read per file, not the checkpoint's
size.

Redundancy-removed saves (``save_remove_redundancy: True``) store each shard once, so file
numbers are not ranks and most ranks hold only some of a parameter's shards; ``storage_data`` is
the only map. They are described exactly here (``holders``, ``stored_by``, ``deduplicated``), but
the planner still expects every rank of a stage to hold its own slice: it refuses such a source
with a ``PlanError`` naming a rank that lacks a parameter, never a wrong output.

Deliberately not here: the MindSpore-style ``rank_<r>/<prefix>_rank_<r>-<epoch>_<step>.ckpt``
("legacy") saves of MindFormers, which are ordinary per-rank checkpoints with a strategy file;
object-store URLs (these are local paths).
"""

from __future__ import annotations

import ast
import json
import os
import re
from dataclasses import dataclass, field, replace
from math import prod

from reshard_job.errors import FormatError
import reshard_job.core.dtypes as dtypes
from reshard_job.core.tensor_meta import TensorMeta
from reshard_job.core.layout import coords, mixed_radix
from reshard_job.core.topology import Topology
from reshard_job.core.boxes import Box
from reshard_job.formats.multifile import MultiFileReader, MultiFileSources
from reshard_job.formats.safetensors import SafetensorsReader
from reshard_job.storage import StorageError, StorageOptions, absolute, storage_for
from reshard_job.core.strategy_model import FORMAT_PROTOBUF, MERGED_KEY, AxisEntry, ParamLayout, StrategyFile

TRACKER_FILE = "latest_checkpointed_iteration.txt"
METADATA_FILE = "metadata.json"
MAX_METADATA_BYTES = 4 * 1024**3  # a metadata.json larger than this is not one
COMMON_FILE = "common.json"
ITERATION_DIR = re.compile(r"^iteration_(\d{8})$")
# <prefix>-model-0000003-0000008.safetensors; without a prefix the name starts at model-/opt-
SHARD_FILE = re.compile(
    r"^(?:(?P<prefix>.+)-)?(?P<kind>model|opt)-(?P<index>\d{7})-(?P<total>\d{7})\.safetensors$"
)
SAFETENSORS_SUFFIX = ".safetensors"
MESSAGE_NAME_LIMIT = 80

_DTYPES_BY_LOWER = {name.lower(): name for name in dtypes.BY_NAME}


class MindFormersFormatError(FormatError):
    """A MindFormers checkpoint folder, its metadata.json or one of its files is not as the format says."""


def iteration_folder_name(iteration: int) -> str:
    return f"iteration_{iteration:08d}"


# =================================================================================== structure


@dataclass(frozen=True)
class ShardLocation:
    """One ``storage_data`` entry: a file that holds one shard, and which rank wrote it."""

    file_name: str
    storage_rank: int
    rank_group: tuple[int, ...]  # every rank holding this shard in training


@dataclass(frozen=True)
class MetadataLayout:
    """A parameter's ``layout`` in metadata.json (optimizer split already folded in)."""

    device_matrix: tuple[int, ...]
    tensor_map: tuple[AxisEntry, ...]  # ints, or tuples of ints for multi-axis dimensions
    rank_list: tuple[int, ...]  # position i = device i of device_matrix (row-major)

    def split_axes(self, dim: int) -> tuple[int, ...]:
        """Device-matrix positions (from the left) splitting `dim`, most significant first."""
        entry = self.tensor_map[dim]
        values = entry if isinstance(entry, tuple) else (entry,)
        n = len(self.device_matrix)
        return tuple(n - 1 - m for m in values if m != -1)

    def shard_of_position(self, position: int, fragments: tuple[int, ...]) -> int:
        """Shard index ``k`` held by `position` of ``rank_list`` (spec §3.2): row-major over dimensions."""
        c = coords(position, self.device_matrix)
        j = [mixed_radix([c[p] for p in self.split_axes(d)], [self.device_matrix[p] for p in self.split_axes(d)])
             for d in range(len(self.tensor_map))]
        return mixed_radix(j, list(fragments))


@dataclass(frozen=True, eq=False)
class ParamMetadata:
    """Everything metadata.json says about one parameter."""

    name: str
    dtype: str  # MindSpore name ("BFloat16", "Float32", ...)
    global_shape: tuple[int, ...]
    fragments: tuple[int, ...]  # axis_fragmentations: slices per dimension
    layout: MetadataLayout | None  # None: one full copy
    shard_shapes: dict[int, tuple[int, ...]] = field(default_factory=dict)  # shard index -> local shape
    locations: dict[int, tuple[ShardLocation, ...]] = field(default_factory=dict)  # shard index -> where

    @property
    def shard_count(self) -> int:
        return prod(self.fragments)

    def shard_box(self, k: int) -> Box:
        """The box of the global tensor that shard `k` covers."""
        j = coords(k, self.fragments)
        return tuple((jd * g // f, (jd + 1) * g // f) for jd, g, f in zip(j, self.global_shape, self.fragments))

    def shard_of(self, rank: int) -> int:
        """The shard a rank holds in training (the layout's rule); 0 for a layout-less parameter."""
        if self.layout is None:
            return 0
        return self.layout.shard_of_position(self.layout.rank_list.index(rank), self.fragments)

    def holders(self, k: int) -> tuple[int, ...]:
        """The storage ranks whose files hold shard `k`."""
        return tuple(loc.storage_rank for loc in self.locations.get(k, ()))


# ================================================================================ pure parsing


def _short(name: str) -> str:
    return name if len(name) <= MESSAGE_NAME_LIMIT else name[: MESSAGE_NAME_LIMIT - 1] + "…"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_list(value, where: str, path: str, *, minimum: int = 0) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(_is_int(v) and v >= minimum for v in value):
        lower = "positive" if minimum == 1 else "non-negative"
        raise MindFormersFormatError(path, f"{where} must be a list of {lower} integers, got {_brief(value)}")
    return tuple(value)


def _brief(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:59] + "…"


def parse_metadata(data: bytes, path: str) -> dict[str, ParamMetadata]:
    """Parse and check a metadata.json document (pure); errors name `path` and the parameter."""
    try:
        doc = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise MindFormersFormatError(
            path, f"not valid UTF-8 (byte {e.start}); expected MindFormers' metadata JSON") from None
    except json.JSONDecodeError as e:
        raise MindFormersFormatError(path, f"not valid JSON ({e})") from None
    except RecursionError:
        raise MindFormersFormatError(path, "JSON nested too deeply") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("state_dict_metadata"), dict) \
            or not isinstance(doc.get("storage_data"), dict):
        raise MindFormersFormatError(path, "expected an object with 'state_dict_metadata' and 'storage_data' objects")
    if not doc["state_dict_metadata"]:
        raise MindFormersFormatError(path, "'state_dict_metadata' describes no parameter")
    params = {name: _parse_param(name, obj, path) for name, obj in doc["state_dict_metadata"].items()}
    locations = _parse_storage(doc["storage_data"], params, path)
    params = {name: replace(p, locations=locations.get(name, {})) for name, p in params.items()}
    for p in params.values():
        missing = [k for k in range(p.shard_count) if k not in p.locations]
        if missing:
            raise MindFormersFormatError(
                path, f"parameter {_short(p.name)!r}: shard(s) {missing[:8]} have no storage_data entry "
                      f"(incomplete checkpoint)")
    _check_files_belong_to_one_rank(params, path)
    return params


def _parse_param(name: str, obj, path: str) -> ParamMetadata:
    where = f"parameter {_short(name)!r}"
    if not isinstance(obj, dict):
        raise MindFormersFormatError(path, f"{where}: entry must be an object")
    for key in ("properties", "global_shape", "axis_fragmentations", "layout", "chunk"):
        if key not in obj:
            raise MindFormersFormatError(path, f"{where}: entry lacks {key!r}")
    props = obj["properties"]
    if not isinstance(props, dict) or not isinstance(props.get("dtype"), str):
        raise MindFormersFormatError(path, f"{where}: properties.dtype must be a string")
    dtype = _DTYPES_BY_LOWER.get(props["dtype"].lower())
    if dtype is None or dtypes.BY_NAME[dtype].storage is None:
        raise MindFormersFormatError(path, f"{where}: unsupported dtype {_brief(props['dtype'])}")
    shape = _int_list(obj["global_shape"], f"{where}: global_shape", path)
    fragments = _int_list(obj["axis_fragmentations"], f"{where}: axis_fragmentations", path, minimum=1)
    if len(fragments) != len(shape):
        raise MindFormersFormatError(
            path, f"{where}: axis_fragmentations {list(fragments)} has {len(fragments)} entries "
                  f"but global_shape {list(shape)} has {len(shape)}")
    layout = None if obj["layout"] is None else _parse_layout(obj["layout"], len(shape), where, path)
    for d, (g, f) in enumerate(zip(shape, fragments)):
        want = 1 if layout is None else prod(layout.device_matrix[p] for p in layout.split_axes(d))
        if f != want:
            what = "no layout" if layout is None else (
                f"layout device_matrix {list(layout.device_matrix)} tensor_map {_show_map(layout.tensor_map)}")
            raise MindFormersFormatError(
                path, f"{where}: axis_fragmentations {list(fragments)} contradict {what} "
                      f"(dimension {d} is split {want} ways)")
        if g % f:
            raise MindFormersFormatError(
                path, f"{where}: dimension {d} of global_shape {list(shape)} cannot be split into {f} equal shards")
    local = tuple(g // f for g, f in zip(shape, fragments))
    chunks = obj["chunk"]
    if not isinstance(chunks, list) or not chunks:
        raise MindFormersFormatError(path, f"{where}: chunk must be a non-empty list")
    count = prod(fragments)
    shard_shapes: dict[int, tuple[int, ...]] = {}
    for c in chunks:
        offset = c.get("global_offset") if isinstance(c, dict) else None
        if not (isinstance(offset, list) and len(offset) == 1 and _is_int(offset[0])):
            raise MindFormersFormatError(
                path, f"{where}: chunk global_offset must be [<shard index>], got {_brief(offset)}")
        k = offset[0]
        if not 0 <= k < count:
            raise MindFormersFormatError(path, f"{where}: chunk shard index {k} is outside 0..{count - 1}")
        chunk_shape = _int_list(c.get("local_shape"), f"{where}: chunk local_shape", path)
        if chunk_shape != local:
            raise MindFormersFormatError(
                path, f"{where}: chunk {k} has local_shape {list(chunk_shape)}, but global_shape {list(shape)} "
                      f"split {list(fragments)} gives {list(local)}")
        if k in shard_shapes:
            raise MindFormersFormatError(path, f"{where}: chunk {k} is listed twice")
        shard_shapes[k] = chunk_shape
    if len(shard_shapes) != count:
        absent = sorted(set(range(count)) - set(shard_shapes))
        raise MindFormersFormatError(path, f"{where}: chunks lack shard(s) {absent[:8]} of {count}")
    return ParamMetadata(name, dtype, shape, fragments, layout, shard_shapes)


def _parse_layout(obj, ndim: int, where: str, path: str) -> MetadataLayout:
    if not isinstance(obj, dict):
        raise MindFormersFormatError(path, f"{where}: layout must be an object or null")
    for key in ("device_matrix", "tensor_map", "rank_list"):
        if key not in obj:
            raise MindFormersFormatError(path, f"{where}: layout lacks {key!r}")
    if obj.get("interleaved_parallel"):
        raise MindFormersFormatError(path, f"{where}: interleaved_parallel layouts are not supported")
    dev = _int_list(obj["device_matrix"], f"{where}: layout device_matrix", path, minimum=1)
    if not dev:
        raise MindFormersFormatError(path, f"{where}: layout device_matrix is empty")
    raw_map = obj["tensor_map"]
    if not isinstance(raw_map, list) or len(raw_map) != ndim:
        raise MindFormersFormatError(
            path, f"{where}: layout tensor_map {_brief(raw_map)} must have one entry per dimension ({ndim})")
    n = len(dev)
    seen: set[int] = set()
    tensor_map: list[AxisEntry] = []
    for entry in raw_map:
        values = entry if isinstance(entry, list) else [entry]
        if not values or not all(_is_int(m) and -1 <= m < n for m in values):
            raise MindFormersFormatError(
                path, f"{where}: layout tensor_map entry {_brief(entry)} must name device axes -1..{n - 1}")
        for m in values:
            if m != -1 and m in seen:
                raise MindFormersFormatError(path, f"{where}: layout tensor_map uses device axis {m} twice")
            seen.add(m)
        tensor_map.append(tuple(values) if isinstance(entry, list) else entry)
    ranks = _int_list(obj["rank_list"], f"{where}: layout rank_list", path)
    if len(ranks) != prod(dev) or len(set(ranks)) != len(ranks):
        raise MindFormersFormatError(
            path, f"{where}: layout rank_list must list {prod(dev)} distinct ranks (device_matrix {list(dev)}), "
                  f"got {len(ranks)}")
    return MetadataLayout(dev, tuple(tensor_map), ranks)


def _parse_storage(storage: dict, params: dict[str, ParamMetadata],
                   path: str) -> dict[str, dict[int, tuple[ShardLocation, ...]]]:
    """name -> shard index -> where it is stored, each entry checked against the layout's shard rule."""
    out: dict[str, dict[int, tuple[ShardLocation, ...]]] = {}
    for key, entries in storage.items():
        name, k = _parse_storage_key(key, path)
        p = params.get(name)
        if p is None:
            raise MindFormersFormatError(
                path, f"storage_data names parameter {_short(name)!r}, which state_dict_metadata does not describe")
        where = f"parameter {_short(name)!r} shard {k}"
        if not 0 <= k < p.shard_count:
            raise MindFormersFormatError(path, f"{where}: shard index outside 0..{p.shard_count - 1}")
        if k in out.get(name, {}):
            raise MindFormersFormatError(path, f"{where}: storage_data has two keys for it")
        if not isinstance(entries, list) or not entries:
            raise MindFormersFormatError(path, f"{where}: storage_data entry must be a non-empty list")
        locations = []
        for e in entries:
            loc = _parse_location(e, where, path)
            if p.layout is not None:
                for r in (loc.storage_rank,) + loc.rank_group:
                    if r not in p.layout.rank_list:
                        raise MindFormersFormatError(
                            path, f"{where}: rank {r} is not in the layout's rank_list "
                                  f"{_brief(list(p.layout.rank_list))}")
                    held = p.shard_of(r)
                    if held != k:
                        raise MindFormersFormatError(
                            path, f"{where}: storage_data says rank {r} holds it, "
                                  f"but the layout gives rank {r} shard {held}")
            if loc.storage_rank not in loc.rank_group:
                raise MindFormersFormatError(
                    path, f"{where}: storage_rank {loc.storage_rank} is not in its rank_group {list(loc.rank_group)}")
            if any(other.storage_rank == loc.storage_rank for other in locations):
                raise MindFormersFormatError(path, f"{where}: rank {loc.storage_rank} is listed twice")
            locations.append(loc)
        out.setdefault(name, {})[k] = tuple(locations)
    return out


def _parse_storage_key(key: str, path: str) -> tuple[str, int]:
    """``"('<name>', (<k>,))"``: Python's str() of a tuple, read with a literal evaluator."""
    try:
        value = ast.literal_eval(key)
    except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
        value = None
    if (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str)
            and isinstance(value[1], tuple) and len(value[1]) == 1 and _is_int(value[1][0])):
        return value[0], value[1][0]
    raise MindFormersFormatError(path, f"storage_data key {_brief(key)} is not of the form \"('<name>', (<shard>,))\"")


def _parse_location(e, where: str, path: str) -> ShardLocation:
    if not isinstance(e, dict):
        raise MindFormersFormatError(path, f"{where}: storage_data entries must be objects")
    file_name, rank, group = e.get("file_name"), e.get("storage_rank"), e.get("rank_group")
    if not isinstance(file_name, str) or not _is_plain_file_name(file_name):
        # a name with a folder part would read outside the iteration folder
        raise MindFormersFormatError(
            path, f"{where}: file_name {_brief(file_name)} must be a file of the iteration folder")
    if not (_is_int(rank) and rank >= 0):
        raise MindFormersFormatError(path, f"{where}: storage_rank must be a non-negative integer, got {_brief(rank)}")
    return ShardLocation(file_name, rank, _int_list(group, f"{where}: rank_group", path))


def _is_plain_file_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name and "\0" not in name


def _check_files_belong_to_one_rank(params: dict[str, ParamMetadata], path: str) -> None:
    owner: dict[str, int] = {}
    for p in params.values():
        for locs in p.locations.values():
            for loc in locs:
                first = owner.setdefault(loc.file_name, loc.storage_rank)
                if first != loc.storage_rank:
                    raise MindFormersFormatError(
                        path, f"storage_data places slices of ranks {first} and {loc.storage_rank} in one file "
                              f"{loc.file_name} (parameter {_short(p.name)!r}); a file holds one rank's slices")


def _show_map(tensor_map) -> str:
    return "[" + ", ".join(str(list(e)) if isinstance(e, tuple) else str(e) for e in tensor_map) + "]"


def synthesize_strategy(params: dict[str, ParamMetadata], path: str) -> StrategyFile | None:
    """The metadata layouts as a strategy file the planner reads (pure); None when nothing is sharded.

    Every layout must cover one whole pipeline stage: ``rank_list`` is ``range(s*S, s*S+S)`` for
    one stage size ``S`` shared by all parameters. Keys are ``"<stage>-<name>"`` when there are
    several stages (or when a plain name would itself look like such a key).
    """
    laid_out = [p for p in params.values() if p.layout is not None]
    if not laid_out:
        return None
    sizes = {len(p.layout.rank_list) for p in laid_out}
    if len(sizes) > 1:
        raise MindFormersFormatError(
            path, f"layouts cover different numbers of ranks {sorted(sizes)}; "
                  f"every layout must cover one pipeline stage")
    stage_size = sizes.pop()
    stage_of: dict[str, int] = {}
    for p in laid_out:
        ranks = p.layout.rank_list
        stage = ranks[0] // stage_size
        if ranks != tuple(range(stage * stage_size, (stage + 1) * stage_size)):
            raise MindFormersFormatError(
                path, f"parameter {_short(p.name)!r}: rank_list {_brief(list(ranks))} is not one pipeline stage "
                      f"of {stage_size} consecutive ranks")
        stage_of[p.name] = stage
    stages = sorted(set(stage_of.values()))
    if stages != list(range(len(stages))):
        empty = sorted(set(range(stages[-1] + 1)) - set(stages))
        raise MindFormersFormatError(path, f"no parameter lives in pipeline stage(s) {empty} (found stages {stages})")
    merged = len(stages) > 1 or any(MERGED_KEY.match(name) for name in stage_of)
    layouts = {}
    for p in laid_out:
        key = f"{stage_of[p.name]}-{p.name}" if merged else p.name
        layouts[key] = ParamLayout(dev_matrix=p.layout.device_matrix, tensor_map=p.layout.tensor_map,
                                   tensor_shape=p.global_shape)
    return StrategyFile(layouts, [], 1, FORMAT_PROTOBUF, path)


# ========================================================================================= I/O


def is_mindformers_checkpoint(path: str | os.PathLike, storage: StorageOptions | None = None) -> bool:
    """Whether `path` (a folder, or a prefix in a bucket) looks like a MindFormers save: its root,
    or one iteration folder of it."""
    path = absolute(path)
    try:
        return looks_like_mindformers(storage_for(path, storage).listdir(path))
    except (OSError, StorageError):
        return False


def looks_like_mindformers(listing) -> bool:
    """Whether a folder's entries (``FileInfo``) are those of a MindFormers save or iteration folder."""
    for entry in listing:
        if entry.name in (TRACKER_FILE, METADATA_FILE) and entry.is_file:
            return True
        if ITERATION_DIR.match(entry.name) and entry.is_dir:
            return True
        if SHARD_FILE.match(entry.name) and entry.is_file:
            return True
    return False


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
        if not _is_int(iteration) or iteration < 0:
            raise MindFormersFormatError(root, f"iteration must be a non-negative integer, got {_brief(iteration)}")
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
            raise MindFormersFormatError(tracker, f"expected a decimal iteration number, got {_brief(value)}")
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
    file_tensors: dict[str, dict[str, TensorMeta]]  # file -> what its header lists
    unreferenced: tuple[str, ...] = ()  # .safetensors files in the folder that storage_data never names
    storage: StorageOptions | None = None  # how the folder is reached (a bucket's endpoint and options)

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
                   for p in self.params.values() for locs in p.locations.values())

    def index(self) -> dict[int, dict[str, TensorMeta]]:
        """What each storage rank's files hold (rank -> name -> TensorMeta), from the headers."""
        out = {}
        for rank, files in sorted(self.rank_files.items()):
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
            for k, locs in p.locations.items():
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
        """The storage ranks' files as ``execute.execute_rank`` reads them."""
        return MultiFileSources(self.rank_files, verify_crc=verify_crc)

    def read_common(self) -> dict | None:
        """common.json (epoch, step, global_step, ...), or None when the folder has none."""
        where = storage_for(self.folder, self.storage)
        path = where.join(self.folder, COMMON_FILE)
        info = where.info(path)
        if info is None or not info.is_file:
            return None
        try:
            doc = json.loads(where.read_bytes(path, MAX_METADATA_BYTES).decode("utf-8"))
        except (OSError, StorageError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise MindFormersFormatError(path, f"cannot be read as JSON ({e})") from None
        if not isinstance(doc, dict):
            raise MindFormersFormatError(path, "expected a JSON object")
        return doc


def load_mindformers(path: str | os.PathLike, iteration: int | None = None,
                     storage: StorageOptions | None = None) -> MindFormersSource:
    """Read one iteration of a MindFormers save (a folder, or a prefix in a bucket): metadata,
    layouts, and every file's header, all checked."""
    root = absolute(path)
    folder, number = resolve_iteration(root, iteration, storage)
    where = storage_for(folder, storage)
    metadata_path = where.join(folder, METADATA_FILE)
    try:
        listing = where.listdir(folder)
    except (OSError, StorageError) as e:
        raise MindFormersFormatError(folder, f"cannot list the folder ({_why(e)})") from None
    present = {e.name for e in listing if e.name.endswith(SAFETENSORS_SUFFIX) and e.is_file}
    if not any(e.name == METADATA_FILE and e.is_file for e in listing):
        return _single_rank_save(root, folder, number, sorted(present), storage)
    try:
        data = where.read_bytes(metadata_path, MAX_METADATA_BYTES)
    except (OSError, StorageError) as e:
        raise MindFormersFormatError(metadata_path, f"cannot read ({_why(e)})") from None
    if not data.strip():
        raise MindFormersFormatError(metadata_path, "is empty (expected MindFormers' metadata JSON)")
    params = parse_metadata(data, metadata_path)
    strategy = synthesize_strategy(params, metadata_path)

    rank_names: dict[int, set[str]] = {}
    for p in params.values():
        for k, locs in p.locations.items():
            for loc in locs:
                if loc.file_name not in present:
                    raise MindFormersFormatError(
                        where.join(folder, loc.file_name),
                        f"file not found; metadata.json places shard {k} of parameter {_short(p.name)!r} "
                        f"(rank {loc.storage_rank}) there")
                rank_names.setdefault(loc.storage_rank, set()).add(loc.file_name)
    named = sorted(set().union(*rank_names.values()))
    file_tensors = {where.join(folder, n): _header(where.join(folder, n), storage) for n in named}
    _check_files_against_metadata(params, folder, file_tensors, where)
    rank_files = {r: tuple(where.join(folder, n) for n in sorted(names)) for r, names in sorted(rank_names.items())}
    _check_no_name_twice_per_rank(rank_files, file_tensors)
    return MindFormersSource(root, folder, number, params, strategy, rank_files, file_tensors,
                             tuple(where.join(folder, n) for n in sorted(present - set(named))), storage)


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


def _header(path: str, storage: StorageOptions | None = None) -> dict[str, TensorMeta]:
    with SafetensorsReader(storage_for(path, storage).open_read(path), verify_crc=False) as reader:
        return {name: TensorMeta(e.dtype, tuple(e.shape), "tensor", e.nbytes) for name, e in reader.entries.items()}


def _check_files_against_metadata(params: dict[str, ParamMetadata], folder: str,
                                  file_tensors: dict[str, dict[str, TensorMeta]], where) -> None:
    expected: dict[str, set[str]] = {}
    for p in params.values():
        for k, locs in p.locations.items():
            for loc in locs:
                path = where.join(folder, loc.file_name)
                expected.setdefault(path, set()).add(p.name)
                meta = file_tensors[path].get(p.name)
                if meta is None:
                    raise MindFormersFormatError(
                        path, f"lacks parameter {_short(p.name)!r}, whose shard {k} metadata.json places there")
                want = p.shard_shapes[k]
                if meta.dtype != p.dtype or meta.shape != want:
                    raise MindFormersFormatError(
                        path, f"parameter {_short(p.name)!r} is {meta.dtype} {list(meta.shape)} in the file, "
                              f"but metadata.json says shard {k} is {p.dtype} {list(want)}")
    for path, tensors in file_tensors.items():
        stray = [n for n in tensors if n in params and n not in expected.get(path, ())]
        if stray:
            raise MindFormersFormatError(
                path, f"holds parameter {_short(stray[0])!r}, but metadata.json places none of its shards in this file")


def _check_no_name_twice_per_rank(rank_files: dict[int, tuple[str, ...]],
                                  file_tensors: dict[str, dict[str, TensorMeta]]) -> None:
    for rank, files in rank_files.items():
        seen: dict[str, str] = {}
        for f in files:
            for name in file_tensors[f]:
                if name in seen:
                    raise MindFormersFormatError(
                        f, f"tensor {_short(name)!r} is also in {os.path.basename(seen[name])}; "
                           f"rank {rank}'s files must not hold it twice")
                seen[name] = f
