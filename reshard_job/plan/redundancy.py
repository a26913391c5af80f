"""Which target rank writes each parameter when redundancy is removed (``target.remove_redundancy``).

MindSpore's ``save_checkpoint(..., remove_redundancy=True)`` (as ``ModelCheckpoint`` calls it) has
each rank store only the laid-out parameters assigned to it, plus every parameter the layout does
not cover. The assignment (``train/_utils.py``: ``get_parameter_redundancy`` then
``remove_param_redundancy``), restated from its behaviour:

1. Per pipeline stage, each laid-out parameter splits the stage's ranks into **redundancy groups**:
   ranks holding the same block (same coordinates on the device axes its tensor map uses and, with
   optimizer sharding of size k, the same optimizer part: positions i, i+k, i+2k, ... of the
   replica group). Each group is the ascending tuple of its ranks.
2. Parameters are taken in sorted-name order. Every distinct group tuple keeps one counter over
   the parameters that have it: the n-th such parameter (from 0) is written by the group's rank at
   position ``n mod len(group)``. Parameters sharing a group are thus dealt round-robin to its ranks,
   and two layouts that produce the same group tuple share its counter.

So every block is written exactly once, and the writing spreads over the replicas. A group is a
tuple of ranks holding the same block, which ``Layout.block`` gives directly.

Pure code, no I/O. Cost per stage: one ``block`` per local rank and distinct layout, and one step
per parameter and group.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

from reshard_job.core.layout import Layout


def replica_groups(layout: Layout, devices: int) -> tuple[tuple[int, ...], ...]:
    """The local ranks of a stage of `devices` ranks grouped by the block they hold, each group
    ascending (MindSpore's redundancy groups of a parameter laid out as `layout`)."""
    by_block: dict[tuple[int, ...], list[int]] = {}
    for q in range(devices):
        by_block.setdefault(layout.block(q % layout.devices), []).append(q)
    return tuple(tuple(g) for g in by_block.values())


class Owners(NamedTuple):
    """Who writes what in one stage. Parameters without replicas (every block on one rank) are
    written by every rank and not listed, so the lists stay about the size of what is deduplicated."""

    replicated: frozenset[str]  # laid-out parameters with some block held by several ranks
    owned: list[frozenset[str]]  # per local rank: those of `replicated` it writes

    def writes(self, local_rank: int, name: str) -> bool:
        return name not in self.replicated or name in self.owned[local_rank]


def stage_owners(laid_out: Iterable[tuple[str, Layout]], devices: int) -> Owners:
    """Who writes each of a stage's laid-out parameters (name, target layout) with redundancy removed."""
    owned: list[set[str]] = [set() for _ in range(devices)]
    replicated: set[str] = set()
    groups_of: dict[Layout, tuple[tuple[int, ...], ...]] = {}
    dealt: dict[tuple[int, ...], int] = {}  # group -> parameters dealt to it so far
    for name, layout in sorted(laid_out, key=lambda item: item[0]):
        groups = groups_of.get(layout)
        if groups is None:
            groups = groups_of[layout] = replica_groups(layout, devices)
        alone = len(groups) == devices  # one rank per block: counted (groups are shared), not listed
        if not alone:
            replicated.add(name)
        for group in groups:
            n = dealt.get(group, 0)
            dealt[group] = n + 1
            if not alone:
                owned[group[n % len(group)]].add(name)
    return Owners(frozenset(replicated), [frozenset(o) for o in owned])
