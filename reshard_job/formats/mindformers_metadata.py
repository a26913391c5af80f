"""MindFormers 2.x ``metadata.json``: bytes <-> values, checked (spec
``spec/mindformers-checkpoint-format.md``). Pure: no I/O; the folder it lives in is read by
``sources.mindformers_save``.

The document gives every parameter's global shape, dtype, layout, shards, and which file holds
each shard. What is checked here: every part of it (types, layouts against global shapes and
``axis_fragmentations``, chunks, ``storage_data`` keys and ranks against the layout's shard rule).
Errors name the file and the parameter.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field, replace
from math import prod

import reshard_job.core.dtypes as dtypes
from reshard_job.core.boxes import Box
from reshard_job.core.layout import coords, mixed_radix
from reshard_job.core.strategy_model import AxisEntry
from reshard_job.errors import FormatError

METADATA_FILE = "metadata.json"
MAX_METADATA_BYTES = 4 * 1024**3  # a metadata.json larger than this is not one
# <prefix>-model-0000003-0000008.safetensors; without a prefix the name starts at model-/opt-
SHARD_FILE = re.compile(
    r"^(?:(?P<prefix>.+)-)?(?P<kind>model|opt)-(?P<index>\d{7})-(?P<total>\d{7})\.safetensors$"
)
MESSAGE_NAME_LIMIT = 80

_DTYPES_BY_LOWER = {name.lower(): name for name in dtypes.BY_NAME}


class MindFormersFormatError(FormatError):
    """A MindFormers checkpoint folder, its metadata.json or one of its files is not as the format says."""


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


def short_name(name: str) -> str:
    return name if len(name) <= MESSAGE_NAME_LIMIT else name[: MESSAGE_NAME_LIMIT - 1] + "…"


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_list(value, where: str, path: str, *, minimum: int = 0) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(is_int(v) and v >= minimum for v in value):
        lower = "positive" if minimum == 1 else "non-negative"
        raise MindFormersFormatError(path, f"{where} must be a list of {lower} integers, got {brief(value)}")
    return tuple(value)


def brief(value) -> str:
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
                path, f"parameter {short_name(p.name)!r}: shard(s) {missing[:8]} have no storage_data entry "
                      f"(incomplete checkpoint)")
    _check_files_belong_to_one_rank(params, path)
    return params


def _parse_param(name: str, obj, path: str) -> ParamMetadata:
    where = f"parameter {short_name(name)!r}"
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
        raise MindFormersFormatError(path, f"{where}: unsupported dtype {brief(props['dtype'])}")
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
        if not (isinstance(offset, list) and len(offset) == 1 and is_int(offset[0])):
            raise MindFormersFormatError(
                path, f"{where}: chunk global_offset must be [<shard index>], got {brief(offset)}")
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
            path, f"{where}: layout tensor_map {brief(raw_map)} must have one entry per dimension ({ndim})")
    n = len(dev)
    seen: set[int] = set()
    tensor_map: list[AxisEntry] = []
    for entry in raw_map:
        values = entry if isinstance(entry, list) else [entry]
        if not values or not all(is_int(m) and -1 <= m < n for m in values):
            raise MindFormersFormatError(
                path, f"{where}: layout tensor_map entry {brief(entry)} must name device axes -1..{n - 1}")
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
                path, f"storage_data names parameter {short_name(name)!r}, which state_dict_metadata does not describe")
        where = f"parameter {short_name(name)!r} shard {k}"
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
                                  f"{brief(list(p.layout.rank_list))}")
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
            and isinstance(value[1], tuple) and len(value[1]) == 1 and is_int(value[1][0])):
        return value[0], value[1][0]
    raise MindFormersFormatError(path, f"storage_data key {brief(key)} is not of the form \"('<name>', (<shard>,))\"")


def _parse_location(e, where: str, path: str) -> ShardLocation:
    if not isinstance(e, dict):
        raise MindFormersFormatError(path, f"{where}: storage_data entries must be objects")
    file_name, rank, group = e.get("file_name"), e.get("storage_rank"), e.get("rank_group")
    if not isinstance(file_name, str) or not _is_plain_file_name(file_name):
        # a name with a folder part would read outside the iteration folder
        raise MindFormersFormatError(
            path, f"{where}: file_name {brief(file_name)} must be a file of the iteration folder")
    if not (is_int(rank) and rank >= 0):
        raise MindFormersFormatError(path, f"{where}: storage_rank must be a non-negative integer, got {brief(rank)}")
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
                              f"{loc.file_name} (parameter {short_name(p.name)!r}); a file holds one rank's slices")


def _show_map(tensor_map) -> str:
    return "[" + ", ".join(str(list(e)) if isinstance(e, tuple) else str(e) for e in tensor_map) + "]"
