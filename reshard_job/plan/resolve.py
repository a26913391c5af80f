"""Planning, phase 1: resolve every parameter the sources hold into a plain ``ParamSource`` record.

From the source strategy and the index of what each source file holds, the ``Resolver`` finds,
per parameter, the files holding it, its source layout and global shape, the stage it is read
from and its target layouts, and runs the cross-checks of ``plan.checks`` on the way (a
disagreement is a one-line ``PlanError`` before anything is written). Phase 2 (``plan.planner``)
plans the records against the target.

Parameters the target strategy does not lay out are left out or refused here (``unmapped``);
optimizer states a strategy leaves out are laid out like their parameter; a parameter shared by
pipeline stages is one record, read from the lowest stage with files at hand.
"""

from __future__ import annotations

from functools import cached_property
from typing import Mapping, Sequence

import reshard_job.core.dtypes as dtypes
from reshard_job.core.layout import Layout, common_ndim, unflatten
from reshard_job.core.strategy_model import ParamLayout
from reshard_job.core.tensor_meta import TensorMeta
from reshard_job.core.topology import Topology, optimizer_base
from reshard_job.errors import PlanError
from reshard_job.plan.checks import (CHECK_COMPLETE, CHECK_NAMES, CHECK_OPTIMIZER, CHECK_SHAPES, CHECK_STAGES,
                                     CHECK_TENSOR_SHAPE, CHECK_WHOLE, check_coverage, check_names_overlap,
                                     check_optimizer_states, check_placement, check_same_metas,
                                     check_shared_layout, check_sliceable, check_source_ranks,
                                     check_target_network, check_tensor_shape, laid_out_by_a_strategy, check_even_split,
                                     target_only_states)
from reshard_job.plan.model import BUFFER_PREFIXES, UNMAPPED_CHOICES, UNMAPPED_DROP, UNMAPPED_FULL, ParamSource
from reshard_job.text import quoted, shorten

SourceIndex = Mapping[int, Mapping[str, TensorMeta]]  # global source rank -> name -> meta


