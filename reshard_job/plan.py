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
* **Parameters in the source strategy but not in the target one** (pipeline ``accu_grads.*``):
  MindSpore copies the source slice unchanged, which does not fit the target layout. We leave them
  out and list them in ``plan.omitted``; ``unmapped="full"`` keeps them as full tensors instead.
* **Parameters in the target strategy but not in the source one** are taken as whole tensors (as
  when no source strategy is given) and cut for the target; MindSpore copies them unchanged.
* **Parameters in neither strategy** (``global_step``, ``learning_rate``) are copied unchanged from
  source local rank ``r mod F`` of the lowest stage holding them, as MindSpore does.
* **Optimizer states a strategy leaves out** (MindSpore records trainable parameters only by
  default) are laid out like their parameter (``adam_m.w`` like ``w``), in the source when their
  local shapes match the parameter's, in the target when it lists no optimizer state at all.
  MindSpore copies them unchanged, which gives the target the source's slice shape.

Trust: a source strategy that does not describe the checkpoints must never plan into a wrong
checkpoint (MindSpore then writes wrong shapes and exits normally). The planner cross-checks what
it can see in the index before any output (``CHECK_*``, recorded in ``Plan.checks``): the
strategy lays out names the files hold; every laid-out parameter sits in the ranks of the stages
the strategy places it in, on every available rank of them, with one shape per stage and one
global shape across stages (and the JSON ``tensor_shape``); a parameter and its optimizer states
have the same global shape. What only the bytes can show is left to the job as plain data:
``Plan.identical`` lists, per tensor, groups of source ranks read that must hold identical bytes
(replicas of one block, and every holder of a tensor the strategy does not lay out, which is how
a rank-local slice taken for a whole tensor is caught). A wrong strategy that agrees with all of
this (each rank holding a distinct block of the right shape, only permuted) cannot be told from
the files alone.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from functools import cached_property
from math import gcd, prod
from typing import Iterable, Mapping

from .errors import LayoutError, MissingRankError, PlanError
from .formats import dtypes
from .formats.boxes import Box, box_size, full_box
from .formats.strategy import ParamLayout
from .layout import Layout
from .text import bounded_list, quoted, rank_ranges, shorten
from .topology import Topology, optimizer_base

ACTION_RESHARD = "reshard"
ACTION_COPY = "copy"
ACTION_FULL = "full"

UNMAPPED_OMIT = "omit"
UNMAPPED_FULL = "full"

PLAN_VERSION = 3


@dataclass(frozen=True)
class TensorMeta:
    """What a source file holds under one name."""

    dtype: str
    shape: tuple[int, ...]
    kind: str = "tensor"  # tensor | str | map
    nbytes: int = 0


SourceIndex = Mapping[int, Mapping[str, TensorMeta]]  # global source rank -> name -> meta


@dataclass(frozen=True)
class Copy:
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


@dataclass
class ParamPlan:
    name: str
    dtype: str
    kind: str
    action: str
    global_shape: tuple[int, ...]
    target_shape: tuple[int, ...]
    copies: list[Copy]
    itemsize: int = 0  # 0 for str/map/packed entries (their nbytes is used instead)
    nbytes: int = 0  # bytes of the target tensor

    @property
    def bytes_read(self) -> int:
        if not self.itemsize:
            return self.nbytes
        return sum(box_size(c.source_box) for c in self.copies) * self.itemsize

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


