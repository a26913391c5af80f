"""Planning: for every target rank and parameter, which source ranks and which boxes to copy.

Pure code: the inputs are the two topologies (resolved strategies) and an index of what each
source file holds (names, dtypes, shapes); the output is a ``Plan``, plain data that serialises to
JSON. It is what ``job.mode=plan`` prints, what the executor runs, and what lineage records as the
rank map.

Choices, and how they relate to MindSpore 2.10's converter (spec §5–§7):

* **Any M→N.** A target box is assembled from its intersections with source boxes, which works for
  any pair of device counts; MindSpore requires one count to divide the other.
* **Which replica is read.** Replicated source blocks are identical in a consistent checkpoint;
  we read the replica MindSpore reads, so results agree with it bit for bit: target local rank
  ``r`` reads the ranks of the optimizer chunk of source local rank ``r mod F`` (the chunk's
  blocks tile the tensor exactly), which is MindSpore's replica rule.
* **Exact reads.** A target rank reads only source ranks whose boxes intersect its own box, so
  ``rank_list_for_transform`` returns the set actually read, plus per source stage read from the
  file that parameters outside the strategies are copied from (a subset of MindSpore's list).
* **Training truth.** Boxes follow training semantics (``layout.py``); for optimizer-sharded
  non-canonical maps this differs from MindSpore's fast path, which reads the wrong rows.
* **Parameters in the source strategy but not in the target one**: MindSpore copies the source
  slice unchanged, which does not fit the target layout. The gradient-accumulation buffers a
  pipeline strategy lays out (``accu_grads.*``, ``BUFFER_PREFIXES``) are left out and listed in
  ``plan.omitted``; any other such parameter needs a choice: ``unmapped="full"`` keeps them as full
  tensors, ``unmapped="drop"`` leaves them out (listed too). A target strategy that lays out none of
  the checkpoints' parameters belongs to another network and is refused whatever the choice.
* **Parameters in the target strategy but not in the source one** are taken as whole tensors (as
  when no source strategy is given) and cut for the target; MindSpore copies them unchanged.
* **Parameters in neither strategy** (``global_step``, ``learning_rate``) are copied unchanged from
  source local rank ``r mod F`` of the lowest stage holding them, as MindSpore does.
* **Redundancy-removed saves** (``save_checkpoint(..., remove_redundancy=True)`` keeps each
  distinct block on one rank): a block is read from MindSpore's replica when its file holds it,
  else from another rank holding the same block. Only a block no file holds is refused, naming it.
* **Parameters shared by pipeline stages** (an embedding tied to the output layer) are one tensor
  laid out alike in each stage: read once (from the lowest stage, as MindSpore does), their other
  copies listed in ``Plan.identical``. Different layouts in different stages are refused.
* **JSON multi-axis maps**, which MindSpore's JSON writer records flattened with the extended
  ``tensor_shape``, are folded back here (``layout.unflatten``): only the checkpoint tells a
  tensor's number of dimensions.
* **Optimizer states a strategy leaves out** (MindSpore records trainable parameters only by
  default) are laid out like their parameter (``adam_m.w`` like ``w``), in the source when their
  local shapes match the parameter's, in the target when it lists no optimizer state at all.
  MindSpore copies them unchanged, which gives the target the source's slice shape.

Trust: a source strategy that does not describe the checkpoints must never plan into a wrong
checkpoint (MindSpore then writes wrong shapes and exits normally). The planner cross-checks what
it can see in the index before any output (``CHECK_*``, recorded in ``Plan.checks``): the
strategy lays out names the files hold; every laid-out parameter sits only in ranks of the stages
the strategy places it in, every block of it held by some rank, with one shape and one global
shape (and the JSON ``tensor_shape``); a parameter and its optimizer states have the same global
shape. What only the bytes can show is left to the job as plain data:
``Plan.identical`` lists, per tensor, groups of source ranks read that must hold identical bytes
(replicas of one block, and every holder of a tensor the strategy does not lay out, which is how
a rank-local slice taken for a whole tensor is caught). A wrong strategy that agrees with all of
this (each rank holding a distinct block of the right shape, only permuted) cannot be told from
the files alone.

Cost: planning is linear in what exists, never in what a strategy declares. Copy patterns are
computed arithmetically (``Layout.rank_holding``), one per distinct pair of layouts, target block
and source chunk, and stop early when they would need more source ranks than are present.
Memory per parameter and target rank is one small ``ParamPlan`` (three references and a size):
what parameters share is shared — their per-parameter facts (``_Tensor``), shapes, and copy
tuples (parameters with the same layouts and shape read the same boxes) — and target ranks whose
plans are the same up to their number (replicated targets: a thousand target ranks of an 8-rank
source have at most 8 different plans) share one tuple of ``ParamPlan``.
"""

from __future__ import annotations

import itertools
from array import array
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from math import gcd, prod
from typing import Iterable, Iterator, Mapping, NamedTuple, Sequence

from reshard_job.errors import MissingRankError, PlanError
import reshard_job.core.dtypes as dtypes
from reshard_job.core.boxes import Box, box_size, full_box
from reshard_job.core.tensor_meta import TensorMeta
from reshard_job.core.strategy_model import ParamLayout
from reshard_job.jsonchunks import LazyList
from reshard_job.core.layout import Layout, common_ndim, is_flattened, unflatten
from reshard_job.text import bounded_list, quoted, rank_ranges, shorten
from reshard_job.core.topology import Topology, optimizer_base

ACTION_RESHARD = "reshard"
ACTION_COPY = "copy"
ACTION_FULL = "full"

UNMAPPED_OMIT = "omit"  # leave out the buffers a pipeline lays out on purpose; refuse other parameters
UNMAPPED_FULL = "full"  # keep every parameter the target does not lay out, as a whole tensor
UNMAPPED_DROP = "drop"  # leave out every parameter the target does not lay out (the user's explicit choice)
UNMAPPED_CHOICES = (UNMAPPED_OMIT, UNMAPPED_FULL, UNMAPPED_DROP)
# gradient-accumulation buffers of pipeline training: a pipeline strategy lays them out, no target needs them
BUFFER_PREFIXES = ("accu_grads.",)

PLAN_VERSION = 3

# Missing source ranks listed per (parameter, target rank) once a copy pattern is known to need
# more source ranks than the stage has files: the rest is counted, not listed.
MISSING_SAMPLE = 16


SourceIndex = Mapping[int, Mapping[str, TensorMeta]]  # global source rank -> name -> meta


class Copy(NamedTuple):
    source_rank: int
    source_box: Box  # within the source rank's stored tensor
    target_box: Box  # within the target rank's tensor

    def to_json(self) -> list:
        """``[source_rank, source_box, target_box]``, each box flat: ``[start0, stop0, start1, stop1, ...]``.

        Compact on purpose: a plan holds one copy per (target rank, parameter, source box), which
        for a large model on many ranks is hundreds of thousands of them.
        """
        return [self.source_rank, [i for r in self.source_box for i in r], [i for r in self.target_box for i in r]]

    @staticmethod
    def from_json(item: list) -> "Copy":
        def box(flat):
            return tuple((int(flat[i]), int(flat[i + 1])) for i in range(0, len(flat), 2))

        return Copy(int(item[0]), box(item[1]), box(item[2]))


@dataclass(slots=True, eq=False)
class _Tensor:
    """What every target rank's plan of one parameter shares."""

    name: str
    dtype: str
    kind: str
    action: str
    global_shape: tuple[int, ...]
    itemsize: int  # 0 for str/map/packed entries (their nbytes is used instead)