class Resolver:
    """Phase 1 of one (source, target, available files) triple: ``resolve()`` gives the records.

    Equal shapes share one tuple through `shapes`, the interning table phase 2 goes on using.
    Parameters left out are listed in ``omitted``, the cross-checks that ran in ``checks``.
    """

    def __init__(self, src: Topology, dst: Topology | None, index: SourceIndex, *, unmapped: str,
                 shapes: dict[tuple, tuple], sources: dict[str, ParamSource] | None = None):
        """`sources`: the records another Resolver of the same `src` and `index` gave (its
        ``sources``), reused rather than worked out again; they are this Resolver's then."""
        if unmapped not in UNMAPPED_CHOICES:
            raise ValueError(f"unmapped must be one of {', '.join(map(repr, UNMAPPED_CHOICES))}, got {unmapped!r}")
        self.src = src
        self.dst = dst if dst is not None else Topology.unsharded()
        self.dst_given = dst is not None
        self.index = index
        self.unmapped = unmapped
        self.omitted: list[dict] = []
        self.copied_whole: list[str] = []  # a whole model's tensors the target strategy does not lay out
        self.target_only: list[str] = []  # optimizer states the target strategy lays out and no source holds
        self.checks: list[str] = []
        check_source_ranks(src, index)
        self.stage_files = self._available_by_stage()
        self._shapes = shapes
        self._placed: set[tuple] = set()
        self._covered: set[tuple] = set()
        self._at_hand: dict[tuple[int, ...], tuple[int, int]] = {}
        self._global_shapes: dict[tuple, tuple[Layout, tuple, ParamLayout]] = {}
        self._alike: dict[tuple[int, ...], bool] = {}  # holder set -> whether its files hold identical entries
        self.sources = sources  # name -> record of each parameter the files hold, once resolved

    def _intern(self, value: tuple) -> tuple:
        return self._shapes.setdefault(value, value)

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
        if all(a.keys().isdisjoint(b.keys()) for i, (a, _) in enumerate(classes) for b, _ in classes[i + 1:]):
            out = {}  # each name in the files of one set of ranks (a stage's, usually): a C-level fill
            for names, ranks in classes:
                out.update(dict.fromkeys(names, tuple(sorted(ranks))))
            return out
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

    def resolve(self) -> list[ParamSource]:
        """The records of every parameter to plan: those the files hold, in MindSpore's load
        order, then strategy parameters none of whose stages has a file at hand."""
        holders = self._holders()
        check_names_overlap(self.src, holders)
        resolved = self.sources
        if resolved is None:
            resolved = self.sources = {name: self._source_of(name, ranks) for name, ranks in holders.items()}
        if self.src.layouts:
            self.checks += [CHECK_NAMES, CHECK_STAGES, CHECK_COMPLETE, CHECK_SHAPES]
            if any(lay.tensor_shape is not None for per in self.src.layouts.values() for lay in per.values()):
                self.checks.append(CHECK_TENSOR_SHAPE)
            self.checks.append(CHECK_OPTIMIZER)
            check_optimizer_states(resolved)
        self.checks.append(CHECK_WHOLE)
        out = []
        left_out = []
        for name, ps in resolved.items():
            ps.dst_layouts = self._target_layouts(ps, resolved)
            if self.dst_given and not ps.in_dst and self.unmapped != UNMAPPED_FULL and (
                    ps.in_src or self._whole_model_leaves_out(ps)):
                left_out.append(name)
                continue
            ps.reshard = self._reshards(ps)
            out.append(ps)
        if self.dst_given:
            check_target_network(self.src, self.dst, resolved)
            self.target_only = target_only_states(self.src, self.dst, resolved)
        self._omit(left_out)
        out.extend(self._unavailable_params(holders))
        if not out:
            raise PlanError("none of the checkpoint's parameters can be converted (all were omitted)")
        return out

    def _whole_model_leaves_out(self, ps: ParamSource) -> bool:
        """A source without a strategy (a whole model): a tensor the target strategy does not lay
        out is copied whole, as MindSpore copies tensors outside both strategies, unless it is a
        pipeline's buffer or ``unmapped=drop`` says to leave such tensors out."""
        if self.src.layouts or not laid_out_by_a_strategy(ps, self.src):
            return False
        if self.unmapped == UNMAPPED_DROP or ps.name.startswith(BUFFER_PREFIXES):
            return True
        self.copied_whole.append(ps.name)
        return False

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

    def _source_of(self, name: str, holders: tuple[int, ...]) -> ParamSource:
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
        """``check_placement``, once per distinct holder set."""
        key = (holders, stages)
        if key in self._placed:
            return
        check_placement(name, holders, stages, self.src.stage_devices)
        self._placed.add(key)

    def _source_layout(self, rec: ParamLayout, local_shape: tuple[int, ...], name: str):
        """(layout, global shape, layout as recorded with a JSON multi-axis map folded) of a
        recorded source layout for a tensor of `local_shape`."""
        key = (rec, local_shape)
        known = self._global_shapes.get(key)
        if known is None:
            check_even_split(rec, name, self.src.source)
            F = self.src.stage_devices
            rec = unflatten(rec, len(local_shape), stage_devices=F, local_shape=local_shape, name=name)
            layout = Layout.from_recorded(rec, len(local_shape), F, name)
            known = self._global_shapes[key] = (layout, self._intern(layout.global_shape(local_shape)), rec)
        return known

    def _laid_out_source(self, name: str, holders: tuple[int, ...], per_stage: Mapping[int, ParamLayout],
                         follows: str | None) -> ParamSource:
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
            check_shared_layout(name, (stages[0], stage), layout, other)
        self._check_same_everywhere(name, holders, meta, laid_out=True)
        for stage in stages:
            rec = self._source_layout(per_stage[stage], meta.shape, name)[2]
            check_tensor_shape(name, meta, layout, global_shape, rec, follows)
        check_sliceable(name, meta, layout)
        read_stage, available = self._stages_at_hand(stages)
        complete = len(holders) == available
        if not complete:  # a redundancy-removed save, or files of different saves
            self._check_coverage(name, layout, global_shape, holders, stages)
        return ParamSource(name, meta, layout, read_stage, global_shape, True, holders, follows=follows,
                           partial=not complete)

    def _stages_at_hand(self, stages: tuple[int, ...]) -> tuple[int, int]:
        """(the lowest of `stages` with files at hand, how many files those stages have)."""
        hit = self._at_hand.get(stages)
        if hit is None:
            hit = self._at_hand[stages] = (next(s for s in stages if s in self.stage_files),
                                           sum(len(self.stage_files.get(s, ())) for s in stages))
        return hit

    def _check_coverage(self, name: str, layout: Layout, global_shape: tuple[int, ...], holders: tuple[int, ...],
                        stages: tuple[int, ...]) -> None:
        """``check_coverage``, once per distinct (layout, holder set, stages)."""
        key = (layout, holders, stages)
        if key in self._covered:
            return
        check_coverage(name, layout, global_shape, holders, stages, self.src.stage_devices, self.stage_files)
        self._covered.add(key)

    def _whole_source(self, name: str, holders: tuple[int, ...]) -> ParamSource:
        """Not in the source strategy: every file that holds it must hold it whole."""
        meta = self.index[holders[0]][name]
        self._check_same_everywhere(name, holders, meta, laid_out=False)
        stage = self.src.stage_of_rank(holders[0])
        return ParamSource(name, meta, None, stage, self._intern(tuple(meta.shape)), False, holders)

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
        check_same_metas(self.index, name, ranks, meta, laid_out=laid_out)

    def _target_layouts(self, ps: ParamSource, resolved: Mapping[str, ParamSource]) -> Mapping | None:
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

    def _reshards(self, ps: ParamSource) -> bool:
        if ps.in_src:
            return True
        # not in the source strategy: whole tensors; without a target strategy MindSpore copies them
        reshard = self.dst_given and ps.in_dst
        if reshard and not (ps.meta.kind == "tensor" and dtypes.BY_NAME[ps.meta.dtype].sliceable):
            raise PlanError(f"parameter {quoted(ps.name)}: a {ps.meta.dtype} entry cannot be laid out by the "
                            "target strategy")
        return reshard

    def _unavailable_params(self, holders: Mapping[str, tuple[int, ...]]) -> list[ParamSource]:
        """Strategy parameters none of whose stages has an available file: we cannot see their
        shapes, but we can still tell which ranks would be read, to report them missing."""
        out = []
        for name, per_stage in self.src.layouts.items():
            if name in holders or any(s in self.stage_files for s in per_stage):
                continue
            if self.dst_given and name not in self.dst and self.unmapped != UNMAPPED_FULL:
                continue
            stage = min(per_stage)
            rec = per_stage[stage]
            dst_layouts = self.dst.layouts.get(name) if self.dst_given else None
            ndim = common_ndim([rec, *(dst_layouts or {}).values()])
            layout = Layout.from_recorded(rec, ndim, self.src.stage_devices, name)
            out.append(ParamSource(name, None, layout, stage, layout.divisors, True, (), dst_layouts))
        return out
