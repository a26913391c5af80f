"""MindFormers 2.x ``metadata.json``: bytes <-> values, checked (spec
``spec/mindformers-checkpoint-format.md``). Pure: no I/O; ``sources.mindformers_save`` reads the
folder and hands over a ``read(n)`` function (``read_metadata``), and checks the files it names.

The document gives every parameter's global shape, dtype, layout, shards, and which file holds
each shard. Checked here: every part of it (types, layouts against global shapes and
``axis_fragmentations``, chunks, ``storage_data`` keys and ranks against the layout's shard
rule). Errors name the file and the parameter.

A save of hundreds of thousands of parameters has a metadata.json of hundreds of megabytes
(``json.loads`` of 200 MB held 2.2 GB): it is read with ``json_stream.JsonStream``, an entry at a
time, an entry equal to a recent one not even scanned, into slotted objects that share equal
shapes, layouts and locations. Integers of over 20 digits are refused as such, and so are dims
no array can have (``core.sizes.shape_problem``).
"""

from __future__ import annotations

import io
import re
import sys
from dataclasses import dataclass, replace
from itertools import islice, repeat
from math import prod

import reshard_job.core.dtypes as dtypes
from reshard_job.core.boxes import Box
from reshard_job.core.layout import coords, mixed_radix
from reshard_job.core.sizes import shape_problem
from reshard_job.core.strategy_model import AxisEntry
from reshard_job.json_stream import RUN, JsonProblem, JsonStream
from reshard_job.formats.mindformers_parsing import MindFormersFormatError, Shared, brief, int_list, is_int, short_name
from reshard_job.formats.mindformers_storage import (ShardLocation, check_locations, parse_locations, parse_storage_key,
                                                     parse_storage_keys, with_rank_groups)

METADATA_FILE = "metadata.json"
# <prefix>-model-0000003-0000008.safetensors; without a prefix the name starts at model-/opt-
SHARD_FILE = re.compile(r"^(?:(?P<prefix>.+)-)?(?P<kind>model|opt)-(?P<index>\d{7})-(?P<total>\d{7})\.safetensors$")
_DTYPES_BY_LOWER = {name.lower(): name for name in dtypes.BY_NAME}


# =================================================================================== structure


@dataclass(frozen=True, slots=True)
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


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """What metadata.json says about a parameter apart from its name: equal ones are one object
    (a save of 600,000 parameters repeats a few)."""

    dtype: str  # MindSpore name ("BFloat16", "Float32", ...)
    global_shape: tuple[int, ...]
    fragments: tuple[int, ...]  # axis_fragmentations: slices per dimension
    layout: MetadataLayout | None  # None: one full copy
    local_shape: tuple[int, ...] = ()  # every shard's shape (chunks must all have it)
    locations: tuple[tuple[ShardLocation, ...], ...] = ()  # shard index -> where it is stored


@dataclass(frozen=True, eq=False, slots=True)
class ParamMetadata:
    """Everything metadata.json says about one parameter: its name and its (shared) spec."""

    name: str
    spec: ParamSpec

    @property
    def dtype(self) -> str:
        return self.spec.dtype

    @property
    def global_shape(self) -> tuple[int, ...]:
        return self.spec.global_shape

    @property
    def fragments(self) -> tuple[int, ...]:
        return self.spec.fragments

    @property
    def layout(self) -> MetadataLayout | None:
        return self.spec.layout

    @property
    def local_shape(self) -> tuple[int, ...]:
        return self.spec.local_shape

    @property
    def locations(self) -> tuple[tuple[ShardLocation, ...], ...]:
        return self.spec.locations

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
        locs = self.locations[k] if 0 <= k < len(self.locations) else ()
        return tuple(loc.storage_rank for loc in locs)


# ================================================================================ pure parsing


def parse_metadata(data: bytes, path: str) -> dict[str, ParamMetadata]:
    """Parse and check a metadata.json document held in memory (pure); see ``read_metadata``."""
    return read_metadata(io.BytesIO(data).read, path)


