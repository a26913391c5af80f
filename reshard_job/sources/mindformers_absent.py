"""Files a MindFormers save's metadata.json places that are not there.

A save whose ``opt-`` files were deleted (to keep the weights only) still converts what needs no
optimizer state: the parameters of absent files are left out of the save as loaded, listed with
why, and a conversion that needs any of them is refused with the line it always got
(``unavailable_error``). A parameter with part of its shards present and part absent is refused at
once: the part would pass for the whole tensor.
"""

from __future__ import annotations

from reshard_job.formats.mindformers_metadata import MindFormersFormatError, ParamMetadata, short_name

NOT_REGULAR = "is not a regular file (a FIFO or a device, or a link to one)"


Unavailable = dict[str, tuple[str, str]]  # parameter -> (the absent file, why it is unavailable)


def without_absent_files(params: dict[str, ParamMetadata], present: set[str], odd: set[str], absent_ok: bool,
                         where, folder: str) -> tuple[dict[str, ParamMetadata], Unavailable, tuple[str, ...]]:
    """(the parameters whose every shard lies in a present file, the others, the absent files). An
    absent file is refused unless `absent_ok`, and so is a parameter some of whose shards lie in
    present files and some in absent ones: its part would pass for a whole tensor."""
    unavailable: Unavailable = {}
    looked: dict[int, bool] = {}  # id of a parameter's locations -> whether they all lie in present files
    for p in params.values():
        fine = looked.get(id(p.locations))
        if fine is None:
            fine = looked[id(p.locations)] = all(loc.file_name in present for locs in p.locations for loc in locs)
        if fine:
            continue
        k, loc = next((k, loc) for k, locs in enumerate(p.locations) for loc in locs if loc.file_name not in present)
        why = (f"{NOT_REGULAR if loc.file_name in odd else 'file not found'}; metadata.json places shard {k} of "
               f"parameter {short_name(p.name)!r} (rank {loc.storage_rank}) there")
        path = where.join(folder, loc.file_name)
        partly = any(loc.file_name in present for locs in p.locations for loc in locs)
        if not absent_ok or loc.file_name in odd or partly:
            raise MindFormersFormatError(path, why)
        unavailable[p.name] = (path, why)
    if not unavailable:
        return params, unavailable, ()
    if len(unavailable) == len(params):
        raise MindFormersFormatError(*next(iter(unavailable.values())))
    absent = sorted({where.join(folder, loc.file_name) for p in params.values() if p.name in unavailable
                     for locs in p.locations for loc in locs})
    return {n: p for n, p in params.items() if n not in unavailable}, unavailable, tuple(absent)


def unavailable_error(save, needed: list[str], hint: str = "") -> MindFormersFormatError:
    """The refusal of a conversion that needs parameters `needed` of absent files: the first's."""
    path, why = save.unavailable[needed[0]]
    more = f" ({len(needed) - 1} more parameter(s) the conversion needs lie in absent files)" if len(needed) > 1 else ""
    return MindFormersFormatError(path, f"{why}{more}{hint}")
