"""The fingerprint of every parameter of a checkpoint, in any layout or format, from its files.

A checkpoint set (rank files with their strategy, a whole file, a MindFormers save, an export
folder) is planned as if it were converted to one unsharded device: the planner then names, for
every parameter, the source pieces that make up the whole tensor exactly once (one replica of
each, pipeline stages and optimizer shards put together) and where each lands in the global
tensor. The rank task's own reading code then feeds those pieces, in the bounded row blocks it
uses for a conversion, to ``FingerprintWriter`` instead of a file: nothing is written, memory is
one read window, and every source kind the job reads is covered by the same code.

Only tensors are parameters here: the string and map entries of a ``.ckpt`` are left out.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Container

import reshard_job.core.dtypes as dtypes
from reshard_job.core.fingerprint import ALGORITHM, Fingerprint
from reshard_job.core.fingerprint_batch import WholeTensorBatch
from reshard_job.formats.base import TensorDecl
from reshard_job.formats.tensorfile import KIND_TENSOR
from reshard_job.plan.model import ParamPlans, RankPlan

log = logging.getLogger("reshard_job")
WINDOW = 32 << 20  # bytes read at a time per tensor (the rank task's max_memory)
BATCHED_TENSOR = 64 << 10  # whole tensors up to this size are fingerprinted in batches of one shape


class _Sink:
    """One tensor's bytes, in the C order of its global shape, into its fingerprint."""

    def __init__(self, owner: "FingerprintWriter", name: str, fp: Fingerprint | None):
        self.owner, self.name, self.fp, self.offset = owner, name, fp, 0

    def write(self, data) -> None:
        n = memoryview(data).nbytes
        if self.fp is not None:
            self.fp.add_run(self.offset, data)
        self.offset += n

    def close(self) -> None:
        self.owner._done(self.name, self.fp)


class FingerprintWriter:
    """The calls of a checkpoint writer (``arrange``, ``add_bytes``, ``begin``, ``add_str``,
    ``add_map``) fingerprinting each tensor of a one-device plan, whose target shape is the
    global shape. `nbytes`: the size of each tensor of an opaque dtype (none of MindSpore's now), which its
    fingerprint needs up front."""

    writes_in_given_order = True

    def __init__(self, nbytes: dict[str, int] | None = None, *, wanted: Container[str] | None = None):
        self.nbytes = nbytes or {}
        self.wanted = wanted
        self.digests: dict[str, str] = {}
        self._batch = WholeTensorBatch(self.digests)

    def _start(self, name: str, dtype: str, dims) -> Fingerprint | None:
        if self.wanted is not None and name not in self.wanted:
            return None
        if dtypes.BY_NAME[dtype].sliceable:
            return Fingerprint(dtype, dims)
        return Fingerprint(dtype, dims, nbytes=self.nbytes[name])

    def _done(self, name: str, fp: Fingerprint | None) -> None:
        if fp is not None:
            self.digests[name] = fp.hexdigest()  # raises unless every byte was fed

    def arrange(self, tensors: list[TensorDecl]) -> list[str]:
        return [t.name for t in tensors]

    def add_bytes(self, name: str, dtype: str, dims, data, *_) -> None:
        if (self.wanted is None or name in self.wanted) and dtypes.BY_NAME[dtype].sliceable \
                and memoryview(data).nbytes <= BATCHED_TENSOR:
            self._batch.add(name, dtype, dims, data)  # many small tensors: one vectorised pass per shape
            return
        fp = self._start(name, dtype, dims)
        if fp is not None:
            fp.add_run(0, data)
        self._done(name, fp)

    def finish(self) -> None:
        """Fingerprint what is still batched (call once every tensor was fed)."""
        self._batch.flush()

    def begin(self, name: str, dtype: str, dims, *_, **__) -> _Sink:
        return _Sink(self, name, self._start(name, dtype, dims))

    def add_str(self, name: str, text: str, dims=(0,)) -> None:
        return None

    def add_map(self, name: str, records) -> None:
        return None


def opaque_sizes(rank_plan: RankPlan) -> dict[str, int]:
    """Tensor name -> bytes, for the tensors of an opaque dtype in `rank_plan`."""
    params = rank_plan.params
    if isinstance(params, ParamPlans):  # (facts, slice) pairs: no ParamPlan view made per tensor
        pairs = ((t, piece[2]) for t, piece in zip(params.tensors, params.slices))
    else:
        pairs = ((p, p.nbytes) for p in params)
    return {t.name: nbytes for t, nbytes in pairs
            if t.kind == KIND_TENSOR and not dtypes.BY_NAME[t.dtype].sliceable}


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
    ``SourceFiles`` it was planned over); `wanted`: only these names (the others are not read)."""
    from reshard_job.execute.rank_task import write_params

    plan = rank_plan if wanted is None else RankPlan(rank_plan.target_rank, _only(rank_plan.params, wanted))
    writer = FingerprintWriter(opaque_sizes(plan))
    write_params(writer, plan, sources, max_memory=2 * WINDOW, progress=progress)
    writer.finish()
    return Fingerprints(writer.digests)


def _only(params, wanted: Container[str]):
    """`params` restricted to the names in `wanted`, kept in the compact ``ParamPlans`` form."""
    if isinstance(params, ParamPlans):
        kept = [i for i, t in enumerate(params.tensors) if t.name in wanted]
        return ParamPlans(tuple(params.tensors[i] for i in kept), tuple(params.slices[i] for i in kept))
    return [p for p in params if p.name in wanted]


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
