"""Planning, phase 2: plan phase 1's parameter records (``plan.resolve``) against the target.

Pure code: the inputs are the two topologies (resolved strategies) and an index of what each
source file holds (names, dtypes, shapes); the output is a ``Plan`` (``plan.model``), plain data
that serialises to JSON. The ``Planner`` groups the records (parameters with the same layouts,
shape and holders are planned alike), plans each target rank from its groups' copy patterns
(``plan.patterns``), and lists what must be byte-identical (``Planner.identical``).

Cost: planning is linear in what exists, never in what a strategy declares. Copy patterns are
computed arithmetically (``Layout.rank_holding``), one per distinct pair of layouts, target block
and source chunk, and stop early when they would need more source ranks than are present.
Memory per parameter and target rank is one small ``ParamPlan`` (three references and a size):
what parameters share is shared — their per-parameter facts (``TensorFacts``), shapes, and copy
tuples (parameters with the same layouts and shape read the same boxes) — and target ranks whose
plans are the same up to their number (replicated targets: a thousand target ranks of an 8-rank
source have at most 8 different plans) share one tuple of ``ParamPlan``.
"""

from __future__ import annotations

from math import prod
from typing import Iterable, NamedTuple

import reshard_job.core.dtypes as dtypes
from reshard_job.core.boxes import box_size, full_box
from reshard_job.core.layout import Layout, is_flattened, unflatten
from reshard_job.core.topology import Topology
from reshard_job.errors import MissingRankError, PlanError
from reshard_job.plan.checks import CHECK_IDENTICAL, CHECK_TARGET, check_even_split, show_block
from reshard_job.plan.model import (ACTION_COPY, ACTION_FULL, ACTION_RESHARD, COUNTED_ALWAYS, COUNTED_FIRST,
                                    UNMAPPED_FULL, UNMAPPED_OMIT, Copy, Place, Plan, RankPlan, TensorFacts, ParamSource)
from reshard_job.plan.bodies import RankBodies, RankBody
from reshard_job.plan.counting import StageCounting
from reshard_job.plan.patterns import chunk_copy_pattern, copy_pattern, scale_pattern
from reshard_job.plan.redundancy import Owners, stage_owners
from reshard_job.plan.resolve import Resolver, SourceIndex
from reshard_job.text import quoted, shorten

# The names other code imports from here, now at home in the modules above.

# Missing source ranks listed per (parameter, target rank) once a copy pattern is known to need
# more source ranks than the stage has files: the rest is counted, not listed.
MISSING_SAMPLE = 16


class _Group(NamedTuple):
    """What the parameters of one group share: how they are read and where they go."""

    kind: str  # "L" laid out, "U" laid out but no file at hand, "W" whole source, "P" pass-through
    layout: Layout | None  # source layout (L, U)
    targets: tuple[tuple[int, Layout], ...] | None  # target stage -> layout; None: replicated whole


