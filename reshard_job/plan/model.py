"""The plan as plain data: per target rank and parameter, the copies that fill it; and its JSON.

A ``Plan`` is what ``job.mode=plan`` prints, what the executor runs, and what lineage records as
the rank map. Memory per parameter and target rank is one small ``ParamPlan`` (three references
and a size): what parameters share is shared (their per-parameter facts, ``TensorFacts``; shapes;
copy tuples), and target ranks whose plans are the same up to their number share one
``ParamPlans``. The JSON form keeps that sharing in tables (``Plan.to_json``).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Mapping, NamedTuple, Sequence

import reshard_job.core.dtypes as dtypes
from reshard_job.core.boxes import Box, box_size
from reshard_job.core.layout import Layout
from reshard_job.core.strategy_model import ParamLayout
from reshard_job.core.tensor_meta import TensorMeta
from reshard_job.jsonchunks import LazyList

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

# Who counts a target tensor's bytes once in the outputs' fingerprints (``Place.counted``, matched
# against ``RankPlan.counting``): every rank writing it, none, the stage's local rank 0, or (a
# value k >= 0) the first local rank holding each block of the stage's k-th distinct target layout.
COUNTED_ALWAYS = -1
COUNTED_NEVER = -2
COUNTED_FIRST = -3


class Place(NamedTuple):
    """Where a target rank's tensor lies in the global tensor, and which of the ranks holding that
    box counts it (so that the boxes counted over all target ranks cover every element once)."""

    origin: tuple[int, ...]  # global coordinates of the target tensor's first element
    counted: int  # COUNTED_* or a target layout's number in its stage


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
class TensorFacts:
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
    live in a shared ``TensorFacts`` and are read through properties.
    """

    __slots__ = ("tensor", "target_shape", "copies", "nbytes", "place")

    def __init__(self, name: str, dtype: str, kind: str, action: str, global_shape: Sequence[int],
                 target_shape: Sequence[int], copies: Iterable[Copy], itemsize: int = 0, nbytes: int = 0,
                 place: Place | None = None):
        self.tensor = TensorFacts(name, dtype, kind, action, tuple(global_shape), itemsize)
        self.target_shape = tuple(target_shape)
        self.copies = tuple(copies)
        self.nbytes = nbytes  # bytes of the target tensor
        self.place = place  # None: not known (a plan read from JSON)

    @classmethod
    def _shared(cls, tensor: TensorFacts, target_shape: tuple[int, ...], copies: tuple[Copy, ...],
                nbytes: int, place: Place | None = None) -> "ParamPlan":
        plan = cls.__new__(cls)
        plan.tensor, plan.target_shape, plan.copies, plan.nbytes, plan.place = \
            tensor, target_shape, copies, nbytes, place
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
    ``TensorFacts`` and their (target shape, copies, nbytes[, place]) slices): 16 bytes per parameter
    instead of an object each. ``ParamPlan`` views are made on access."""

    __slots__ = ("tensors", "slices")

    def __init__(self, tensors: tuple[TensorFacts, ...], slices: tuple[tuple, ...]):
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


class RankSummary(NamedTuple):
    source_ranks: tuple[int, ...]
    bytes_read: int
    bytes_written: int
    largest_slice: int


def _summarize(params: Sequence[ParamPlan]) -> RankSummary:
    return RankSummary(
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
    _summary: RankSummary | None = field(default=None, repr=False, compare=False)
    # the ``Place.counted`` values this rank counts (None: not known, its tensors' places neither)
    counting: frozenset[int] | None = field(default=None, repr=False, compare=False)

    def counts(self, place: Place | None) -> bool:
        """Whether this rank's copy of a tensor at `place` is the one the fingerprints count."""
        return place is not None and self.counting is not None and place.counted in self.counting

    def _totals(self) -> RankSummary:
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
    # target.include/exclude/rename in effect and what they left out (``plan.selection``); None: none
    selection: dict | None = None
    # optimizer states the target strategy lays out and no source holds: the outputs lack them
    target_only: list[str] = field(default_factory=list)

    def rank(self, target_rank: int) -> RankPlan:
        for rp in self.ranks:
            if rp.target_rank == target_rank:
                return rp
        raise KeyError(target_rank)

    def _summaries(self) -> Iterator[RankSummary]:
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
        order, slices, ranks = _rank_tables(self.ranks, lazy)

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
            **({"selection": self.selection} if self.selection is not None else {}),
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
    tensors = [TensorFacts(name, dtype, kind, action, tuple(shape), _itemsize(dtype, kind))
               for name, dtype, kind, action, shape in obj["tensors"]]
    slices = [(tuple(shape), tuple(Copy.from_json(c) for c in copies), nbytes) for shape, nbytes, copies in obj["slices"]]
    ranks = []
    for r in obj["ranks"]:
        pairs = r["params"]
        params = ParamPlans(tuple(tensors[i] for i in pairs[0::2]), tuple(slices[i] for i in pairs[1::2]))
        ranks.append(RankPlan(r["target_rank"], params))
    return ranks


def _rank_tables(rank_plans: Sequence[RankPlan], lazy: bool) -> tuple[list[TensorFacts], list[list], list[dict]]:
    """The tables of ``Plan.to_json``: the tensors (as the objects the table is made from), the
    slices, and each rank's entry with its flat [tensor, slice, ...] index pairs."""
    order: list[TensorFacts] = []
    tensor_ids = _TensorIds(order)
    slices: list[list] = []
    slice_ids: dict[tuple, int] = {}
    ranks = []
    for rp in rank_plans:
        pairs = array("I")
        params = rp.params
        tables = isinstance(params, ParamPlans)
        entries = zip(params.tensors, params.slices) if tables else (
            (p.tensor, (p.target_shape, p.copies, p.nbytes)) for p in params)
        numbers = tensor_ids.of_table(params.tensors) if tables else map(tensor_ids.of, (p.tensor for p in params))
        for t, (tensor, (shape, copies, nbytes, *_)) in zip(numbers, entries):
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
    return order, slices, ranks


class _TensorIds:
    """Each tensor's number in the plan's table of tensors (`order`, filled as tensors come). Ranks
    of a stage share one table of their tensors (``ParamPlans.tensors``): the first such table is
    numbered by position, and a map by identity is built only once another table comes (for
    600,000 parameters on one rank it was 60 MB the process kept)."""

    def __init__(self, order: list):
        self.order = order
        self.tables: dict[int, tuple[tuple, range]] = {}  # id(table) -> (the table, its numbers)
        self.ids: dict[int, int] | None = None

    def of_table(self, tensors: tuple):
        known = self.tables.get(id(tensors))
        if known is not None:
            return known[1]
        if not self.order:
            self.order.extend(tensors)
            numbers = range(len(tensors))
            self.tables[id(tensors)] = (tensors, numbers)  # (kept: its id stays its own)
            return numbers
        return map(self.of, tensors)

    def of(self, tensor) -> int:
        if self.ids is None:
            self.ids = {id(t): i for i, t in enumerate(self.order)}
        t = self.ids.get(id(tensor))
        if t is None:
            t = self.ids[id(tensor)] = len(self.order)
            self.order.append(tensor)
        return t


# ------------------------------------------------------------------ phase 1's records (plan.resolve)


@dataclass(slots=True, eq=False)
class ParamSource:
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
    tensor: TensorFacts | None = None  # shared by its ParamPlans (given in phase 2)
    group: int = -1  # parameters of one group are planned alike (same layouts, shape, holders)
    partial: bool = False  # laid out, but not every rank of its stages holds it (redundancy removed)

    @property
    def in_dst(self) -> bool:
        return self.dst_layouts is not None