class ParamPlan:
    """One parameter of one target rank: its target shape and the copies that fill it.

    Small on purpose (a plan holds one per parameter and target rank): the per-parameter facts
    live in a shared ``_Tensor`` and are read through properties.
    """

    __slots__ = ("tensor", "target_shape", "copies", "nbytes")

    def __init__(self, name: str, dtype: str, kind: str, action: str, global_shape: Sequence[int],
                 target_shape: Sequence[int], copies: Iterable[Copy], itemsize: int = 0, nbytes: int = 0):
        self.tensor = _Tensor(name, dtype, kind, action, tuple(global_shape), itemsize)
        self.target_shape = tuple(target_shape)
        self.copies = tuple(copies)
        self.nbytes = nbytes  # bytes of the target tensor

    @classmethod
    def _shared(cls, tensor: _Tensor, target_shape: tuple[int, ...], copies: tuple[Copy, ...],
                nbytes: int) -> "ParamPlan":
        plan = cls.__new__(cls)
        plan.tensor, plan.target_shape, plan.copies, plan.nbytes = tensor, target_shape, copies, nbytes
        return plan

    name = property(lambda self: self.tensor.name)
    dtype = property(lambda self: self.tensor.dtype)
    kind = property(lambda self: self.tensor.kind)
    action = property(lambda self: self.tensor.action)
    global_shape = property(lambda self: self.tensor.global_shape)
    itemsize = property(lambda self: self.tensor.itemsize)

    @property
    def bytes_read(self) -> int:
        if not self.itemsize:
            return self.nbytes
        return sum(box_size(c.source_box) for c in self.copies) * self.itemsize

    def _key(self) -> tuple:
        return (self.name, self.dtype, self.kind, self.action, self.global_shape, self.target_shape, self.copies,
                self.itemsize, self.nbytes)

    def __eq__(self, other) -> bool:
        return isinstance(other, ParamPlan) and self._key() == other._key()

    __hash__ = None

    def __repr__(self) -> str:
        return (f"ParamPlan({self.name!r}, {self.action}, {list(self.global_shape)} -> {list(self.target_shape)}, "
                f"{len(self.copies)} cop{'y' if len(self.copies) == 1 else 'ies'})")

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "kind": self.kind,
            "action": self.action,
            "global_shape": list(self.global_shape),
            "target_shape": list(self.target_shape),
            "nbytes": self.nbytes,
            "copies": [c.to_json() for c in self.copies],
        }


class ParamPlans(Sequence[ParamPlan]):
    """A target rank's parameters, stored as two tuples of shared references (the parameters'
    ``_Tensor`` and their (target shape, copies, nbytes) slices): 16 bytes per parameter instead
    of an object each. ``ParamPlan`` views are made on access."""

    __slots__ = ("tensors", "slices")

    def __init__(self, tensors: tuple[_Tensor, ...], slices: tuple[tuple, ...]):
        self.tensors = tensors
        self.slices = slices

    def __len__(self) -> int:
        return len(self.tensors)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [ParamPlan._shared(t, *sl) for t, sl in zip(self.tensors[i], self.slices[i])]
        return ParamPlan._shared(self.tensors[i], *self.slices[i])

    def __iter__(self) -> Iterator[ParamPlan]:
        shared = ParamPlan._shared
        for t, sl in zip(self.tensors, self.slices):
            yield shared(t, *sl)

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None

    def __repr__(self) -> str:
        return f"ParamPlans({len(self)} parameters)"


class _Summary(NamedTuple):
    source_ranks: tuple[int, ...]
    bytes_read: int
    bytes_written: int
    largest_slice: int


def _summarize(params: Sequence[ParamPlan]) -> _Summary:
    return _Summary(
        tuple(sorted({c.source_rank for p in params for c in p.copies})),
        sum(p.bytes_read for p in params),
        sum(p.nbytes for p in params),
        max((p.nbytes for p in params), default=0),
    )


@dataclass(slots=True)
class RankPlan:
    target_rank: int
    params: Sequence[ParamPlan] = ()
    # totals of `params`, computed once (and shared by target ranks that share `params`)
    _summary: _Summary | None = field(default=None, repr=False, compare=False)

    def _totals(self) -> _Summary:
        if self._summary is None:
            self._summary = _summarize(self.params)
        return self._summary

    @property
    def source_ranks(self) -> list[int]:
        return list(self._totals().source_ranks)

    @property
    def bytes_read(self) -> int:
        return self._totals().bytes_read

    @property
    def bytes_written(self) -> int:
        return self._totals().bytes_written

    @property
    def largest_slice(self) -> int:
        return self._totals().largest_slice

    def to_json(self) -> dict:
        return {
            "target_rank": self.target_rank,
            "source_ranks": self.source_ranks,
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "largest_slice": self.largest_slice,
            "params": [p.to_json() for p in self.params],
        }


@dataclass
class Plan:
    source: dict
    target: dict
    ranks: list[RankPlan]
    omitted: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # name -> groups of source ranks that must hold byte-identical copies of it (see Planner.identical)
    identical: dict[str, tuple[tuple[int, ...], ...]] = field(default_factory=dict)
    checks: list[str] = field(default_factory=list)  # the cross-checks that ran (CHECK_*)

    def rank(self, target_rank: int) -> RankPlan:
        for rp in self.ranks:
            if rp.target_rank == target_rank:
                return rp
        raise KeyError(target_rank)

    def _summaries(self) -> Iterator[_Summary]:
        return (rp._totals() for rp in self.ranks)

    @property
    def source_ranks(self) -> list[int]:
        distinct = {id(s): s for s in self._summaries()}  # shared by ranks with the same plan
        return sorted({r for s in distinct.values() for r in s.source_ranks})

    def to_json(self, *, lazy: bool = False) -> dict:
        """The plan as plain JSON data, in tables so that what parameters and ranks share is
        written once (a plan of 300,000 parameters on 4 target ranks is about 20 MB, not 300).
        With `lazy`, the long tables (``tensors`` and each rank's ``params``) are
        ``jsonchunks.LazyList``s, made as they are written by ``iter_json``:

        * ``tensors``: ``[name, dtype, kind, action, global_shape]``, one per parameter;
        * ``slices``: ``[target_shape, nbytes, copies]``, each copy ``[source_rank, source_box,
          target_box]`` with boxes flat (``[start0, stop0, start1, stop1, ...]``, half-open, within
          the source rank's and the target rank's own tensors);
        * ``ranks[i].params``: flat pairs ``[tensor, slice, tensor, slice, ...]`` of indices into
          those tables, in the order the target file holds the parameters.
        """
        order: list[_Tensor] = []  # the tensors table, as the objects it is made from
        tensor_ids: dict[int, int] = {}
        slices: list[list] = []
        slice_ids: dict[tuple, int] = {}
        ranks = []
        for rp in self.ranks:
            pairs = array("I")
            params = rp.params
            entries = (zip(params.tensors, params.slices) if isinstance(params, ParamPlans)
                       else ((p.tensor, (p.target_shape, p.copies, p.nbytes)) for p in params))
            for tensor, (shape, copies, nbytes) in entries:
                t = tensor_ids.get(id(tensor))
                if t is None:
                    t = tensor_ids[id(tensor)] = len(order)
                    order.append(tensor)
                key = (shape, nbytes, id(copies))
                k = slice_ids.get(key)
                if k is None:
                    k = slice_ids[key] = len(slices)
                    slices.append([list(shape), nbytes, [c.to_json() for c in copies]])
                pairs.append(t)
                pairs.append(k)
            ranks.append({"target_rank": rp.target_rank, "source_ranks": rp.source_ranks, "bytes_read": rp.bytes_read,
                          "bytes_written": rp.bytes_written, "largest_slice": rp.largest_slice,
                          "params": LazyList(pairs.__iter__) if lazy else pairs.tolist()})
        del tensor_ids, slice_ids

        def tensor_rows():
            return ([t.name, t.dtype, t.kind, t.action, list(t.global_shape)] for t in order)

        tensors = LazyList(tensor_rows) if lazy else list(tensor_rows())
        return {
            "version": PLAN_VERSION,
            "format": "ranks[].params: flat [tensor, slice, ...] index pairs into 'tensors' ([name, dtype, kind, "
                      "action, global_shape]) and 'slices' ([target_shape, nbytes, copies]); a copy is "
                      "[source_rank, source_box, target_box], boxes flat half-open ranges [start0, stop0, "
                      "start1, stop1, ...] within the source rank's and the target rank's own tensors",
            "source": self.source,
            "target": self.target,
            "tensors": tensors,
            "slices": slices,
            "ranks": ranks,
            "omitted": self.omitted,
            "notes": self.notes,
            "identical": {name: [list(g) for g in groups] for name, groups in self.identical.items()},
            "checks": self.checks,
            "totals": self.totals(),
        }

    def totals(self) -> dict:
        summaries = list(self._summaries())
        return {
            "target_ranks": len(self.ranks),
            "source_ranks_read": len(self.source_ranks),
            "bytes_read": sum(s.bytes_read for s in summaries),
            "bytes_written": sum(s.bytes_written for s in summaries),
            "largest_slice": max((s.largest_slice for s in summaries), default=0),
        }

    @staticmethod
    def from_json(obj: dict) -> "Plan":
        """A plan from its JSON form (version 3, or the per-parameter objects of version 2)."""
        if obj.get("version", 2) >= 3:
            ranks = _ranks_from_tables(obj)
        else:
            ranks = [RankPlan(r["target_rank"], tuple(
                ParamPlan(p["name"], p["dtype"], p["kind"], p["action"], p["global_shape"], p["target_shape"],
                          [Copy.from_json(c) for c in p["copies"]], _itemsize(p["dtype"], p["kind"]), p["nbytes"])
                for p in r["params"])) for r in obj["ranks"]]
        identical = {name: tuple(tuple(int(r) for r in g) for g in groups)
                     for name, groups in obj.get("identical", {}).items()}
        return Plan(obj["source"], obj["target"], ranks, obj.get("omitted", []), obj.get("notes", []),
                    identical, list(obj.get("checks", [])))


