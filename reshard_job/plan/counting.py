"""Which target rank counts each target tensor's bytes in the outputs' fingerprints (pure).

The outputs' fingerprint of a parameter is the sum of the partial fingerprints of the boxes the
target ranks write (``execute.writer_tap``); a box held by several ranks (replicas) must be
counted by one of them only, and every element of the global tensor by exactly one box. A
tensor's ``Place.counted`` (``plan.model``) names the rule, and a rank's ``RankPlan.counting``
the rules under which it counts: per target stage, each block of each distinct target layout is
counted by the lowest local rank holding it; a tensor whole on every rank of a stage by local
rank 0; a tensor written by one rank per block anyway (redundancy removed) by its writer; and a
tensor that lives in several target stages in the first of them only.
"""

from __future__ import annotations

from typing import Callable, Iterable

from reshard_job.core.layout import Layout
from reshard_job.plan.model import COUNTED_ALWAYS, COUNTED_FIRST


class StageCounting:
    """The counting rules of a target's stages: numbers of each stage's distinct target layouts
    (given by `stage_layouts`), and the ``RankPlan.counting`` of each local rank."""

    def __init__(self, stage_devices: int, stage_layouts: Callable[[int], tuple[Layout, ...]]):
        self.stage_devices = stage_devices
        self._stage_layouts = stage_layouts
        self._numbered: dict[int, dict[Layout, int]] = {}
        self._first: dict[Layout, frozenset[int]] = {}

    def number(self, t_stage: int, layout: Layout) -> int:
        """The ``Place.counted`` value of tensors laid out as `layout` in stage t_stage."""
        return self._numbers(t_stage)[layout]

    def counting(self, t_stage: int, r: int) -> frozenset[int]:
        return rank_counting(self._numbers(t_stage).items(), r, self.stage_devices, self._first)

    def _numbers(self, t_stage: int) -> dict[Layout, int]:
        numbered = self._numbered.get(t_stage)
        if numbered is None:
            numbered = self._numbered[t_stage] = {t: k for k, t in enumerate(self._stage_layouts(t_stage))}
        return numbered


def first_holders(layout: Layout, stage_devices: int) -> frozenset[int]:
    """The local ranks that hold a block of `layout` before any other rank of the stage does."""
    seen: dict[tuple, int] = {}
    for q in range(stage_devices):
        seen.setdefault(layout.block(q % layout.devices), q)
    return frozenset(seen.values())


def rank_counting(numbered: Iterable[tuple[Layout, int]], r: int, stage_devices: int,
                  cache: dict[Layout, frozenset[int]]) -> frozenset[int]:
    """The ``Place.counted`` values local rank r counts, given its stage's target layouts and their
    numbers; `cache` keeps each layout's first holders."""
    counting = {COUNTED_ALWAYS} | ({COUNTED_FIRST} if r == 0 else set())
    for layout, k in numbered:
        first = cache.get(layout)
        if first is None:
            first = cache[layout] = first_holders(layout, stage_devices)
        if r in first:
            counting.add(k)
    return frozenset(counting)