def read_metadata(read, path: str, max_shards: int | None = None) -> dict[str, ParamMetadata]:
    """Parse and check the metadata.json document `read` (``read(n) -> bytes``) yields, one
    parameter at a time; errors name `path` and the parameter. `max_shards`: how many tensors the
    files beside it can hold at most (a document placing more is refused as soon as it does)."""
    stream = JsonStream(read)
    shared = Shared(max_shards=max_shards)
    try:
        params, storage = _read_document(stream, path, shared)
        stream.end()
    except JsonProblem as e:
        raise MindFormersFormatError(path, str(e)) from None
    if params is None or storage is None:
        raise MindFormersFormatError(path, "expected an object with 'state_dict_metadata' and 'storage_data' objects")
    if not params:
        raise MindFormersFormatError(path, "'state_dict_metadata' describes no parameter")
    _attach_locations(params, storage, path, shared)
    return params


def _attach_locations(params: dict[str, ParamMetadata], storage: dict, path: str, shared: Shared) -> None:
    """Every parameter's shards' locations from `storage` (emptied), checked against its layout;
    what was checked for equal objects (shared: same layout, same locations) is not checked again."""
    done: dict[tuple, ParamSpec] = {}  # ids of spec and locations -> the spec with the locations, checked
    shards: dict[int, range] = {}  # id of a spec -> its shard indices
    pop = storage.pop
    for name, p in params.items():
        spec = p.spec
        indices = shards.get(id(spec)) or shards.setdefault(id(spec), range(p.shard_count))
        if len(indices) == 1:  # most parameters: one shard (not laid out, or only replicated)
            locations = (pop((name, 0), None),)
        else:
            locations = tuple(pop((name, k), None) for k in indices)
        key = (id(spec), *map(id, locations))
        checked = done.get(key)
        if checked is None:
            missing = [k for k, locs in enumerate(locations) if locs is None][:8]
            if missing:
                raise MindFormersFormatError(
                    path, f"parameter {short_name(p.name)!r}: shard(s) {missing} have no storage_data entry "
                          f"(incomplete checkpoint)")
            locations = with_rank_groups(p, locations, shared)
            check_locations(p, locations, path)
            checked = done[key] = shared(replace(p.spec, locations=locations))
        # made here and not yet handed out: set in place rather than copied (a million parameters)
        object.__setattr__(p, "spec", checked)
    for name, k in storage:  # left over: not a shard of a parameter described
        if name not in params:
            raise MindFormersFormatError(
                path, f"storage_data names parameter {short_name(name)!r}, which state_dict_metadata does not describe")
        raise MindFormersFormatError(path, f"parameter {short_name(name)!r} shard {k}: shard index outside "
                                           f"0..{params[name].shard_count - 1}")


CACHED_VALUES = 1 << 14  # entries remembered by their text (most repeat); forgotten all at once beyond


def _read_document(stream: JsonStream, path: str, shared: Shared):
    """(parameters by name, storage_data as (name, shard) -> locations), either None if absent."""
    params = storage = None
    if not stream.peek():
        raise MindFormersFormatError(path, "is empty (expected MindFormers' metadata JSON)")
    if stream.peek() != "{":
        raise MindFormersFormatError(path, "expected an object with 'state_dict_metadata' and 'storage_data' objects")
    for key in stream.members():
        if key == "state_dict_metadata" and params is None and stream.peek() == "{":
            params = _read_params(stream, path, shared)
        elif key == "storage_data" and storage is None and stream.peek() == "{":
            storage = {}
            seen: dict[str, tuple] = {}  # the text of a list of locations -> the locations
            # (equal texts give equal values: `seen` is also how the stream skips scanning them)
            for skey, entries, text in stream.items(seen, runs=True):
                if entries is RUN:
                    _add_storage_run(storage, skey, seen[text], path, shared)
                    continue
                name, k = _unplaced(storage, skey, path)
                locations = seen.get(text)
                if locations is None:
                    locations = parse_locations(entries, f"parameter {short_name(name)!r} shard {k}", path, shared)
                    _remember(seen, text, locations)
                _place(storage, name, k, locations, path, shared)
        elif key in ("state_dict_metadata", "storage_data"):
            raise MindFormersFormatError(path, f"expected {key!r} once, as an object")
        else:
            stream.value()  # something newer savers add: read past it
    return params, storage