def _itemsize(dtype: str, kind: str) -> int:
    dt = dtypes.BY_NAME.get(dtype)
    return dt.itemsize if (dt is not None and dt.storage is not None and kind == "tensor") else 0


def _ranks_from_tables(obj: dict) -> list[RankPlan]:
    tensors = [_Tensor(name, dtype, kind, action, tuple(shape), _itemsize(dtype, kind))
               for name, dtype, kind, action, shape in obj["tensors"]]
    slices = [(tuple(shape), tuple(Copy.from_json(c) for c in copies), nbytes) for shape, nbytes, copies in obj["slices"]]
    ranks = []
    for r in obj["ranks"]:
        pairs = r["params"]
        params = ParamPlans(tuple(tensors[i] for i in pairs[0::2]), tuple(slices[i] for i in pairs[1::2]))
        ranks.append(RankPlan(r["target_rank"], params))
    return ranks


# ================================================================================ copy patterns


def _lcm(a: int, b: int) -> int:
    return a * b // gcd(a, b)


class Pattern(NamedTuple):
    """The copies that build one target block from one source chunk, in units.

    ``units[i]`` is the lcm of the two layouts' divisors of dimension i; multiply by
    ``global_shape[i] // units[i]`` to get elements. ``pieces`` lists (source local rank, box in the
    source rank's block, box in the target block); when the pattern needs more source ranks than
    were allowed (``limit``), it is cut short and ``complete`` is False.
    """

    units: tuple[int, ...]
    pieces: tuple[tuple[int, Box, Box], ...]
    count: int  # how many pieces the full pattern has
    complete: bool