class Planner(RankBodies):
    """Builds a Plan; one instance per (source, target, available files) triple.

    Construction resolves every parameter and runs the cross-checks between the strategies and
    what the files hold (``CHECK_*``, phase 1: ``Resolver``); a disagreement is a one-line
    ``PlanError`` before anything is written. Then each parameter gets its group (phase 2).
    """

    def __init__(
        self,
        src: Topology,
        dst: Topology | None,
        index: SourceIndex,
        *,
        unmapped: str = UNMAPPED_OMIT,
        remove_redundancy: bool = False,
        sources: dict[str, ParamSource] | None = None,
    ):
        self._shapes: dict[tuple, tuple] = {}  # equal shapes and boxes share one tuple
        resolver = Resolver(src, dst, index, unmapped=unmapped, shapes=self._shapes, sources=sources)
        self.src, self.dst, self.dst_given = resolver.src, resolver.dst, resolver.dst_given
        self.index = index
        self.unmapped = unmapped
        # each target rank writes only the laid-out parameters it owns (plan.redundancy)
        self.remove_redundancy = remove_redundancy
        self._owners: dict[int, Owners] = {}  # target stage -> who writes what
        self.omitted: list[dict] = resolver.omitted
        self.notes: list[str] = []
        self.checks: list[str] = resolver.checks
        self._stage_files = resolver.stage_files
        self._groups: list[_Group] = []
        self._group_ids: dict[tuple, int] = {}
        self._stage_keys: dict[int, tuple] = {}
        self._chunks: dict[tuple[int, int], tuple[int, ...]] = {}
        self._bodies: dict[tuple, RankBody] = {}
        self._rows: dict[int, tuple] = {}  # target stage -> ``_stage_rows``
        self._copies: dict[tuple, tuple[Copy, ...]] = {}
        self._block_holders: dict[tuple, dict] = {}
        self._target_keys: dict[tuple, tuple] = {}
        self._unlisted = 0  # needed source ranks left out of cut-short copy patterns
        self._places: dict[tuple, Place] = {}  # equal places share one
        self.params = resolver.resolve()
        self.target_only = resolver.target_only
        if resolver.copied_whole:
            shown = ", ".join(quoted(n, 60) for n in resolver.copied_whole[:5])
            self.notes.append(f"{len(resolver.copied_whole)} tensor(s) the target strategy does not lay out are copied "
                              f"whole into every target rank, as MindSpore copies tensors outside both strategies: "
                              f"{shown}{', ...' if len(resolver.copied_whole) > 5 else ''} (target.unmapped=drop "
                              "leaves them out)")
        # the source side of each parameter, for another plan of the same source (``one_device``)
        self._sources = resolver.sources
        self._counting = StageCounting(self.dst.stage_devices, lambda t_stage: self._stage_layouts(t_stage)[0])
        for ps in self.params:
            self._finish(ps)

    def _place(self, origin: tuple, counted: int) -> Place:
        return self._places.setdefault((origin, counted), Place(self._intern(origin), counted))

    def _intern(self, value: tuple) -> tuple:
        return self._shapes.setdefault(value, value)

    # --------------------------------------------------------------------------- groups
    def _finish(self, ps: ParamSource) -> None:
        """Give a resolved parameter its shared per-parameter facts and its group."""
        targets = self._targets(ps)
        if ps.meta is None:
            key = ("U", ps.layout, ps.stage, ps.global_shape, targets)
        elif not ps.reshard:
            dt = dtypes.BY_NAME.get(ps.meta.dtype)
            itemsize = dt.itemsize if (ps.meta.kind == "tensor" and dt is not None and dt.storage is not None) else 0
            ps.tensor = _facts(ps, ps.meta.dtype, ps.meta.kind, ACTION_COPY, itemsize)
            key = ("P", None, ps.holders, ps.global_shape, ps.meta.nbytes)
        else:
            action = ACTION_RESHARD if (ps.in_dst or not self.dst_given) else ACTION_FULL
            itemsize = dtypes.BY_NAME[ps.meta.dtype].itemsize
            ps.tensor = _facts(ps, ps.meta.dtype, "tensor", action, itemsize)
            if ps.layout is not None:
                key = ("L", ps.layout, ps.stage, ps.global_shape, itemsize, targets, ps.holders if ps.partial else None)
            else:
                key = ("W", None, ps.holders, ps.global_shape, itemsize, targets)
        gid = self._group_ids.get(key)
        if gid is None:
            gid = self._group_ids[key] = len(self._groups)
            self._groups.append(_Group(key[0], ps.layout if key[0] in "LU" else None, targets))
        ps.group = gid

    def _targets(self, ps: ParamSource) -> tuple[tuple[int, Layout], ...] | None:
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
            for rec in ps.dst_layouts.values():
                check_even_split(rec, ps.name, self.dst.source)
            T = self.dst.stage_devices
            # a parameter no available file holds has a stand-in shape (its divisors), not its own
            shape = ps.global_shape if ps.meta is not None else None
            hit = self._target_keys[key] = tuple(
                (stage, Layout.from_recorded(unflatten(rec, ndim, stage_devices=T, global_shape=shape, name=ps.name),
                                             ndim, T, ps.name))
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
        return RankPlan(target_rank, body.params, body.summary, self._counting.counting(t_stage, r))

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
        owned = self._stage_owners(t_stage).owned[r] if self.remove_redundancy else None
        return t_stage, tuple(t.block(r % t.devices) for t in targets), chunks, rho if by_rho else None, owned

    def _stage_owners(self, t_stage: int) -> Owners:
        """Which rank of target stage t_stage writes each of its laid-out parameters when
        redundancy is removed (one writer per block, ``plan.redundancy``)."""
        owners = self._owners.get(t_stage)
        if owners is None:
            laid_out = [(ps.name, self._target_layout(ps, t_stage)) for ps in self.params
                        if self._groups[ps.group].targets is not None and t_stage in ps.dst_layouts]
            owners = self._owners[t_stage] = stage_owners(laid_out, self.dst.stage_devices)
        return owners

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

    def _group_result(self, ps: ParamSource, t_stage: int, r: int, rho: int):
        """What every parameter of ps's group gets on target local rank r: ((target shape, copies,
        bytes written), bytes read); for parameters without any file at hand, the source ranks
        they would be read from."""
        res = self._group_plan(ps, t_stage, r, rho)
        if ps.meta is None:
            return res
        _, copies, nbytes, _ = res
        itemsize = ps.tensor.itemsize
        return res, (sum(box_size(c.source_box) for c in copies) * itemsize if itemsize else nbytes)

    def _target_layout(self, ps: ParamSource, t_stage: int) -> Layout:
        targets = self._groups[ps.group].targets
        if targets is not None:
            return dict(targets)[t_stage]
        return Layout.replicated(len(ps.global_shape), self.dst.stage_devices)

    def _group_plan(self, ps: ParamSource, t_stage: int, r: int, rho: int):
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
            place = self._place((0,) * len(ps.global_shape), COUNTED_FIRST)
            return ps.global_shape, (Copy(holder, box, box),), ps.meta.nbytes, place
        t_layout = self._target_layout(ps, t_stage)
        t_layout.check_shape(ps.global_shape, ps.name)
        t_shape = self._intern(t_layout.local_shape(ps.global_shape))
        nbytes = prod(t_shape) * ps.tensor.itemsize
        t_box = self._intern(t_layout.box(r % t_layout.devices, ps.global_shape))
        place = self._place(tuple(lo for lo, _ in t_box), self._counted(ps, t_stage, t_layout))
        if ps.layout is None:  # the whole tensor sits in one file: cut the target's box out of it
            return t_shape, (Copy(self._holder(ps, rho), t_box, self._intern(full_box(t_shape))),), nbytes, place
        copies = self._laid_out_copies(ps, t_layout, r)
        if ps.partial:
            copies = self._from_holders(ps, copies)
        return t_shape, copies, nbytes, place

    # --------------------------------------------------------------------------- counting once
    def _counted(self, ps: ParamSource, t_stage: int, t_layout: Layout) -> int:
        """``Place.counted`` of the parameters of ps's group in target stage t_stage (plan.counting)."""
        if self._groups[ps.group].targets is None:
            return COUNTED_FIRST  # whole on every rank of the stage
        # redundancy removed: one writer per block already (plan.redundancy)
        return COUNTED_ALWAYS if self.remove_redundancy else self._counting.number(t_stage, t_layout)

    def _laid_out_copies(self, ps: ParamSource, t_layout: Layout, r: int) -> tuple[Copy, ...]:
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
        pattern = chunk_copy_pattern(ps.layout, t_layout, chunk, t_block, limit)
        self._unlisted += pattern.count - len(pattern.pieces)
        base = ps.stage * F
        copies = tuple(Copy(base + q, self._intern(sb), self._intern(tb))
                       for q, sb, tb in scale_pattern(pattern, ps.global_shape))
        if len(self._copies) > 200_000:  # many distinct shapes: keep the cache bounded
            self._copies.clear()
        self._copies[key] = copies
        return copies

    def _from_holders(self, ps: ParamSource, copies: tuple[Copy, ...]) -> tuple[Copy, ...]:
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
                    f"{show_block(ps.layout, block, ps.global_shape)} (rank {g} lacks it, and the ranks that may "
                    "hold it are not among the files given)"
                )
            same_stage = [o for o in others if o // F == g // F]
            out.append(Copy((same_stage or others)[0], c.source_box, c.target_box))
        return tuple(out)

    def _holder(self, ps: ParamSource, rho: int) -> int:
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
                    "stages": self.dst.num_stages, "strategy": self.dst.source if self.dst_given else None,
                    **({"remove_redundancy": True} if self.remove_redundancy else {})},
            ranks=rank_plans,
            omitted=list(self.omitted),
            notes=notes,
            target_only=list(self.target_only),
            identical=identical,
            checks=checks,
        )

    def one_device(self) -> RankPlan:
        """The plan that puts every parameter of the source whole onto one device, as
        ``proof.collect.single_device_plan`` makes it, from the records this planner resolved
        (not worked out twice: for a model of many small parameters that is most of planning).
        Call it after ``plan``: those records are the new plan's then."""
        sources, self._sources = self._sources, None
        if sources is None:
            raise RuntimeError("one_device() was called twice")
        missing: dict[int, list[int]] = {}
        rank_plan = Planner(self.src, None, self.index, unmapped=UNMAPPED_FULL, sources=sources).plan_rank(0, missing)
        if missing:
            raise MissingRankError({k: sorted(set(v)) for k, v in missing.items()})
        return rank_plan


def _facts(ps: ParamSource, dtype: str, kind: str, action: str, itemsize: int) -> TensorFacts:
    """The parameter's facts: those another plan of the same records gave it where they are the
    same (``one_device``: for 600,000 parameters a second set was 46 MiB), else new ones."""
    t = ps.tensor
    if t is not None and t.action == action and t.dtype == dtype and t.kind == kind and t.itemsize == itemsize \
            and t.global_shape == ps.global_shape and t.name == ps.name:
        return t
    return TensorFacts(ps.name, dtype, kind, action, ps.global_shape, itemsize)