def _add_storage_run(storage: dict, keys: list[str], locations: tuple, path: str, shared: Shared) -> None:
    """storage_data keys `keys` (consecutive, of one entry text) placed at `locations`, as one at a
    time would place them (which is how a run with anything wrong in it is read)."""
    try:
        places = [(sys.intern(name), k) for name, k in parse_storage_keys(keys, path)]
    except MindFormersFormatError:
        places = None
    if places is not None and storage.keys().isdisjoint(places) and len(set(places)) == len(places):
        shared.check_count(len(storage) + len(places), "storage_data places", path)
        storage.update(zip(places, repeat(locations)))
        return
    for key in keys:
        _place(storage, *_unplaced(storage, key, path), locations, path, shared)


def _unplaced(storage: dict, key: str, path: str) -> tuple[str, int]:
    """The (name, shard) a storage_data key names, refused if an earlier key named it too."""
    name, k = parse_storage_key(key, path)
    if (name, k) in storage:
        raise MindFormersFormatError(path, f"parameter {short_name(name)!r} shard {k}: storage_data has two keys for it")
    return name, k


def _place(storage: dict, name: str, k: int, locations: tuple, path: str, shared: Shared) -> None:
    storage[(sys.intern(name), k)] = locations
    shared.check_count(len(storage), "storage_data places", path)


def _remember(seen: dict, text: str, value) -> None:
    if len(seen) >= CACHED_VALUES:
        seen.clear()
    seen[text] = value


def _read_params(stream: JsonStream, path: str, shared: Shared) -> dict[str, ParamMetadata]:
    params: dict[str, ParamMetadata] = {}
    seen: dict[str, ParamMetadata] = {}  # the text of an entry -> what it gave (under its first name)
    for name, obj, text in stream.items(seen, runs=True):
        if obj is RUN:
            _add_run(params, name, seen[text].spec, path, shared)
            continue
        name = sys.intern(_new_param(params, name, path, shared))
        first = seen.get(text)
        if first is None:
            first = params[name] = _parse_param(name, obj, path, shared)
            _remember(seen, text, first)
        else:
            params[name] = ParamMetadata(name, first.spec)
    return params


def _add_run(params: dict[str, ParamMetadata], names: list[str], spec: ParamSpec, path: str, shared: Shared) -> None:
    """Parameters `names` (consecutive, of one entry text) with `spec`, as one at a time would add them."""
    if params.keys().isdisjoint(names) and len(set(names)) == len(names):
        shared.check_count(len(params) + len(names), "state_dict_metadata describes", path)
        names = list(map(sys.intern, names))
        params.update(zip(names, map(ParamMetadata, names, repeat(spec))))
        return
    for name in names:  # the first name described twice, said as the careful way says it
        params[name] = ParamMetadata(_new_param(params, name, path, shared), spec)


def _new_param(params: dict, name: str, path: str, shared: Shared) -> str:
    """`name`, refused if one more parameter is more than the files can hold, or it was described."""
    shared.check_count(len(params) + 1, "state_dict_metadata describes", path)
    if name in params:
        raise MindFormersFormatError(path, f"state_dict_metadata describes parameter {short_name(name)!r} twice")
    return name