def _ranges(src: Layout, dst: Layout, t_block: tuple[int, ...]):
    """Units, and per dimension the source blocks meeting the target block: (first, last, lo, hi,
    source unit), with [lo, hi) the target block's range in units."""
    units = tuple(_lcm(a, b) for a, b in zip(src.divisors, dst.divisors))
    per_dim = []
    for i, u in enumerate(units):
        tu = u // dst.divisors[i]
        su = u // src.divisors[i]
        lo, hi = t_block[i] * tu, (t_block[i] + 1) * tu
        per_dim.append((lo // su, (hi - 1) // su, lo, hi, su))
    return units, per_dim


def copy_pattern(src: Layout, dst: Layout, target_local: int, limit: int | None = None) -> Pattern:
    """The copies that build target local rank `target_local`'s block, in unit coordinates.

    Only the source ranks of the optimizer chunk MindSpore would read (that of source local rank
    ``target_local mod F``) are used, and only where their blocks meet the target block. Each
    block's holder in that chunk is computed from its digits (``Layout.rank_holding``): the cost
    is the number of pieces, whatever the declared device count. At most `limit` pieces are made.
    """
    return _copy_pattern(src, dst, src.chunk(target_local % src.devices),
                         dst.block(target_local % dst.devices), limit)


@lru_cache(maxsize=4096)
def _copy_pattern(src: Layout, dst: Layout, chunk: int, t_block: tuple[int, ...], limit: int | None) -> Pattern:
    units, per_dim = _ranges(src, dst, t_block)
    count = prod(last - first + 1 for first, last, *_ in per_dim)
    take = count if limit is None else min(count, limit)
    pieces = []
    ranges = [range(first, last + 1) for first, last, *_ in per_dim]
    for blocks in itertools.islice(itertools.product(*ranges), take):
        q = src.rank_holding(chunk, blocks)
        s_box, t_box = [], []
        for b, (_, _, lo, hi, su) in zip(blocks, per_dim):
            start, stop = max(lo, b * su), min(hi, (b + 1) * su)
            s_box.append((start - b * su, stop - b * su))
            t_box.append((start - lo, stop - lo))
        pieces.append((q, tuple(s_box), tuple(t_box)))
    return Pattern(units, tuple(pieces), count, take == count)


_NEEDED: dict[tuple, frozenset[int]] = {}


def needed_local_ranks(src: Layout, dst: Layout, target_local: int) -> frozenset[int]:
    """The source local ranks target local rank `target_local` reads (its copy pattern's ranks,
    without building boxes): one per source block meeting its block, in the chunk it reads.
    Small answers are remembered (strategies repeat few layout pairs); a million-rank one is not."""
    key = (src, dst, src.chunk(target_local % src.devices), dst.block(target_local % dst.devices))
    hit = _NEEDED.get(key)
    if hit is None:
        _, per_dim = _ranges(src, dst, key[3])
        ranges = [range(first, last + 1) for first, last, *_ in per_dim]
        hit = frozenset(src.rank_holding(key[2], blocks) for blocks in itertools.product(*ranges))
        if len(hit) <= 4096:
            if len(_NEEDED) >= 4096:
                _NEEDED.clear()
            _NEEDED[key] = hit
    return hit


def _scale(pattern: Pattern, global_shape: tuple[int, ...]):
    scale = [n // u for n, u in zip(global_shape, pattern.units)]
    return [
        (q, tuple((a * s, b * s) for (a, b), s in zip(sb, scale)), tuple((a * s, b * s) for (a, b), s in zip(tb, scale)))
        for q, sb, tb in pattern.pieces
    ]


# ====================================================================================== planner

# What the planner checks before any output (recorded in ``Plan.checks``, and so in the manifest).
CHECK_NAMES = "the source strategy lays out parameters the checkpoints hold"
CHECK_STAGES = "laid-out parameters are held only by ranks of the pipeline stages the strategy places them in"
CHECK_COMPLETE = "every block of a laid-out parameter is held by some source rank"
CHECK_SHAPES = "local shapes and dtypes agree on every rank, and a parameter shared by stages has one layout"
CHECK_TENSOR_SHAPE = "global shapes equal the strategy's recorded tensor_shape"
CHECK_OPTIMIZER = "optimizer states and their parameters have the same global shape"
CHECK_WHOLE = "parameters the source strategy does not lay out have one shape and dtype on every rank"
CHECK_TARGET = "target layouts divide the global shapes"
CHECK_IDENTICAL = "tensors listed in plan.identical are to be compared by content across source ranks"

REMEDY = "was source.strategy saved with these checkpoints?"


@dataclass(slots=True, eq=False)
class _ParamSource:
    """How one parameter is read, and where it goes."""

    name: str
    meta: TensorMeta | None  # None: no available file holds it (its stages' files are all missing)
    layout: Layout | None  # sharded source layout; None when the source holds it whole
    stage: int  # the source stage it is read from
    global_shape: tuple[int, ...]
    in_src: bool
    holders: tuple[int, ...] = ()  # source ranks holding it, ascending
    dst_layouts: Mapping[int, ParamLayout] | None = None  # target stage -> layout; None: not in the target strategy
    reshard: bool = True  # False: copied unchanged (pass-through)
    follows: str | None = None  # laid out like this parameter (an optimizer state the strategy leaves out)
    tensor: _Tensor | None = None  # shared by its ParamPlans
    group: int = -1  # parameters of one group are planned alike (same layouts, shape, holders)
    partial: bool = False  # laid out, but not every rank of its stages holds it (redundancy removed)

    @property
    def in_dst(self) -> bool:
        return self.dst_layouts is not None


class _Group(NamedTuple):
    """What the parameters of one group share: how they are read and where they go."""

    kind: str  # "L" laid out, "U" laid out but no file at hand, "W" whole source, "P" pass-through
    layout: Layout | None  # source layout (L, U)
    targets: tuple[tuple[int, Layout], ...] | None  # target stage -> layout; None: replicated whole


class _Body(NamedTuple):
    """A target rank's plan up to its number (shared by target ranks that read alike)."""

    params: ParamPlans
    summary: _Summary
    unavailable: frozenset[int]  # source ranks parameters without any file at hand would be read from


class Planner:
    """Builds a Plan; one instance per (source, target, available files) triple.

    Construction resolves every parameter and runs the cross-checks between the strategies and
    what the files hold (``CHECK_*``); a disagreement is a one-line ``PlanError`` before anything
    is written.
    """

    def __init__(
        self,
        src: Topology,
        dst: Topology | None,
        index: SourceIndex,
        *,
        unmapped: str = UNMAPPED_OMIT,
    ):
        if unmapped not in UNMAPPED_CHOICES:
            raise ValueError(f"unmapped must be one of {', '.join(map(repr, UNMAPPED_CHOICES))}, got {unmapped!r}")
        self.src = src
        self.dst = dst if dst is not None else Topology.unsharded()
        self.dst_given = dst is not None
        self.index = index
        self.unmapped = unmapped
        self.omitted: list[dict] = []
        self.notes: list[str] = []
        self.checks: list[str] = []
        self._check_source_ranks()
        self._stage_files = self._available_by_stage()
        self._shapes: dict[tuple, tuple] = {}  # equal shapes and boxes share one tuple
        self._groups: list[_Group] = []
        self._group_ids: dict[tuple, int] = {}
        self._stage_keys: dict[int, tuple] = {}
        self._chunks: dict[tuple[int, int], tuple[int, ...]] = {}
        self._bodies: dict[tuple, _Body] = {}
        self._copies: dict[tuple, tuple[Copy, ...]] = {}
        self._placed: set[tuple] = set()
        self._covered: set[tuple] = set()
        self._at_hand: dict[tuple[int, ...], tuple[int, int]] = {}
        self._block_holders: dict[tuple, dict] = {}
        self._target_keys: dict[tuple, tuple] = {}
        self._global_shapes: dict[tuple, tuple[Layout, tuple, ParamLayout]] = {}
        self._alike: dict[tuple[int, ...], bool] = {}  # holder set -> whether its files hold identical entries
        self._unlisted = 0  # needed source ranks left out of cut-short copy patterns
        self.params = self._resolve_params()
        for ps in self.params:
            self._finish(ps)

    # --------------------------------------------------------------------------- parameters
    def _check_source_ranks(self) -> None:
        devices = self.src.devices
        outside = [r for r in self.index if not (isinstance(r, int) and 0 <= r < devices)]
        if outside:
            raise PlanError(
                f"source rank{'s' if len(outside) > 1 else ''} {bounded_list(sorted(outside, key=str))} "
                f"lie{'' if len(outside) > 1 else 's'} outside the {devices} rank(s) the source strategy "
                f"describes (0..{devices - 1})"
            )

    def _available_by_stage(self) -> dict[int, tuple[int, ...]]:
        """Source stage -> the available source ranks of that stage, ascending."""
        out: dict[int, list[int]] = {}
        for rank in sorted(self.index):
            out.setdefault(rank // self.src.stage_devices, []).append(rank)
        return {s: tuple(v) for s, v in out.items()}

    def _holders(self) -> dict[str, tuple[int, ...]]:
        """name -> ranks holding it (ascending), in MindSpore's load order: first appearance over
        the source files in descending rank order. Equal rank sets share one tuple.

        Ranks holding the same names (all ranks of a stage, usually) are taken together, so the
        cost is one pass over the names of each distinct set, not over every rank's names.
        """
        classes: list[tuple[Mapping[str, TensorMeta], list[int]]] = []
        for rank in sorted(self.index, reverse=True):
            names = self.index[rank]
            for rep, ranks in classes:
                if len(rep) == len(names) and rep.keys() == names.keys():
                    ranks.append(rank)
                    break
            else:
                classes.append((names, [rank]))
        lists: dict[str, list[int]] = {}
        for names, ranks in classes:
            for name in names:
                got = lists.get(name)
                if got is None:
                    lists[name] = list(ranks)
                else:
                    got.extend(ranks)
        shared: dict[tuple[int, ...], tuple[int, ...]] = {}
        out = {}
        for name, ranks in lists.items():
            key = tuple(sorted(ranks))
            out[name] = shared.setdefault(key, key)
        return out

    def _resolve_params(self) -> list[_ParamSource]:
        holders = self._holders()
        self._check_names_overlap(holders)
        resolved = {name: self._source_of(name, ranks) for name, ranks in holders.items()}
        if self.src.layouts:
            self.checks += [CHECK_NAMES, CHECK_STAGES, CHECK_COMPLETE, CHECK_SHAPES]
            if any(lay.tensor_shape is not None for per in self.src.layouts.values() for lay in per.values()):
                self.checks.append(CHECK_TENSOR_SHAPE)
            self._check_optimizer_states(resolved)
        self.checks.append(CHECK_WHOLE)
        out = []
        left_out = []
        for name, ps in resolved.items():
            ps.dst_layouts = self._target_layouts(ps, resolved)
            if self.dst_given and not ps.in_dst and ps.in_src and self.unmapped != UNMAPPED_FULL:
                left_out.append(name)
                continue
            ps.reshard = self._reshards(ps)
            out.append(ps)
        if self.dst_given:
            self._check_target_network(resolved)
        self._omit(left_out)
        out.extend(self._unavailable_params(holders))
        if not out:
            raise PlanError("none of the checkpoint's parameters can be converted (all were omitted)")
        return out

    def _check_target_network(self, resolved: Mapping[str, _ParamSource]) -> None:
        """A target strategy laying out none of the checkpoints' parameters belongs to another
        network: every weight would be left out (or kept whole in the wrong layout)."""
        if not self.dst.layouts:
            return
        held = [name for name in resolved if not name.startswith(BUFFER_PREFIXES)]
        if not held:
            return
        src = f"the source strategy {shorten(self.src.source)}" if self.src.source else "the source checkpoints"
        if any(resolved[name].in_dst for name in held):
            self._check_target_needs(resolved, src)
            return
        raise PlanError(
            f"the target strategy {shorten(self.dst.source)} lays out none of the {len(held)} parameter(s) of "
            f"{src} (e.g. {quoted(held[0])}) but {len(self.dst.layouts)} others (e.g. "
            f"{quoted(next(iter(self.dst.layouts)))}): it is the strategy of another network; was target.strategy "
            "compiled for this model?"
        )

    def _check_target_needs(self, resolved: Mapping[str, _ParamSource], src: str) -> None:
        """The target strategy lays out no weight the sources lack: its network would load outputs
        missing them. Optimizer states are not counted (a target may train from weights only)."""
        lacking = [name for name in self.dst.layouts
                   if name not in resolved and name not in self.src.layouts and optimizer_base(name) is None]
        if lacking:
            raise PlanError(
                f"the target strategy {shorten(self.dst.source)} lays out {len(lacking)} parameter(s) that neither "
                f"{src} nor the checkpoints hold: {', '.join(quoted(n, 60) for n in lacking[:5])}"
                f"{', ...' if len(lacking) > 5 else ''}; the outputs would lack them (was target.strategy compiled "
                "for this model?)"
            )

    def _omit(self, left_out: list[str]) -> None:
        """Parameters the target strategy does not lay out: pipeline buffers are left out; others
        only when the user chose ``unmapped=drop``, else the plan is refused naming them."""
        chosen = self.unmapped == UNMAPPED_DROP
        others = [n for n in left_out if not n.startswith(BUFFER_PREFIXES)]
        if others and not chosen:
            raise PlanError(
                f"{len(others)} parameter(s) of {shorten(self.src.source or 'the source')} are not laid out by the "
                f"target strategy {shorten(self.dst.source)}: {', '.join(quoted(n, 60) for n in others[:5])}"
                f"{', ...' if len(others) > 5 else ''}; "
                "set target.unmapped=full to keep them as whole tensors or target.unmapped=drop to leave them out"
            )
        for name in left_out:
            buffer = name.startswith(BUFFER_PREFIXES)
            self.omitted.append({
                "name": name,
                "reason": ("a pipeline's gradient-accumulation buffer the target strategy does not lay out" if buffer
                           else "not laid out by the target strategy (target.unmapped=drop)")
                + "; unmapped=full keeps it as a whole tensor",
            })

    def _check_names_overlap(self, holders: Mapping[str, tuple[int, ...]]) -> None:
        """A source strategy none of whose parameters is in the checkpoints belongs to another
        network: every tensor would be taken whole although each rank holds a slice."""
        if not self.src.layouts or not holders or any(name in self.src.layouts for name in holders):
            return
        first_laid = next(iter(self.src.layouts))
        first_held = next(iter(holders))
        raise PlanError(
            f"none of the {len(self.src.layouts)} parameter(s) the source strategy {shorten(self.src.source)} lays "
            f"out (e.g. {quoted(first_laid)}) is in the source checkpoints, which hold {len(holders)} others "
            f"(e.g. {quoted(first_held)}); {REMEDY}"
        )

    def _source_of(self, name: str, holders: tuple[int, ...]) -> _ParamSource:
        per_stage = self.src.layouts.get(name)
        follows = None
        if per_stage is None:
            # A strategy saved with only trainable parameters (MindSpore's default) lists `w` but not
            # `adam_m.w`; the optimizer state is laid out like its parameter, as training keeps it.
            base = optimizer_base(name)
            if base is not None and base in self.src.layouts and self._same_local_shapes(name, base, holders):
                per_stage, follows = self.src.layouts[base], base
        if per_stage is None:
            return self._whole_source(name, holders)
        return self._laid_out_source(name, holders, per_stage, follows)

    def _same_local_shapes(self, name: str, base: str, holders: tuple[int, ...]) -> bool:
        return all(base in self.index[r] and self.index[r][base].shape == self.index[r][name].shape for r in holders)

    def _check_placement(self, name: str, holders: tuple[int, ...], stages: tuple[int, ...]) -> None:
        """A laid-out parameter sits only in ranks of the stages the strategy places it in
        (checked once per distinct holder set)."""
        key = (holders, stages)
        if key in self._placed:
            return
        F = self.src.stage_devices
        for g in holders:
            if g // F not in stages:
                raise PlanError(
                    f"parameter {quoted(name)} is in the checkpoint of source rank {g} (pipeline stage {g // F}), "
                    f"but the source strategy places it in stage{'s' if len(stages) > 1 else ''} "
                    f"{bounded_list(stages)} only; was source.strategy saved with these checkpoints, with the right "
                    "stage number in each per-stage file?"
                )
        self._placed.add(key)

    def _source_layout(self, rec: ParamLayout, local_shape: tuple[int, ...], name: str):
        """(layout, global shape, layout as recorded with a JSON multi-axis map folded) of a
        recorded source layout for a tensor of `local_shape`."""
        key = (rec, local_shape)
        known = self._global_shapes.get(key)
        if known is None:
            F = self.src.stage_devices
            rec = unflatten(rec, len(local_shape), stage_devices=F, local_shape=local_shape, name=name)
            layout = Layout.from_recorded(rec, len(local_shape), F, name)
            known = self._global_shapes[key] = (layout, self._intern(layout.global_shape(local_shape)), rec)
        return known

    def _laid_out_source(self, name: str, holders: tuple[int, ...], per_stage: Mapping[int, ParamLayout],
                         follows: str | None) -> _ParamSource:
        """A parameter the source strategy lays out, in one stage or (tied, e.g. an embedding shared
        by the first and last stage) in several with one layout: one global tensor, read once."""
        stages = tuple(sorted(per_stage))
        self._check_placement(name, holders, stages)
        meta = self.index[holders[0]][name]
        if meta.kind != "tensor":
            raise PlanError(f"parameter {quoted(name)}: a {meta.kind} entry cannot have a layout in the strategy")
        layout, global_shape, _ = self._source_layout(per_stage[stages[0]], meta.shape, name)
        for stage in stages[1:]:
            other, _, _ = self._source_layout(per_stage[stage], meta.shape, name)
            if other.blocks_key != layout.blocks_key:
                raise PlanError(
                    f"parameter {quoted(name)} is shared by pipeline stages {stages[0]} and {stage} with different "
                    f"layouts ({layout.describe()}; {other.describe()}); a parameter shared by stages is read once "
                    "and needs one layout"
                )
        self._check_same_everywhere(name, holders, meta, laid_out=True)
        for stage in stages:
            rec = self._source_layout(per_stage[stage], meta.shape, name)[2]
            if rec.tensor_shape is None:
                continue
            if tuple(rec.tensor_shape) != global_shape and follows is None:
                raise PlanError(
                    f"parameter {quoted(name)}: local shape {list(meta.shape)} with layout {layout.describe()} gives "
                    f"global shape {list(global_shape)}, but the strategy says {bounded_list(rec.tensor_shape)}; "
                    f"{REMEDY}"
                )
        if not dtypes.BY_NAME[meta.dtype].sliceable and layout.is_sharded:
            raise PlanError(f"parameter {quoted(name)}: {meta.dtype} tensors are packed and cannot be resharded")
        read_stage, available = self._stages_at_hand(stages)
        complete = len(holders) == available
        if not complete:  # a redundancy-removed save, or files of different saves
            self._check_coverage(name, layout, global_shape, holders, stages)
        return _ParamSource(name, meta, layout, read_stage, global_shape, True, holders, follows=follows,
                            partial=not complete)

    def _stages_at_hand(self, stages: tuple[int, ...]) -> tuple[int, int]:
        """(the lowest of `stages` with files at hand, how many files those stages have)."""
        hit = self._at_hand.get(stages)
        if hit is None:
            hit = self._at_hand[stages] = (next(s for s in stages if s in self._stage_files),
                                           sum(len(self._stage_files.get(s, ())) for s in stages))
        return hit

    def _check_coverage(self, name: str, layout: Layout, global_shape: tuple[int, ...], holders: tuple[int, ...],
                        stages: tuple[int, ...]) -> None:
        """With some ranks lacking the parameter (MindSpore's ``remove_redundancy`` keeps each
        distinct block on one rank), every block must still be held by some rank. A block no file
        holds is refused when every file of its stages is at hand (otherwise an absent file may
        hold it, and the plan names the files it needs)."""
        key = (layout, holders, stages)
        if key in self._covered:
            return
        F = self.src.stage_devices
        held = {layout.block(g % F) for g in holders}
        total = prod(layout.divisors)
        if len(held) < total and all(len(self._stage_files.get(s, ())) == F for s in stages):
            block = next(b for b in itertools.product(*(range(d) for d in layout.divisors)) if b not in held)
            would = sorted({s * F + layout.rank_holding(c, block) for s in stages for c in range(min(layout.chunks, 4))})
            raise PlanError(
                f"parameter {quoted(name)}: no source rank holds its block {_show_block(layout, block, global_shape)} "
                f"({len(held)} of its {total} blocks are held); rank{'s' if len(would) > 1 else ''} "
                f"{bounded_list(would)} should; use the files of one save, saved with this strategy"
            )
        self._covered.add(key)

    def _whole_source(self, name: str, holders: tuple[int, ...]) -> _ParamSource:
        """Not in the source strategy: every file that holds it must hold it whole."""
        meta = self.index[holders[0]][name]
        self._check_same_everywhere(name, holders, meta, laid_out=False)
        stage = self.src.stage_of_rank(holders[0])
        return _ParamSource(name, meta, None, stage, self._intern(tuple(meta.shape)), False, holders)

    def _files_alike(self, ranks: tuple[int, ...]) -> bool:
        """Whether these ranks' files hold the same names with the same dtype, shape and size
        each (replicas, usually): then no parameter needs comparing rank by rank."""
        alike = self._alike.get(ranks)
        if alike is None:
            first = self.index[ranks[0]]
            same = getattr(first, "same_entries", None)
            alike = self._alike[ranks] = same is not None and all(same(self.index[r]) for r in ranks[1:])
        return alike

    def _check_same_everywhere(self, name: str, ranks: Sequence[int], meta: TensorMeta, *, laid_out: bool) -> None:
        if len(ranks) < 2 or type(ranks) is tuple and self._files_alike(ranks):
            return
        index = self.index
        metas = [index[r][name] for r in ranks]
        if metas.count(meta) == len(metas):
            return
        for r in ranks:
            other = self.index[r][name]
            if other == meta:
                continue
            if other.dtype != meta.dtype:
                raise PlanError(
                    f"parameter {quoted(name)}: dtype differs across source ranks ({meta.dtype} in rank {ranks[0]}, "
                    f"{other.dtype} in rank {r})"
                )
            if other.shape != meta.shape:
                hint = ("uneven slices are not supported" if laid_out else
                        f"the source strategy does not lay it out, so every rank should hold it whole; {REMEDY}")
                raise PlanError(
                    f"parameter {quoted(name)}: shape differs across source ranks ({bounded_list(meta.shape)} in rank "
                    f"{ranks[0]}, {bounded_list(other.shape)} in rank {r}); {hint}"
                )

    def _check_optimizer_states(self, resolved: Mapping[str, _ParamSource]) -> None:
        """An optimizer state holds a tensor of its parameter's shape. Where the strategy lays out
        both, their global shapes must agree: optimizer-shard fields missing from (or added to) one
        of them make a rank's slice look like a different share of the tensor."""
        self.checks.append(CHECK_OPTIMIZER)
        for name, ps in resolved.items():
            base = optimizer_base(name)
            if base is None or not ps.in_src or ps.follows is not None:
                continue
            param = resolved.get(base)
            if (param is None or not param.in_src or param.global_shape == ps.global_shape
                    or param.layout.divisors == ps.layout.divisors):
                continue  # (same partitioning but other shapes: the files disagree, not the strategy)
            raise PlanError(
                f"parameter {quoted(base)}: its layout ({param.layout.describe()}) makes local "
                f"{list(param.meta.shape)} a slice of {list(param.global_shape)}, but its optimizer state "
                f"{quoted(name)} ({ps.layout.describe()}) makes local {list(ps.meta.shape)} a slice of "
                f"{list(ps.global_shape)}; their optimizer-shard fields disagree ({REMEDY})"
            )

    def _target_layouts(self, ps: _ParamSource, resolved: Mapping[str, _ParamSource]) -> Mapping | None:
        """Target stage -> recorded layout of the parameter, or None when the target strategy does
        not lay it out.

        A target strategy saved with trainable parameters only (it lays out no optimizer state at
        all) leaves optimizer states to follow their parameters, as training does. One that lists
        some optimizer states means the ones it leaves out (pipeline ``accu_grads.*`` for a target
        without pipeline) are not part of the target.
        """
        if not self.dst_given:
            return None
        own = self.dst.layouts.get(ps.name)
        if own is not None or self._dst_lists_optimizer_states:
            return own
        base = optimizer_base(ps.name)
        param = resolved.get(base) if base is not None else None
        if param is not None and base in self.dst.layouts and param.global_shape == ps.global_shape:
            return self.dst.layouts[base]
        return None

    @cached_property
    def _dst_lists_optimizer_states(self) -> bool:
        return any(optimizer_base(name) is not None for name in self.dst.layouts)

    def _reshards(self, ps: _ParamSource) -> bool:
        if ps.in_src:
            return True
        # not in the source strategy: whole tensors; without a target strategy MindSpore copies them
        reshard = self.dst_given and ps.in_dst
        if reshard and not (ps.meta.kind == "tensor" and dtypes.BY_NAME[ps.meta.dtype].sliceable):
            raise PlanError(f"parameter {quoted(ps.name)}: a {ps.meta.dtype} entry cannot be laid out by the "
                            "target strategy")
        return reshard

    def _unavailable_params(self, holders: Mapping[str, tuple[int, ...]]) -> list[_ParamSource]:
        """Strategy parameters none of whose stages has an available file: we cannot see their
        shapes, but we can still tell which ranks would be read, to report them missing."""
        out = []
        for name, per_stage in self.src.layouts.items():
            if name in holders or any(s in self._stage_files for s in per_stage):
                continue
            if self.dst_given and name not in self.dst and self.unmapped != UNMAPPED_FULL:
                continue
            stage = min(per_stage)
            rec = per_stage[stage]
            dst_layouts = self.dst.layouts.get(name) if self.dst_given else None
            ndim = common_ndim([rec, *(dst_layouts or {}).values()])
            layout = Layout.from_recorded(rec, ndim, self.src.stage_devices, name)
            out.append(_ParamSource(name, None, layout, stage, layout.divisors, True, (), dst_layouts))
        return out

    def _intern(self, value: tuple) -> tuple:
        return self._shapes.setdefault(value, value)

    def _finish(self, ps: _ParamSource) -> None:
        """Give a resolved parameter its shared per-parameter facts and its group."""
        targets = self._targets(ps)
        if ps.meta is None:
            key = ("U", ps.layout, ps.stage, ps.global_shape, targets)
        elif not ps.reshard:
            dt = dtypes.BY_NAME.get(ps.meta.dtype)
            itemsize = dt.itemsize if (ps.meta.kind == "tensor" and dt is not None and dt.storage is not None) else 0
            ps.tensor = _Tensor(ps.name, ps.meta.dtype, ps.meta.kind, ACTION_COPY, ps.global_shape, itemsize)
            key = ("P", None, ps.holders, ps.global_shape, ps.meta.nbytes)
        else:
            action = ACTION_RESHARD if (ps.in_dst or not self.dst_given) else ACTION_FULL
            itemsize = dtypes.BY_NAME[ps.meta.dtype].itemsize
            ps.tensor = _Tensor(ps.name, ps.meta.dtype, "tensor", action, ps.global_shape, itemsize)
            if ps.layout is not None:
                key = ("L", ps.layout, ps.stage, ps.global_shape, itemsize, targets, ps.holders if ps.partial else None)
            else:
                key = ("W", None, ps.holders, ps.global_shape, itemsize, targets)
        gid = self._group_ids.get(key)
        if gid is None:
            gid = self._group_ids[key] = len(self._groups)
            self._groups.append(_Group(key[0], ps.layout if key[0] in "LU" else None, targets))
        ps.group = gid

    def _targets(self, ps: _ParamSource) -> tuple[tuple[int, Layout], ...] | None:
        """The parameter's target layouts by target stage; None when it is replicated whole.
        Parameters with equal recorded layouts share one result."""
        if ps.dst_layouts is None or (ps.meta is not None and not ps.reshard):
            return None
        ndim = len(ps.global_shape)
        # parameters laid out alike share one mapping (Topology); folding a JSON map needs the shape
        key = (id(ps.dst_layouts), ndim)
        hit = self._target_keys.get(key)
        if hit is None and any(len(rec.tensor_map) != ndim and is_flattened(rec) for rec in ps.dst_layouts.values()):
            key = (id(ps.dst_layouts), ndim, ps.global_shape)
            hit = self._target_keys.get(key)
        if hit is None:
            T = self.dst.stage_devices
            hit = self._target_keys[key] = tuple(
                (stage, Layout.from_recorded(unflatten(rec, ndim, stage_devices=T, global_shape=ps.global_shape,
                                                       name=ps.name), ndim, T, ps.name))
                for stage, rec in sorted(ps.dst_layouts.items()))
        return hit

    # --------------------------------------------------------------------------- per rank
    def target_ranks(self) -> list[int]:
        return list(range(self.dst.devices))

    def plan_rank(self, target_rank: int, missing: dict[int, list[int]] | None = None) -> RankPlan:
        if not (isinstance(target_rank, int) and 0 <= target_rank < self.dst.devices):
            raise PlanError(f"target rank {shorten(target_rank, 40)} is outside 0..{self.dst.devices - 1}")
        t_stage, r = divmod(target_rank, self.dst.stage_devices)
        key = self._rank_key(t_stage, r)
        body = self._bodies.get(key)
        if body is None:
            body = self._bodies[key] = self._make_body(t_stage, r)
        if missing is not None:
            for src_rank in body.summary.source_ranks:
                if src_rank not in self.index:
                    missing.setdefault(src_rank, []).append(target_rank)
            for src_rank in body.unavailable:
                missing.setdefault(src_rank, []).append(target_rank)
        return RankPlan(target_rank, body.params, body.summary)

    def _rank_key(self, t_stage: int, r: int) -> tuple:
        """What a target rank's plan depends on besides its stage: its block in each distinct
        target layout, the source optimizer chunk it reads in each distinct source layout, and
        (for whole tensors) its local rank modulo the source stage size."""
        layouts = self._stage_keys.get(t_stage)
        if layouts is None:
            layouts = self._stage_keys[t_stage] = self._stage_layouts(t_stage)
        targets, sources, by_rho = layouts
        rho = r % self.src.stage_devices
        chunks = self._chunks.get((t_stage, rho))
        if chunks is None:
            chunks = self._chunks[(t_stage, rho)] = tuple(s.chunk(rho) for s in sources)
        return t_stage, tuple(t.block(r % t.devices) for t in targets), chunks, rho if by_rho else None

    def _stage_layouts(self, t_stage: int) -> tuple[tuple[Layout, ...], tuple[Layout, ...], bool]:
        targets: dict[Layout, None] = {}
        sources: dict[Layout, None] = {}
        by_rho = False
        for g in self._groups:
            if g.targets is not None:
                t = dict(g.targets).get(t_stage)
                if t is None:
                    continue  # lives in other target stages
                targets[t] = None
            if g.layout is not None:
                sources[g.layout] = None
            else:
                by_rho = True
        return tuple(targets), tuple(sources), by_rho

    def _make_body(self, t_stage: int, r: int) -> _Body:
        rho = r % self.src.stage_devices
        results: list = [None] * len(self._groups)
        tensors: list[_Tensor] = []
        slices: list[tuple] = []
        copied: list[tuple[_Tensor, tuple]] = []  # pass-through parameters come last, as in MindSpore
        unavailable: set[int] = set()
        sources: set[int] = set()
        read = written = largest = 0
        for ps in self.params:
            if ps.dst_layouts is not None and t_stage not in ps.dst_layouts:
                continue  # lives in another target pipeline stage
            res = results[ps.group]
            if res is None:
                res = results[ps.group] = self._group_result(ps, t_stage, r, rho)
                if ps.meta is not None:
                    sources.update(c.source_rank for c in res[0][1])
            if ps.meta is None:
                unavailable.update(res)
                continue
            slice_, bytes_read = res
            if ps.reshard:
                tensors.append(ps.tensor)
                slices.append(slice_)
            else:
                copied.append((ps.tensor, slice_))
            nbytes = slice_[2]
            read += bytes_read
            written += nbytes
            if nbytes > largest:
                largest = nbytes
        for tensor, slice_ in copied:
            tensors.append(tensor)
            slices.append(slice_)
        params = ParamPlans(tuple(tensors), tuple(slices))
        return _Body(params, _Summary(tuple(sorted(sources)), read, written, largest), frozenset(unavailable))

    def _group_result(self, ps: _ParamSource, t_stage: int, r: int, rho: int):
        """What every parameter of ps's group gets on target local rank r: ((target shape, copies,
        bytes written), bytes read); for parameters without any file at hand, the source ranks
        they would be read from."""
        res = self._group_plan(ps, t_stage, r, rho)
        if ps.meta is None:
            return res
        _, copies, nbytes = res
        itemsize = ps.tensor.itemsize
        return res, (sum(box_size(c.source_box) for c in copies) * itemsize if itemsize else nbytes)

    def _target_layout(self, ps: _ParamSource, t_stage: int) -> Layout:
        targets = self._groups[ps.group].targets
        if targets is not None:
            return dict(targets)[t_stage]
        return Layout.replicated(len(ps.global_shape), self.dst.stage_devices)

    def _group_plan(self, ps: _ParamSource, t_stage: int, r: int, rho: int):
        """(target shape, copies, bytes) of the parameters of ps's group on target local rank r;
        for parameters without any file at hand, the source ranks they would be read from."""
        F = self.src.stage_devices
        if ps.meta is None:
            pattern = copy_pattern(ps.layout, self._target_layout(ps, t_stage), r, MISSING_SAMPLE)
            self._unlisted += pattern.count - len(pattern.pieces)
            return {ps.stage * F + q for q, _, _ in pattern.pieces}
        if not ps.reshard:
            holder = self._holder(ps, rho)
            box = self._intern(full_box(ps.meta.shape))
            return ps.global_shape, (Copy(holder, box, box),), ps.meta.nbytes
        t_layout = self._target_layout(ps, t_stage)
        t_layout.check_shape(ps.global_shape, ps.name)
        t_shape = self._intern(t_layout.local_shape(ps.global_shape))
        nbytes = prod(t_shape) * ps.tensor.itemsize
        if ps.layout is None:  # the whole tensor sits in one file: cut the target's box out of it
            t_box = self._intern(t_layout.box(r % t_layout.devices, ps.global_shape))
            return t_shape, (Copy(self._holder(ps, rho), t_box, self._intern(full_box(t_shape))),), nbytes
        copies = self._laid_out_copies(ps, t_layout, r)
        if ps.partial:
            copies = self._from_holders(ps, copies)
        return t_shape, copies, nbytes

    def _laid_out_copies(self, ps: _ParamSource, t_layout: Layout, r: int) -> tuple[Copy, ...]:
        F = self.src.stage_devices
        chunk = ps.layout.chunk(r % F)
        t_block = t_layout.block(r % t_layout.devices)
        key = (ps.layout, t_layout, chunk, t_block, ps.global_shape, ps.stage)
        copies = self._copies.get(key)
        if copies is not None:
            return copies
        # A chunk needing more source ranks than the stage has files cannot be complete: list a
        # sample of the missing ones rather than every rank a strategy may declare.
        limit = len(self._stage_files.get(ps.stage, ())) + MISSING_SAMPLE
        pattern = _copy_pattern(ps.layout, t_layout, chunk, t_block, limit)
        self._unlisted += pattern.count - len(pattern.pieces)
        base = ps.stage * F
        copies = tuple(Copy(base + q, self._intern(sb), self._intern(tb)) for q, sb, tb in _scale(pattern, ps.global_shape))
        if len(self._copies) > 200_000:  # many distinct shapes: keep the cache bounded
            self._copies.clear()
        self._copies[key] = copies
        return copies

    def _from_holders(self, ps: _ParamSource, copies: tuple[Copy, ...]) -> tuple[Copy, ...]:
        """Copies of a parameter some ranks lack: a copy from a rank whose file lacks it is taken
        from another rank holding the same block (of the same stage first, then the lowest), with
        the same boxes. Copies from ranks that hold it (MindSpore's replica) stay, and so do those
        from absent files (the plan names them missing)."""
        F = self.src.stage_devices
        key = (ps.layout, ps.holders)
        by_block = self._block_holders.get(key)
        if by_block is None:
            by_block = self._block_holders[key] = {}
            for g in ps.holders:
                by_block.setdefault(ps.layout.block(g % F), []).append(g)
        held = set(ps.holders)
        out = []
        for c in copies:
            g = c.source_rank
            if g in held or g not in self.index:
                out.append(c)
                continue
            block = ps.layout.block(g % F)
            others = by_block.get(block)
            if not others:
                raise PlanError(
                    f"parameter {quoted(ps.name)}: no source file at hand holds its block "
                    f"{_show_block(ps.layout, block, ps.global_shape)} (rank {g} lacks it, and the ranks that may "
                    "hold it are not among the files given)"
                )
            same_stage = [o for o in others if o // F == g // F]
            out.append(Copy((same_stage or others)[0], c.source_box, c.target_box))
        return tuple(out)

    def _holder(self, ps: _ParamSource, rho: int) -> int:
        """The file a whole (unsharded) parameter is taken from: local rank rho of the lowest stage
        holding it, else the lowest rank holding it."""
        F = self.src.stage_devices
        return next((g for g in ps.holders if g % F == rho), ps.holders[0])

    # --------------------------------------------------------------------------- identical
    def identical(self, read: set[int]) -> dict[str, tuple[tuple[int, ...], ...]]:
        """Which tensors must be byte-identical across which of the source ranks read.

        Ranks that the source strategy says hold the same block of a parameter (its replicas), and
        every rank holding a parameter the strategy does not lay out (each holds it whole), must
        hold the same bytes. A strategy that does not describe the files breaks exactly that: a
        rank-local slice taken for a whole tensor, or replicas that are not. Comparing is I/O, so
        the plan lists the groups and the job hashes them; only ranks the plan reads are listed,
        since the job hashes those files anyway.
        """
        F = self.src.stage_devices
        out: dict[str, tuple[tuple[int, ...], ...]] = {}
        members_of: dict[tuple[int, ...], tuple[int, ...]] = {}
        groups_of: dict[tuple, tuple[tuple[int, ...], ...]] = {}
        for ps in self.params:
            if ps.meta is None or ps.meta.kind != "tensor" or len(ps.holders) < 2:
                continue
            members = members_of.get(ps.holders)
            if members is None:
                members = members_of[ps.holders] = tuple(g for g in ps.holders if g in read)
            if len(members) < 2:
                continue
            if ps.layout is None:
                groups = groups_of.setdefault((members,), (members,))
            else:
                gkey = (ps.layout, members)
                groups = groups_of.get(gkey)
                if groups is None:
                    by_block: dict[tuple[int, ...], list[int]] = {}
                    for g in members:
                        by_block.setdefault(ps.layout.block(g % F), []).append(g)
                    groups = tuple(tuple(v) for v in by_block.values() if len(v) > 1)
                    groups_of[gkey] = groups
            if groups:
                out[ps.name] = groups
        return out

    def plan(self, target_ranks: Iterable[int] | None = None, *, missing: dict[int, list[int]] | None = None) -> Plan:
        """Plan the given target ranks (default all).

        A needed source file that is absent raises MissingRankError (listing every missing rank and
        the target ranks that need it), unless a `missing` dict is passed to collect them instead.
        """
        ranks = self.target_ranks() if target_ranks is None else list(target_ranks)
        collect = missing is not None
        missing = {} if missing is None else missing
        rank_plans = [self.plan_rank(g, missing) for g in ranks]
        for k in list(missing):
            missing[k] = sorted(set(missing[k]))
        notes = list(self.notes)
        if self._unlisted:
            notes.append(f"{self._unlisted} more source rank(s) needed by some target ranks are missing too "
                         "(not listed: the source strategy declares more ranks than there are files)")
        if missing and not collect:
            raise MissingRankError(missing)
        checks = list(self.checks) + [CHECK_TARGET]
        read = {r for body in self._bodies.values() for r in body.summary.source_ranks}
        identical = self.identical(read)
        if identical:
            checks.append(CHECK_IDENTICAL)
        return Plan(
            source={"devices": self.src.devices, "stage_devices": self.src.stage_devices,
                    "stages": self.src.num_stages, "strategy": self.src.source},
            target={"devices": self.dst.devices, "stage_devices": self.dst.stage_devices,
                    "stages": self.dst.num_stages, "strategy": self.dst.source if self.dst_given else None},
            ranks=rank_plans,
            omitted=list(self.omitted),
            notes=notes,
            identical=identical,
            checks=checks,
        )


def _show_block(layout: Layout, block: tuple[int, ...], global_shape: tuple[int, ...]) -> str:
    """A block as element ranges of the global tensor: ``[0:8, 16:32]``."""
    parts = []
    for b, n, d in zip(block, global_shape, layout.divisors):
        unit = n // d
        parts.append(f"{b * unit}:{(b + 1) * unit}")
    return shorten("[" + ", ".join(parts) + "]", 120)


def identical_mismatch(name: str, ranks: Iterable[int], strategy: str | None = None) -> PlanError:
    """The error for a tensor of ``Plan.identical`` whose bytes differ across the given ranks."""
    ranks = sorted(ranks)
    where = f" {shorten(strategy)}" if strategy else ""
    return PlanError(
        f"parameter {quoted(name)} differs between source ranks {rank_ranges(ranks, ', ')}, which the source "
        f"strategy{where} says hold the same data (replicas of one block, or a tensor it does not lay out and "
        f"so every rank holds whole); {REMEDY}"
    )


def source_ranks_for(src: Topology, dst: Topology | None, target_rank: int, *,
                     unmapped: str = UNMAPPED_OMIT) -> list[int]:
    """The source ranks a plan reads for one target rank, from the strategies alone.

    Shapes do not matter (a copy pattern only depends on the two layouts), so every strategy
    parameter is planned on its unit shape. Parameters outside the source strategy (copied, or
    whole tensors such as ``global_step``) are read from source local rank ``r mod F`` of the
    lowest stage holding them, so that rank of stage 0 and of every stage read from is included
    (MindSpore's list holds it for every source stage): given only these files, the plan takes
    such parameters from the same file as with all files at hand.
    """
    dst_t = dst if dst is not None else Topology.unsharded()
    T, F = dst_t.stage_devices, src.stage_devices
    if not isinstance(target_rank, int) or target_rank < 0 or (dst is not None and target_rank >= dst_t.devices):
        raise PlanError(f"target rank {shorten(target_rank, 40)} is outside 0..{dst_t.devices - 1}")
    if dst is None:
        # MindSpore takes `rank_id` itself as the local rank when there is no target strategy
        # (one whole checkpoint): the list is that of the replicas source rank `rank_id mod F`
        # reads. Kept so our list stays a subset of MindSpore's for any rank_id.
        t_stage, r = 0, target_rank
    else:
        t_stage, r = divmod(target_rank, T)
    needed = {r % F}
    for name, per_stage in src.layouts.items():
        if dst is not None:
            if name not in dst:
                if unmapped != UNMAPPED_FULL:
                    continue
                t_layout = None
            elif t_stage not in dst.stages_of(name):
                continue
            else:
                t_layout = dst.layout(name, t_stage)
        else:
            t_layout = None
        stage = min(per_stage)
        rec = per_stage[stage]
        ndim = common_ndim([rec] if t_layout is None else [rec, t_layout])
        s = Layout.from_recorded(rec, ndim, F, name)
        t = Layout.from_recorded(t_layout, ndim, T, name) if t_layout is not None else Layout.replicated(ndim, T)
        needed.update(stage * F + q for q in needed_local_ranks(s, t, r))
        needed.add(stage * F + r % F)
    return sorted(needed, reverse=True)
