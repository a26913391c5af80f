"""Planning: for every target rank and parameter, which source ranks and which boxes to copy.

Pure code: the inputs are the two topologies (resolved strategies) and an index of what each
source file holds (names, dtypes, shapes); the output is a ``Plan``, plain data that serialises to
JSON. It is what ``job.mode=plan`` prints, what the executor runs, and what lineage records as the
rank map.

Choices, and how they relate to MindSpore 2.10's converter (spec §5–§7):

* **Any M→N.** A target box is assembled from its intersections with source boxes, which works for
  any pair of device counts; MindSpore requires one count to divide the other.
* **Which replica is read.** Replicated source blocks are identical in a consistent checkpoint, but
  we read the replica MindSpore reads, so results agree bit for bit even when replicas drifted:
  target local rank ``r`` reads the ranks of the optimizer chunk of source local rank
  ``r mod F`` (the chunk's blocks tile the tensor exactly), which is MindSpore's replica rule.
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
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from math import gcd, prod
from typing import Iterable, Mapping

from .errors import LayoutError, MissingRankError, PlanError
from .formats import dtypes
from .formats.boxes import Box, box_size, full_box
from .layout import Layout
from .topology import Topology

ACTION_RESHARD = "reshard"
ACTION_COPY = "copy"
ACTION_FULL = "full"

UNMAPPED_OMIT = "omit"
UNMAPPED_FULL = "full"

PLAN_VERSION = 2


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
        return Plan(obj["source"], obj["target"], ranks, obj.get("omitted", []), obj.get("notes", []))


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


@dataclass
class _ParamSource:
    """How one parameter is read."""

    name: str
    meta: TensorMeta | None  # None: no available file holds it (its stage's files are all missing)
    layout: Layout | None  # sharded source layout; None when the source holds it whole
    stage: int
    global_shape: tuple[int, ...]
    in_src: bool
    in_dst: bool
    reshard: bool  # False: copied unchanged (pass-through)


class Planner:
    """Builds a Plan; one instance per (source, target, available files) triple."""

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
        self.params = self._resolve_params()

    # --------------------------------------------------------------------------- parameters
    def _order(self) -> list[str]:
        """First appearance over the source files in descending rank order (MindSpore's load order)."""
        seen: dict[str, None] = {}
        for rank in sorted(self.index, reverse=True):
            for name in self.index[rank]:
                seen.setdefault(name, None)
        return list(seen)

    def _resolve_params(self) -> list[_ParamSource]:
        out = []
        for name in self._order():
            in_src = name in self.src
            in_dst = name in self.dst
            if self.dst_given and not in_dst and in_src and self.unmapped == UNMAPPED_OMIT:
                self.omitted.append({
                    "name": name,
                    "reason": "in the source strategy but not in the target strategy; its source slices fit "
                              "no target layout (unmapped=full keeps it as a whole tensor)",
                })
                continue
            out.append(self._param_source(name, in_src, in_dst))
        out.extend(self._unavailable_params())
        if not out:
            raise PlanError("none of the checkpoint's parameters can be converted (all were omitted)")
        return out

    def _stage_ranks(self, stage: int) -> range:
        base = stage * self.src.stage_devices
        return range(base, base + self.src.stage_devices)

    def _unavailable_params(self) -> list[_ParamSource]:
        """Strategy parameters of source stages none of whose files are available: we cannot see
        their shapes, but we can still tell which ranks would be read, to report them missing."""
        dark = [s for s in range(self.src.num_stages) if not any(r in self.index for r in self._stage_ranks(s))]
        out = []
        for name, per_stage in self.src.layouts.items():
            stage = min(per_stage)
            if stage not in dark or (self.dst_given and name not in self.dst and self.unmapped == UNMAPPED_OMIT):
                continue
            rec = per_stage[stage]
            layout = Layout.from_recorded(rec, len(rec.tensor_map), self.src.stage_devices, name)
            out.append(_ParamSource(name, None, layout, stage, layout.divisors, True, name in self.dst, True))
        return out

    def _param_source(self, name: str, in_src: bool, in_dst: bool) -> _ParamSource:
        holders = [r for r in sorted(self.index) if name in self.index[r]]
        if in_src:
            stage = self.src.lowest_stage(name)
            stage_ranks = self._stage_ranks(stage)
            available = [r for r in stage_ranks if r in self.index]
            in_stage = [r for r in available if name in self.index[r]]
            if not in_stage:
                raise PlanError(
                    f"parameter {name!r} is in the source strategy for pipeline stage {stage}, but the checkpoints "
                    f"of that stage (ranks {stage_ranks[0]}-{stage_ranks[-1]}) do not hold it "
                    f"(found in rank {holders[0]})"
                )
            meta = self.index[in_stage[0]][name]
            self._check_same_everywhere(name, in_stage, meta)
            absent = [r for r in available if name not in self.index[r]]
            if absent:
                raise PlanError(
                    f"parameter {name!r} is in the source strategy (stage {stage}) but missing from the "
                    f"checkpoint of source rank{'s' if len(absent) > 1 else ''} {absent}"
                )
            if meta.kind != "tensor":
                raise PlanError(f"parameter {name!r}: a {meta.kind} entry cannot have a layout in the strategy")
            rec = self.src.layout(name, stage)
            layout = Layout.from_recorded(rec, len(meta.shape), self.src.stage_devices, name)
            global_shape = layout.global_shape(meta.shape)
            if rec.tensor_shape is not None and tuple(rec.tensor_shape) != global_shape:
                raise PlanError(
                    f"parameter {name!r}: local shape {list(meta.shape)} with layout {layout.describe()} gives "
                    f"global shape {list(global_shape)}, but the strategy says {list(rec.tensor_shape)}"
                )
            if not dtypes.BY_NAME[meta.dtype].sliceable and (layout.is_sharded or in_dst):
                raise PlanError(f"parameter {name!r}: {meta.dtype} tensors are packed and cannot be resharded")
            return _ParamSource(name, meta, layout, stage, global_shape, True, in_dst, True)
        # not in the source strategy: every file that holds it holds it whole
        meta = self.index[holders[0]][name]
        self._check_same_everywhere(name, holders, meta)
        stage = self.src.stage_of_rank(holders[0])
        reshard = self.dst_given and in_dst  # no target strategy: MindSpore copies it, after the resharded ones
        if reshard and not (meta.kind == "tensor" and dtypes.BY_NAME[meta.dtype].sliceable):
            if in_dst:
                raise PlanError(f"parameter {name!r}: a {meta.dtype} entry cannot be laid out by the target strategy")
            reshard = False  # str/map/packed entries are only ever copied
        return _ParamSource(name, meta, None, stage, tuple(meta.shape), False, in_dst, reshard)

    def _check_same_everywhere(self, name: str, ranks: list[int], meta: TensorMeta) -> None:
        for r in ranks:
            other = self.index[r][name]
            if other.dtype != meta.dtype:
                raise PlanError(
                    f"parameter {name!r}: dtype differs across source ranks ({meta.dtype} in rank {ranks[0]}, "
                    f"{other.dtype} in rank {r})"
                )
            if other.shape != meta.shape:
                raise PlanError(
                    f"parameter {name!r}: shape differs across source ranks ({list(meta.shape)} in rank "
                    f"{ranks[0]}, {list(other.shape)} in rank {r}); uneven slices are not supported"
                )

    # --------------------------------------------------------------------------- per rank
    def target_ranks(self) -> list[int]:
        return list(range(self.dst.devices))

    def _target_layout(self, ps: _ParamSource, t_stage: int) -> Layout:
        ndim = len(ps.global_shape)
        if self.dst_given and ps.in_dst:
            return Layout.from_recorded(self.dst.layout(ps.name, t_stage), ndim, self.dst.stage_devices, ps.name)
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
            if self.dst_given and ps.in_dst and t_stage not in self.dst.stages_of(ps.name):
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
        return min(r for r in self.index if ps.name in self.index[r])

    def _passthrough(self, ps: _ParamSource, rho: int) -> ParamPlan:
        src_rank = self._holder(ps, rho)
        meta = self.index[src_rank][ps.name]
        dt = dtypes.BY_NAME.get(meta.dtype)
        itemsize = dt.itemsize if (meta.kind == "tensor" and dt is not None and dt.storage is not None) else 0
        box = full_box(meta.shape)
        return ParamPlan(ps.name, meta.dtype, meta.kind, ACTION_COPY, tuple(meta.shape), tuple(meta.shape),
                         [Copy(src_rank, box, box)], itemsize, meta.nbytes)

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
        return Plan(
            source={"devices": self.src.devices, "stage_devices": self.src.stage_devices,
                    "stages": self.src.num_stages, "strategy": self.src.source},
            target={"devices": self.dst.devices, "stage_devices": self.dst.stage_devices,
                    "stages": self.dst.num_stages, "strategy": self.dst.source if self.dst_given else None},
            ranks=rank_plans,
            omitted=list(self.omitted),
            notes=list(self.notes),
        )


def make_plan(src: Topology, dst: Topology | None, index: SourceIndex, *, unmapped: str = UNMAPPED_OMIT,
              target_ranks: Iterable[int] | None = None) -> Plan:
    return Planner(src, dst, index, unmapped=unmapped).plan(target_ranks)


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