def _parse_param(name: str, obj, path: str, shared: Shared) -> ParamMetadata:
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
    shape = int_list(obj["global_shape"], f"{where}: global_shape", path, shared)
    problem = shape_problem(shape, dtypes.BY_NAME[dtype].itemsize)
    if problem:
        raise MindFormersFormatError(path, f"{where}: global_shape {brief(list(shape))}: {problem}")
    fragments = int_list(obj["axis_fragmentations"], f"{where}: axis_fragmentations", path, shared, minimum=1)
    if len(fragments) != len(shape):
        raise MindFormersFormatError(
            path, f"{where}: axis_fragmentations {brief(list(fragments))} has {len(fragments)} entries "
                  f"but global_shape {brief(list(shape))} has {len(shape)}")
    layout = None if obj["layout"] is None else shared(_parse_layout(obj["layout"], len(shape), where, path, shared))
    _check_fragments(shape, fragments, layout, where, path)
    local = shared(tuple(g // f for g, f in zip(shape, fragments)))
    _check_chunks(obj["chunk"], prod(fragments), local, shape, fragments, where, path, shared)
    return ParamMetadata(shared(name), shared(ParamSpec(dtype, shape, fragments, layout, local)))


def _check_fragments(shape, fragments, layout: MetadataLayout | None, where: str, path: str) -> None:
    for d, (g, f) in enumerate(zip(shape, fragments)):
        want = 1 if layout is None else prod(layout.device_matrix[p] for p in layout.split_axes(d))
        if f != want:
            what = "no layout" if layout is None else (
                f"layout device_matrix {brief(list(layout.device_matrix))} tensor_map {_show_map(layout.tensor_map)}")
            raise MindFormersFormatError(
                path, f"{where}: axis_fragmentations {brief(list(fragments))} contradict {what} "
                      f"(dimension {d} is split {want} ways)")
        if g % f:
            raise MindFormersFormatError(
                path, f"{where}: dimension {d} of global_shape {brief(list(shape))} cannot be split into {f} "
                      f"equal shards")


def _check_chunks(chunks, count: int, local, shape, fragments, where: str, path: str, shared: Shared) -> None:
    """Every shard 0..count-1 listed once, with the local shape the split gives."""
    if not isinstance(chunks, list) or not chunks:
        raise MindFormersFormatError(path, f"{where}: chunk must be a non-empty list")
    if len(chunks) > count:
        raise MindFormersFormatError(path, f"{where}: {len(chunks)} chunks for {count} shard(s)")
    seen: set[int] = set()
    for c in chunks:
        offset = c.get("global_offset") if isinstance(c, dict) else None
        if not (isinstance(offset, list) and len(offset) == 1 and is_int(offset[0])):
            raise MindFormersFormatError(
                path, f"{where}: chunk global_offset must be [<shard index>], got {brief(offset)}")
        k = offset[0]
        if not 0 <= k < count:
            raise MindFormersFormatError(path, f"{where}: chunk shard index {k} is outside 0..{count - 1}")
        chunk_shape = int_list(c.get("local_shape"), f"{where}: chunk local_shape", path, shared)
        if chunk_shape != local:
            raise MindFormersFormatError(
                path, f"{where}: chunk {k} has local_shape {brief(list(chunk_shape))}, but global_shape "
                      f"{brief(list(shape))} split {brief(list(fragments))} gives {brief(list(local))}")
        if k in seen:
            raise MindFormersFormatError(path, f"{where}: chunk {k} is listed twice")
        seen.add(k)
    if len(seen) != count:
        absent = list(islice((k for k in range(count) if k not in seen), 8))
        raise MindFormersFormatError(path, f"{where}: chunks lack shard(s) {absent[:8]} of {count}")


def _parse_layout(obj, ndim: int, where: str, path: str, shared: Shared) -> MetadataLayout:
    if not isinstance(obj, dict):
        raise MindFormersFormatError(path, f"{where}: layout must be an object or null")
    for key in ("device_matrix", "tensor_map", "rank_list"):
        if key not in obj:
            raise MindFormersFormatError(path, f"{where}: layout lacks {key!r}")
    if obj.get("interleaved_parallel"):
        raise MindFormersFormatError(path, f"{where}: interleaved_parallel layouts are not supported")
    dev = int_list(obj["device_matrix"], f"{where}: layout device_matrix", path, shared, minimum=1)
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
    ranks = int_list(obj["rank_list"], f"{where}: layout rank_list", path, shared)
    devices = prod(dev)  # every device has its entry in rank_list: this bounds shard counts by the document
    if len(ranks) != devices or len(set(ranks)) != len(ranks):
        raise MindFormersFormatError(
            path, f"{where}: layout rank_list must list {devices if devices < 10**12 else 'over 10**12'} distinct "
                  f"ranks (device_matrix {brief(list(dev))}), got {len(ranks)}")
    return MetadataLayout(dev, shared(tuple(tensor_map)), ranks)


def _show_map(tensor_map) -> str:
    return "[" + ", ".join(str(list(e)) if isinstance(e, tuple) else str(e) for e in tensor_map) + "]"
