"""``storage_data`` of MindFormers' ``metadata.json``: where each shard is stored (spec
mindformers-checkpoint-format §3.3). Keys ``"('<name>', (<k>,))"``, entries ``file_name``,
``storage_rank`` and ``rank_group`` (absent in the files of MindFormers versions whose
``save_metadata`` does not write it: then derived from the layout), checked against the
parameter's layout. Pure."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING

from reshard_job.formats.mindformers_parsing import MindFormersFormatError, Shared, brief, int_list, is_int, short_name

if TYPE_CHECKING:
    from reshard_job.formats.mindformers_metadata import ParamMetadata

MAX_KEY_CHARS = 1 << 16  # a storage_data key read by a literal evaluator: longer is no "('<name>', (<k>,))"
_STORAGE_KEY = re.compile(r"^\('([^'\\]*)', \((\d{1,20}),\)\)$")  # the common case, without the evaluator
_STORAGE_KEYS = re.compile(r"\('([^'\\\0]*)', \((\d{1,20}),\)\)\0")  # the common case, keys joined by NULs
_ABSURD_INT = re.compile(r"\d{21}")


@dataclass(frozen=True, slots=True)
class ShardLocation:
    """One ``storage_data`` entry: a file that holds one shard, and which rank wrote it."""

    file_name: str
    storage_rank: int
    # every rank holding this shard in training; None until filled in from the layout where the file
    # has none (MindFormers' save_metadata of some versions writes only file_name and storage_rank)
    rank_group: tuple[int, ...] | None


def with_rank_groups(p: ParamMetadata, locations: tuple, shared: Shared) -> tuple:
    """Locations without a ``rank_group`` get the one the layout gives: the ranks of ``rank_list``
    holding that shard (for a layout-less parameter, the ranks listed). MindFormers' loader reads
    only file_name and storage_rank, so this is what such a file means to it as well."""
    if all(loc.rank_group is not None for locs in locations for loc in locs):
        return locations
    holders: dict[int, list[int]] = {}
    if p.layout is not None:
        for position, rank in enumerate(p.layout.rank_list):
            holders.setdefault(p.layout.shard_of_position(position, p.fragments), []).append(rank)
    out = []
    for k, locs in enumerate(locations):
        group = shared(tuple(sorted(holders.get(k, ()) if p.layout is not None else
                                    (loc.storage_rank for loc in locs))))
        out.append(shared(tuple(loc if loc.rank_group is not None else
                                shared(ShardLocation(loc.file_name, loc.storage_rank, group)) for loc in locs)))
    return tuple(out)


def parse_locations(entries, where: str, path: str, shared: Shared) -> tuple[ShardLocation, ...]:
    """One ``storage_data`` value (a list of locations) checked for shape."""
    if not isinstance(entries, list) or not entries:
        raise MindFormersFormatError(path, f"{where}: storage_data entry must be a non-empty list")
    locations = []
    for e in entries:
        loc = shared(parse_location(e, where, path, shared))
        if any(other.storage_rank == loc.storage_rank for other in locations):
            raise MindFormersFormatError(path, f"{where}: rank {loc.storage_rank} is listed twice")
        locations.append(loc)
    return shared(tuple(locations))


def check_locations(p: ParamMetadata, locations: tuple, path: str) -> None:
    """Each shard's locations against the layout's shard rule: every rank named holds that shard."""
    shard_at = {}  # rank -> shard its layout gives it, computed once per rank
    for k, locs in enumerate(dict.fromkeys(locations) if p.layout is None else locations):
        where = f"parameter {short_name(p.name)!r} shard {k}"
        ranks = {r for loc in locs for r in (loc.storage_rank,) + loc.rank_group} if p.layout else ()
        for r in sorted(ranks):
            held = shard_at.get(r)
            if held is None:
                if r not in p.layout.rank_list:
                    raise MindFormersFormatError(
                        path, f"{where}: rank {r} is not in the layout's rank_list {brief(list(p.layout.rank_list))}")
                held = shard_at[r] = p.shard_of(r)
            if held != k:
                raise MindFormersFormatError(
                    path, f"{where}: storage_data says rank {r} holds it, but the layout gives rank {r} shard {held}")
        for loc in locs:
            if loc.storage_rank not in loc.rank_group:
                raise MindFormersFormatError(path, f"{where}: storage_rank {loc.storage_rank} is not in its rank_group "
                                                   f"{brief(list(loc.rank_group))}")


def parse_storage_keys(keys: list[str], path: str) -> list[tuple[str, int]]:
    """``parse_storage_key`` of each of `keys`: all at once where every one has the common form."""
    joined = "\0".join(keys) + "\0"
    places = _STORAGE_KEYS.findall(joined)
    # every key wholly one match: as many matches as keys, covering as many characters
    if len(places) == len(keys) and len(joined) == len("".join(chain.from_iterable(places))) + 10 * len(keys):
        return [(name, int(k)) for name, k in places]
    return [parse_storage_key(key, path) for key in keys]


def parse_storage_key(key: str, path: str) -> tuple[str, int]:
    """``"('<name>', (<k>,))"``: Python's str() of a tuple, read with a literal evaluator."""
    fast = _STORAGE_KEY.match(key)
    if fast:
        return fast.group(1), int(fast.group(2))
    if _ABSURD_INT.search(key):
        raise MindFormersFormatError(path, f"storage_data key {brief(key)} holds an integer of more than 20 digits: "
                                           f"integers of absurd length are refused")
    value = None
    if len(key) <= MAX_KEY_CHARS:
        try:
            value = ast.literal_eval(key)
        except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
            pass
    if (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str)
            and isinstance(value[1], tuple) and len(value[1]) == 1 and is_int(value[1][0])):
        return value[0], value[1][0]
    raise MindFormersFormatError(path, f"storage_data key {brief(key)} is not of the form \"('<name>', (<shard>,))\"")


def parse_location(e, where: str, path: str, shared: Shared) -> ShardLocation:
    if not isinstance(e, dict):
        raise MindFormersFormatError(path, f"{where}: storage_data entries must be objects")
    file_name, rank, group = e.get("file_name"), e.get("storage_rank"), e.get("rank_group")
    if not isinstance(file_name, str) or not is_plain_file_name(file_name):
        # a name with a folder part would read outside the iteration folder
        raise MindFormersFormatError(
            path, f"{where}: file_name {brief(file_name)} must be a file of the iteration folder")
    if not (is_int(rank) and rank >= 0):
        raise MindFormersFormatError(path, f"{where}: storage_rank must be a non-negative integer, got {brief(rank)}")
    # absent (or null) in the files of MindFormers versions that do not write it: derived from the layout
    group = None if group is None else int_list(group, f"{where}: rank_group", path, shared)
    return ShardLocation(shared(file_name), rank, group)


def is_plain_file_name(name: str) -> bool:
    return (bool(name) and len(name) <= 255 and name not in (".", "..")
            and not any(c in name for c in "/\\\0"))
