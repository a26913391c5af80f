"""The fingerprint of every parameter of a checkpoint, in any layout or format, from its files.

A checkpoint set (rank files with their strategy, a whole file, a MindFormers save, an export
folder) is planned as if it were converted to one unsharded device: the planner then names, for
every parameter, the source pieces that make up the whole tensor exactly once (one replica of
each, pipeline stages and optimizer shards put together) and where each lands in the global
tensor. ``proof.pieces`` reads those pieces in bounded row blocks and feeds each straight to its
parameter's fingerprint with its global box: nothing is written or assembled, memory is one read
window, and every source kind the job reads is covered by the same readers.

Only tensors are parameters here: the string and map entries of a ``.ckpt`` are left out.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Container

from reshard_job.core.fingerprint import ALGORITHM
from reshard_job.plan.model import RankPlan
from reshard_job.proof.pieces import fingerprint_part, merge_parts

log = logging.getLogger("reshard_job")


@dataclass
class Fingerprints:
    """Parameter -> hex fingerprint of one checkpoint, with the algorithm that made them."""

    digests: dict[str, str] = field(default_factory=dict)
    algorithm: str = ALGORITHM

    def to_json(self) -> dict:
        return {"algorithm": self.algorithm, "parameters": dict(sorted(self.digests.items()))}


def fingerprint_plan(rank_plan: RankPlan, sources, *, wanted: Container[str] | None = None,
                     progress: Callable[[int], None] | None = None) -> Fingerprints:
    """The fingerprints of the tensors of a one-device `rank_plan` read from `sources` (the
    ``SourceFiles`` it was planned over), in this process; `wanted`: only these names (the others
    are not read)."""
    return Fingerprints(merge_parts([fingerprint_part(rank_plan, sources, wanted=wanted, progress=progress)]))


def single_device_plan(strategy, index, *, unmapped: str) -> RankPlan:
    """The plan that puts every parameter of a source (its ``LoadedStrategy`` and file index)
    whole onto one device: each global tensor from its pieces, once."""
    from reshard_job.plan.planner import Planner

    return Planner(strategy.topology, None, index, unmapped=unmapped).plan([0]).ranks[0]


@contextmanager
def quiet():
    """Hold back the INFO and WARNING lines that preparing a source prints (the job printed them
    already for the same files); errors still show."""
    logger = logging.getLogger("reshard_job")
    level = logger.level
    logger.setLevel(max(level, logging.ERROR))
    try:
        yield
    finally:
        logger.setLevel(level)