@dataclass
class RankPlan:
    target_rank: int
    params: list[ParamPlan] = field(default_factory=list)

    @property
    def source_ranks(self) -> list[int]:
        return sorted({c.source_rank for p in self.params for c in p.copies})

    @property
    def bytes_read(self) -> int:
        return sum(p.bytes_read for p in self.params)

    @property
    def bytes_written(self) -> int:
        return sum(p.nbytes for p in self.params)

    @property
    def largest_slice(self) -> int:
        return max((p.nbytes for p in self.params), default=0)

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

    @property
    def source_ranks(self) -> list[int]:
        return sorted({r for rp in self.ranks for r in rp.source_ranks})

    def to_json(self) -> dict:
        return {
            "version": PLAN_VERSION,
            "copy_format": "[source_rank, source_box, target_box]; boxes are flat half-open ranges "
                           "[start0, stop0, start1, stop1, ...] within the source rank's and the target "
                           "rank's own tensors",
            "source": self.source,
            "target": self.target,
            "ranks": [rp.to_json() for rp in self.ranks],
            "omitted": self.omitted,
            "notes": self.notes,
            "identical": {name: [list(g) for g in groups] for name, groups in self.identical.items()},
            "checks": self.checks,
            "totals": self.totals(),
        }

    def totals(self) -> dict:
        return {
            "target_ranks": len(self.ranks),
            "source_ranks_read": len(self.source_ranks),
            "bytes_read": sum(rp.bytes_read for rp in self.ranks),
            "bytes_written": sum(rp.bytes_written for rp in self.ranks),
            "largest_slice": max((rp.largest_slice for rp in self.ranks), default=0),
        }

    @staticmethod
    def from_json(obj: dict) -> "Plan":
        ranks = []
        for r in obj["ranks"]:
            params = []
            for p in r["params"]:
                dt = dtypes.BY_NAME.get(p["dtype"])
                itemsize = dt.itemsize if (dt is not None and dt.storage is not None and p["kind"] == "tensor") else 0
                params.append(
                    ParamPlan(
                        p["name"], p["dtype"], p["kind"], p["action"], tuple(p["global_shape"]),
                        tuple(p["target_shape"]),
                        [Copy.from_json(c) for c in p["copies"]],
                        itemsize, p["nbytes"],
                    )
                )
            ranks.append(RankPlan(r["target_rank"], params))
        identical = {name: tuple(tuple(int(r) for r in g) for g in groups)
                     for name, groups in obj.get("identical", {}).items()}  # absent before version 3
        return Plan(obj["source"], obj["target"], ranks, obj.get("omitted", []), obj.get("notes", []),
                    identical, list(obj.get("checks", [])))


# ================================================================================ copy patterns


def _lcm(a: int, b: int) -> int:
    return a * b // gcd(a, b)


_PATTERN_CACHE: dict = {}


