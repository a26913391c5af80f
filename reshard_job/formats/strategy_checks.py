"""Checks a strategy's layouts and operator items pass as they are read, protobuf or JSON: the counts
a file declares bounded (``MAX_AXES``, ``MAX_DEVICES``, ``MAX_STAGES``), equal layouts shared."""

from __future__ import annotations

from reshard_job.core.strategy_model import MAX_AXES, MAX_DEVICES, MAX_STAGES, ParamLayout
from reshard_job.errors import StrategyFormatError
from reshard_job.text import bounded_list, quoted, shorten


def interned(shared: dict, layout: ParamLayout) -> ParamLayout:
    """Equal layouts as one object: a model of 300,000 parameters has a handful of layouts."""
    return shared.setdefault(layout, layout)


def check_stage(stage: int, path, where: str) -> None:
    if not 0 <= stage < MAX_STAGES:
        raise StrategyFormatError(path, f"{where}: pipeline stage {stage} is out of range (0..{MAX_STAGES - 1})")


def dev_matrix(dims: tuple[int, ...], path, name) -> tuple[int, ...]:
    where = f"parameter {quoted(name)}: dev_matrix {bounded_list(dims)}"
    if len(dims) > MAX_AXES:
        raise StrategyFormatError(path, f"{where} has {len(dims)} axes, more than {MAX_AXES}")
    if any(d < 1 for d in dims):
        raise StrategyFormatError(path, f"{where} must hold positive device counts")
    devices = 1
    for d in dims:
        devices *= d
        if devices > MAX_DEVICES:
            raise StrategyFormatError(path, f"{where} declares more than {MAX_DEVICES} devices")
    return dims


def tensor_map_entries(entries: tuple, path, name) -> tuple:
    if len(entries) > MAX_AXES or any(isinstance(e, tuple) and len(e) > MAX_AXES for e in entries):
        raise StrategyFormatError(path, f"parameter {quoted(name)}: tensor_map has more than {MAX_AXES} entries")
    return entries


def int_list(value, path, what) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise StrategyFormatError(path, f"{what} must be a list of integers, got {shorten(repr(value), 80)}")
    return tuple(value)