def copy_pattern(src: Layout, dst: Layout, target_local: int):
    """The copies that build target local rank `target_local`'s block, in unit coordinates.

    Returns (units, [(source local rank, box in the source rank's block, box in the target
    block)]). Units are per dimension the lcm of the two layouts' divisors, so one pattern serves
    every tensor with this pair of layouts: scale by ``global_shape[i] // units[i]``. Only the
    source ranks of the chunk MindSpore would read (that of source local rank
    ``target_local mod F``) are used, and only where their blocks meet the target block.
    """
    key = (src, dst, target_local)
    hit = _PATTERN_CACHE.get(key)
    if hit is not None:
        return hit
    units = tuple(_lcm(a, b) for a, b in zip(src.divisors, dst.divisors))
    rho = target_local % src.devices
    members = src.chunk_members[src.chunk(rho)]
    t_block = dst.block(target_local % dst.devices)
    per_dim = []  # for each dim: list of (source block index, lo, hi) overlapping the target block
    t_start = []
    for i, u in enumerate(units):
        tu = u // dst.divisors[i]
        su = u // src.divisors[i]
        lo, hi = t_block[i] * tu, (t_block[i] + 1) * tu
        t_start.append(lo)
        per_dim.append([(b, max(lo, b * su), min(hi, (b + 1) * su)) for b in range(lo // su, (hi - 1) // su + 1)])
    out = []
    for combo in itertools.product(*per_dim):
        blocks = tuple(c[0] for c in combo)
        q = members.get(blocks)
        if q is None:  # cannot happen for a valid layout: the chunk's blocks tile the tensor
            raise LayoutError(f"internal: no rank of {src.describe()} holds block {blocks}")
        s_box = tuple((lo - b * (u // src.divisors[i]), hi - b * (u // src.divisors[i]))
                      for i, ((b, lo, hi), u) in enumerate(zip(combo, units)))
        t_box = tuple((lo - t_start[i], hi - t_start[i]) for i, (_, lo, hi) in enumerate(combo))
        out.append((q, s_box, t_box))
    result = (units, out)
    if len(_PATTERN_CACHE) > 100_000:
        _PATTERN_CACHE.clear()
    _PATTERN_CACHE[key] = result
    return result


def scaled_copies(src: Layout, dst: Layout, target_local: int, global_shape: tuple[int, ...]):
    """Copies for a concrete tensor: [(source local rank, source box, target box)] in elements."""
    units, pattern = copy_pattern(src, dst, target_local)
    scale = [n // u for n, u in zip(global_shape, units)]
    return [
        (q, tuple((a * s, b * s) for (a, b), s in zip(sb, scale)), tuple((a * s, b * s) for (a, b), s in zip(tb, scale)))
        for q, sb, tb in pattern
    ]


# ====================================================================================== planner

# What the planner checks before any output (recorded in ``Plan.checks``, and so in the manifest).
CHECK_NAMES = "the source strategy lays out parameters the checkpoints hold"
CHECK_STAGES = "laid-out parameters are held only by ranks of the pipeline stages the strategy places them in"
CHECK_COMPLETE = "every available source rank of a stage holds that stage's laid-out parameters"
CHECK_SHAPES = "local shapes and dtypes agree within each stage and give one global shape across stages"
CHECK_TENSOR_SHAPE = "global shapes equal the strategy's recorded tensor_shape"
CHECK_OPTIMIZER = "optimizer states and their parameters have the same global shape"
CHECK_WHOLE = "parameters the source strategy does not lay out have one shape and dtype on every rank"
CHECK_TARGET = "target layouts divide the global shapes"
CHECK_IDENTICAL = "tensors listed in plan.identical are to be compared by content across source ranks"

REMEDY = "was source.strategy saved with these checkpoints?"


@dataclass
class _ParamSource:
    """How one parameter is read, and where it goes."""

    name: str
    meta: TensorMeta | None  # None: no available file holds it (its stages' files are all missing)
    layout: Layout | None  # sharded source layout; None when the source holds it whole
    stage: int  # the source stage it is read from
    global_shape: tuple[int, ...]
    in_src: bool
    holders: tuple[int, ...] = ()  # source ranks holding it, ascending
    dst_layouts: dict | None = None  # target stage -> layout as recorded; None: not in the target strategy
    reshard: bool = True  # False: copied unchanged (pass-through)
    follows: str | None = None  # an optimizer state laid out like this parameter (not in the strategy itself)

    @property
    def in_dst(self) -> bool:
        return self.dst_layouts is not None


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
        if unmapped not in (UNMAPPED_OMIT, UNMAPPED_FULL):
            raise ValueError(f"unmapped must be {UNMAPPED_OMIT!r} or {UNMAPPED_FULL!r}, got {unmapped!r}")
        self.src = src
        self.dst = dst if dst is not None else Topology.unsharded()
        self.dst_given = dst is not None
        self.index = index
        self.unmapped = unmapped
        self.omitted: list[dict] = []
        self.notes: list[str] = []
        self.checks: list[str] = []
        self._stage_files = self._available_by_stage()
        self.params = self._resolve_params()

    # --------------------------------------------------------------------------- parameters
    def _available_by_stage(self) -> dict[int, tuple[int, ...]]:
        """Source stage -> the available source ranks of that stage, ascending."""
        out: dict[int, list[int]] = {}
        for rank in sorted(self.index):
            out.setdefault(rank // self.src.stage_devices, []).append(rank)
        return {s: tuple(v) for s, v in out.items()}

    def _holders(self) -> dict[str, tuple[int, ...]]:
        """name -> ranks holding it (ascending), in MindSpore's load order: first appearance over
        the source files in descending rank order. Equal rank sets share one tuple."""
        lists: dict[str, list[int]] = {}
        for rank in sorted(self.index, reverse=True):
            for name in self.index[rank]:
                got = lists.get(name)
                if got is None:
                    lists[name] = [rank]
                else:
                    got.append(rank)
        shared: dict[tuple[int, ...], tuple[int, ...]] = {}
        out = {}
        for name, ranks in lists.items():
            key = tuple(reversed(ranks))
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
        for name, ps in resolved.items():
            ps.dst_layouts = self._target_layouts(ps, resolved)
            if self.dst_given and not ps.in_dst and ps.in_src and self.unmapped == UNMAPPED_OMIT:
                self.omitted.append({
                    "name": name,
                    "reason": "in the source strategy but not in the target strategy; its source slices fit "
                              "no target layout (unmapped=full keeps it as a whole tensor)",
                })
                continue
            ps.reshard = self._reshards(ps)
            out.append(ps)
        out.extend(self._unavailable_params(holders))
        if not out:
            raise PlanError("none of the checkpoint's parameters can be converted (all were omitted)")
        return out

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

    def _laid_out_source(self, name: str, holders: tuple[int, ...], per_stage: Mapping[int, ParamLayout],
                         follows: str | None) -> _ParamSource:
        F = self.src.stage_devices
        stages = sorted(per_stage)
        for g in holders:
            if g // F not in per_stage:
                raise PlanError(
                    f"parameter {quoted(name)} is in the checkpoint of source rank {g} (pipeline stage {g // F}), "
                    f"but the source strategy places it in stage{'s' if len(stages) > 1 else ''} "
                    f"{bounded_list(stages)} only; was source.strategy saved with these checkpoints, with the right stage number in each per-stage file?"
                )
        first = None  # (stage, meta, layout, global shape, rank) of the stage read from
        for stage in stages:
            available = self._stage_files.get(stage, ())
            if not available:
                continue  # none of this stage's files is at hand: it is not read from
            in_stage = [g for g in holders if g // F == stage]
            if not in_stage:
                raise PlanError(
                    f"parameter {quoted(name)} is in the source strategy for pipeline stage {stage}, but no "
                    f"checkpoint of that stage (ranks {rank_ranges(available)}) holds it; {REMEDY}"
                )
            absent = [g for g in available if g not in in_stage] if len(in_stage) < len(available) else []
            if absent:
                raise PlanError(
                    f"parameter {quoted(name)} is in the source strategy (stage {stage}) but missing from the "
                    f"checkpoint of source rank{'s' if len(absent) > 1 else ''} {bounded_list(absent)}; "
                    "use the files of one save, saved with this strategy"
                )
            meta = self.index[in_stage[0]][name]
            self._check_same_everywhere(name, in_stage, meta, laid_out=True)
            if meta.kind != "tensor":
                raise PlanError(f"parameter {quoted(name)}: a {meta.kind} entry cannot have a layout in the strategy")
            rec = per_stage[stage]
            layout = Layout.from_recorded(rec, len(meta.shape), F, name)
            global_shape = layout.global_shape(meta.shape)
            if rec.tensor_shape is not None and tuple(rec.tensor_shape) != global_shape and follows is None:
                raise PlanError(
                    f"parameter {quoted(name)}: local shape {list(meta.shape)} with layout {layout.describe()} gives "
                    f"global shape {list(global_shape)}, but the strategy says {bounded_list(rec.tensor_shape)}; "
                    f"{REMEDY}"
                )
            if first is None:
                first = (stage, meta, layout, global_shape, in_stage[0])
                continue
            stage0, meta0, _, shape0, rank0 = first
            if meta.dtype != meta0.dtype or global_shape != shape0:
                raise PlanError(
                    f"parameter {quoted(name)} differs between pipeline stages {stage0} and {stage}: "
                    f"{meta0.dtype} {list(shape0)} from local {list(meta0.shape)} in rank {rank0}, "
                    f"{meta.dtype} {list(global_shape)} from local {list(meta.shape)} in rank {in_stage[0]}; {REMEDY}"
                )
        if first is None:  # cannot happen: a holder's stage has an available file
            raise PlanError(f"internal: parameter {quoted(name)} has holders {list(holders)} but no stage to read")
        stage, meta, layout, global_shape, _ = first
        if not dtypes.BY_NAME[meta.dtype].sliceable and layout.is_sharded:
            raise PlanError(f"parameter {quoted(name)}: {meta.dtype} tensors are packed and cannot be resharded")
        return _ParamSource(name, meta, layout, stage, global_shape, True, holders, follows=follows)

    def _whole_source(self, name: str, holders: tuple[int, ...]) -> _ParamSource:
        """Not in the source strategy: every file that holds it must hold it whole."""
        meta = self.index[holders[0]][name]
        self._check_same_everywhere(name, list(holders), meta, laid_out=False)
        stage = self.src.stage_of_rank(holders[0])
        return _ParamSource(name, meta, None, stage, tuple(meta.shape), False, holders)

    def _check_same_everywhere(self, name: str, ranks: list[int], meta: TensorMeta, *, laid_out: bool) -> None:
        hint = ("uneven slices are not supported" if laid_out else
                f"the source strategy does not lay it out, so every rank should hold it whole; {REMEDY}")
        for r in ranks:
            other = self.index[r][name]
            if other.dtype != meta.dtype:
                raise PlanError(
                    f"parameter {quoted(name)}: dtype differs across source ranks ({meta.dtype} in rank {ranks[0]}, "
                    f"{other.dtype} in rank {r})"
                )
            if other.shape != meta.shape:
                raise PlanError(
                    f"parameter {quoted(name)}: shape differs across source ranks ({list(meta.shape)} in rank "
                    f"{ranks[0]}, {list(other.shape)} in rank {r}); {hint}"
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

    def _target_layouts(self, ps: _ParamSource, resolved: Mapping[str, _ParamSource]) -> dict | None:
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

    def _stage_ranks(self, stage: int) -> range:
        base = stage * self.src.stage_devices
        return range(base, base + self.src.stage_devices)

    def _unavailable_params(self, holders: Mapping[str, tuple[int, ...]]) -> list[_ParamSource]:
        """Strategy parameters none of whose stages has an available file: we cannot see their
        shapes, but we can still tell which ranks would be read, to report them missing."""
        out = []
        for name, per_stage in self.src.layouts.items():
            if name in holders or any(s in self._stage_files for s in per_stage):
                continue
            if self.dst_given and name not in self.dst and self.unmapped == UNMAPPED_OMIT:
                continue
            stage = min(per_stage)
            rec = per_stage[stage]
            layout = Layout.from_recorded(rec, len(rec.tensor_map), self.src.stage_devices, name)
            dst_layouts = self.dst.layouts.get(name) if self.dst_given else None
            out.append(_ParamSource(name, None, layout, stage, layout.divisors, True, (), dst_layouts))
        return out

    # --------------------------------------------------------------------------- per rank
    def target_ranks(self) -> list[int]:
        return list(range(self.dst.devices))

    def _target_layout(self, ps: _ParamSource, t_stage: int) -> Layout:
        ndim = len(ps.global_shape)
        if self.dst_given and ps.in_dst:
            return Layout.from_recorded(ps.dst_layouts[t_stage], ndim, self.dst.stage_devices, ps.name)
        return Layout.replicated(ndim, self.dst.stage_devices)

    def plan_rank(self, target_rank: int, missing: dict[int, list[int]] | None = None) -> RankPlan:
        T = self.dst.stage_devices
        F = self.src.stage_devices
        if not 0 <= target_rank < self.dst.devices:
            raise PlanError(f"target rank {target_rank} is outside 0..{self.dst.devices - 1}")
        t_stage, r = divmod(target_rank, T)
        rho = r % F
        reshards: list[ParamPlan] = []
        passthrough: list[ParamPlan] = []
        for ps in self.params:
            if self.dst_given and ps.in_dst and t_stage not in ps.dst_layouts:
                continue  # lives in another target pipeline stage
            if not ps.reshard:
                passthrough.append(self._passthrough(ps, rho))
                continue
            t_layout = self._target_layout(ps, t_stage)
            if ps.meta is None:  # only to find which (missing) files it would need
                for q, _, _ in scaled_copies(ps.layout, t_layout, r, tuple(
                        _lcm(a, b) for a, b in zip(ps.layout.divisors, t_layout.divisors))):
                    if missing is not None:
                        missing.setdefault(ps.stage * F + q, []).append(target_rank)
                continue
            t_layout.check_shape(ps.global_shape, ps.name)
            t_shape = t_layout.local_shape(ps.global_shape)
            if ps.layout is not None:
                base = ps.stage * F
                cps = [Copy(base + q, sb, tb) for q, sb, tb in scaled_copies(ps.layout, t_layout, r, ps.global_shape)]
            else:  # the whole tensor sits in one file: cut the target's box out of it
                t_box = t_layout.box(r % t_layout.devices, ps.global_shape)
                cps = [Copy(self._holder(ps, rho), t_box, full_box(t_shape))]
            item = dtypes.BY_NAME[ps.meta.dtype].itemsize
            action = ACTION_RESHARD if (ps.in_dst or not self.dst_given) else ACTION_FULL
            reshards.append(ParamPlan(ps.name, ps.meta.dtype, "tensor", action, ps.global_shape, t_shape, cps,
                                      item, prod(t_shape) * item))
        rp = RankPlan(target_rank, reshards + passthrough)
        if missing is not None:
            for src_rank in rp.source_ranks:
                if src_rank not in self.index:
                    missing.setdefault(src_rank, []).append(target_rank)
        return rp

    def _holder(self, ps: _ParamSource, rho: int) -> int:
        """The file a whole (unsharded) parameter is taken from: local rank rho of the lowest stage
        holding it, else the lowest rank holding it."""
        for stage in range(self.src.num_stages):
            g = stage * self.src.stage_devices + rho
            if g in self.index and ps.name in self.index[g]:
                return g
        return ps.holders[0]

    def _passthrough(self, ps: _ParamSource, rho: int) -> ParamPlan:
        src_rank = self._holder(ps, rho)
        meta = self.index[src_rank][ps.name]
        dt = dtypes.BY_NAME.get(meta.dtype)
        itemsize = dt.itemsize if (meta.kind == "tensor" and dt is not None and dt.storage is not None) else 0
        box = full_box(meta.shape)
        return ParamPlan(ps.name, meta.dtype, meta.kind, ACTION_COPY, tuple(meta.shape), tuple(meta.shape),
                         [Copy(src_rank, box, box)], itemsize, meta.nbytes)

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
        members_of: dict[tuple, tuple[int, ...]] = {}
        groups_of: dict[tuple, tuple[tuple[int, ...], ...]] = {}
        for ps in self.params:
            if ps.meta is None or ps.meta.kind != "tensor" or len(ps.holders) < 2:
                continue
            key = (ps.holders, ps.stage if ps.layout is not None else None)
            members = members_of.get(key)
            if members is None:
                members = tuple(g for g in ps.holders if g in read and (key[1] is None or g // F == key[1]))
                members_of[key] = members
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
        ranks = list(self.target_ranks() if target_ranks is None else target_ranks)
        collect = missing is not None
        missing = {} if missing is None else missing
        rank_plans = [self.plan_rank(g, missing) for g in ranks]
        for k in list(missing):
            missing[k] = sorted(set(missing[k]))
        if missing and not collect:
            raise MissingRankError(missing)
        checks = list(self.checks) + [CHECK_TARGET]
        read = {c.source_rank for rp in rank_plans for p in rp.params for c in p.copies}
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
            notes=list(self.notes),
            identical=identical,
            checks=checks,
        )


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
    if target_rank < 0 or (dst is not None and target_rank >= dst_t.devices):
        raise PlanError(f"target rank {target_rank} is outside 0..{dst_t.devices - 1}")
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
                if unmapped == UNMAPPED_OMIT:
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
        s = Layout.from_recorded(rec, len(rec.tensor_map), F, name)
        t = (Layout.from_recorded(t_layout, len(rec.tensor_map), T, name) if t_layout is not None
             else Layout.replicated(len(rec.tensor_map), T))
        _, pattern = copy_pattern(s, t, r)
        needed.update(stage * F + q for q, _, _ in pattern)
        needed.add(stage * F + r % F)
    return sorted(needed, reverse=True)
