"""The cross-checks between the strategies and what the files hold, run before any output.

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

Each check here is a function of plain data raising a one-line ``PlanError``; the resolver
(``plan.resolve``) calls them, remembering which holder sets it has checked already.
"""

from __future__ import annotations

import itertools
from math import prod
from typing import Iterable, Mapping, Sequence

import reshard_job.core.dtypes as dtypes
from reshard_job.core.layout import Layout
from reshard_job.core.strategy_model import ParamLayout
from reshard_job.core.tensor_meta import TensorMeta
from reshard_job.core.topology import Topology, optimizer_base
from reshard_job.errors import PlanError
from reshard_job.plan.model import BUFFER_PREFIXES, ParamSource
from reshard_job.text import bounded_list, quoted, rank_ranges, shorten

PATH_SHOWN = 400  # characters of a file path a message shows (whole, for one to paste; cut only when absurd)


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


def identical_mismatch(name: str, ranks: Iterable[int], strategy: str | None = None) -> PlanError:
    """The error for a tensor of ``Plan.identical`` whose bytes differ across the given ranks."""
    ranks = sorted(ranks)
    where = f" {shorten(strategy)}" if strategy else ""
    return PlanError(
        f"parameter {quoted(name)} differs between source ranks {rank_ranges(ranks, ', ')}, which the source "
        f"strategy{where} says hold the same data (replicas of one block, or a tensor it does not lay out and "
        f"so every rank holds whole); {REMEDY}"
    )


def show_block(layout: Layout, block: tuple[int, ...], global_shape: tuple[int, ...]) -> str:
    """A block as element ranges of the global tensor: ``[0:8, 16:32]``."""
    parts = []
    for b, n, d in zip(block, global_shape, layout.divisors):
        unit = n // d
        parts.append(f"{b * unit}:{(b + 1) * unit}")
    return shorten("[" + ", ".join(parts) + "]", 120)


def check_source_ranks(src: Topology, index: Mapping[int, object]) -> None:
    """Every source file's rank is one the source strategy describes."""
    devices = src.devices
    outside = [r for r in index if not (isinstance(r, int) and 0 <= r < devices)]
    if outside:
        raise PlanError(
            f"source rank{'s' if len(outside) > 1 else ''} {bounded_list(sorted(outside, key=str))} "
            f"lie{'' if len(outside) > 1 else 's'} outside the {devices} rank(s) the source strategy "
            f"describes (0..{devices - 1})"
        )


def check_names_overlap(src: Topology, holders: Mapping[str, tuple[int, ...]]) -> None:
    """A source strategy none of whose parameters is in the checkpoints belongs to another
    network: every tensor would be taken whole although each rank holds a slice."""
    if not src.layouts or not holders or any(name in src.layouts for name in holders):
        return
    first_laid = next(iter(src.layouts))
    first_held = next(iter(holders))
    raise PlanError(
        f"none of the {len(src.layouts)} parameter(s) the source strategy {shorten(src.source)} lays "
        f"out (e.g. {quoted(first_laid)}) is in the source checkpoints, which hold {len(holders)} others "
        f"(e.g. {quoted(first_held)}); {REMEDY}"
    )


LAID_OUT_AT_LEAST = 0.5  # of the parameters a target strategy must lay out to be this network's


def laid_out_by_a_strategy(ps: ParamSource, src: Topology) -> bool:
    """Whether a parameter is one a strategy of its network lays out: one the source strategy lays
    out, or, for a source without one (a whole model), any tensor of more than one element (a
    scalar such as ``global_step`` has one layout only, and strategies leave it out)."""
    if src.layouts:
        return ps.in_src
    return ps.meta is not None and ps.meta.kind == "tensor" and prod(ps.meta.shape) > 1


def check_target_network(src: Topology, dst: Topology, resolved: Mapping[str, ParamSource]) -> None:
    """A target strategy laying out none, or only a small part, of the checkpoints' parameters
    belongs to another network: the weights would be left out (or kept whole in the wrong layout)."""
    if not dst.layouts:
        return
    held = [name for name in resolved if not name.startswith(BUFFER_PREFIXES)]
    if not held:
        return
    source = f"the source strategy {shorten(src.source, PATH_SHOWN)}" if src.source else "the source checkpoints"
    if any(resolved[name].in_dst for name in held):
        check_target_needs(src, dst, resolved, source)
        _check_laid_out_enough(src, dst, resolved, held, source)
        return
    raise PlanError(
        f"the target strategy {shorten(dst.source, PATH_SHOWN)} lays out none of the {len(held)} parameter(s) of "
        f"{source} (e.g. {quoted(held[0])}) but {len(dst.layouts)} others (e.g. "
        f"{quoted(next(iter(dst.layouts)))}): it is the strategy of another network; was target.strategy "
        "compiled for this model?"
    )


def _check_laid_out_enough(src: Topology, dst: Topology, resolved: Mapping[str, ParamSource], held: list[str],
                           source: str) -> None:
    """Fewer than half of the parameters a strategy of this network lays out: the strategy of
    another network that shares a few names, or of a part of this one (which target.include selects)."""
    wanted = [name for name in held if laid_out_by_a_strategy(resolved[name], src)]
    covered = sum(resolved[name].in_dst for name in wanted)
    if not wanted or covered >= LAID_OUT_AT_LEAST * len(wanted):
        return
    lacking = [name for name in wanted if not resolved[name].in_dst]
    raise PlanError(
        f"the target strategy {shorten(dst.source, PATH_SHOWN)} lays out only {covered} of the {len(wanted)} "
        f"parameter(s) of {source} (not {', '.join(quoted(n, 60) for n in lacking[:3])}"
        f"{', ...' if len(lacking) > 3 else ''}): it is the strategy of another network, or of a part of this one; "
        "was target.strategy compiled for this model? (target.include/target.exclude convert a part)"
    )


def target_only_states(src: Topology, dst: Topology, resolved: Mapping[str, ParamSource]) -> list[str]:
    """Optimizer states and pipeline buffers the target strategy lays out that no source holds: the
    outputs cannot hold them (the target network starts them afresh), which is said, not silent."""
    return [name for name in dst.layouts if name not in resolved and name not in src.layouts
            and (optimizer_base(name) is not None or name.startswith(BUFFER_PREFIXES))]


def check_even_split(rec: ParamLayout, name: str, strategy: str | None) -> None:
    """A layout MindSpore splits unevenly by hand (``param_split_shape`` of unequal slices, its
    ``indices_offset``) or by field (``field``): slices this tool does not cut, refused rather than
    cut evenly (which wrote every rank an even slice, exit 0)."""
    uneven = len(set(rec.param_split_shape)) > 1
    if not uneven and not rec.field:
        return
    what = (f"an uneven split (param_split_shape {bounded_list(rec.param_split_shape)}, indices_offset "
            f"{bounded_list(rec.indices_offset)})" if uneven else f"a field split (field {rec.field})")
    raise PlanError(f"parameter {quoted(name)}: {shorten(strategy or 'the strategy', PATH_SHOWN)} lays it out with "
                    f"{what}, which is not supported: only even slices of the tensor map are")


def check_target_needs(src: Topology, dst: Topology, resolved: Mapping[str, ParamSource], source: str) -> None:
    """The target strategy lays out no weight the sources lack: its network would load outputs
    missing them. Optimizer states are not counted (a target may train from weights only)."""
    lacking = [name for name in dst.layouts
               if name not in resolved and name not in src.layouts and optimizer_base(name) is None]
    if lacking:
        holders = "the source checkpoints do not hold" if not src.source else f"neither {source} nor the checkpoints hold"
        raise PlanError(
            f"the target strategy {shorten(dst.source, PATH_SHOWN)} lays out {len(lacking)} parameter(s) that "
            f"{holders}: {', '.join(quoted(n, 60) for n in lacking[:5])}"
            f"{', ...' if len(lacking) > 5 else ''}; the outputs would lack them (was target.strategy compiled "
            "for this model?)"
        )


def check_placement(name: str, holders: tuple[int, ...], stages: tuple[int, ...], stage_devices: int) -> None:
    """A laid-out parameter sits only in ranks of the stages the strategy places it in."""
    F = stage_devices
    for g in holders:
        if g // F not in stages:
            raise PlanError(
                f"parameter {quoted(name)} is in the checkpoint of source rank {g} (pipeline stage {g // F}), "
                f"but the source strategy places it in stage{'s' if len(stages) > 1 else ''} "
                f"{bounded_list(stages)} only; was source.strategy saved with these checkpoints, with the right "
                "stage number in each per-stage file?"
            )


def check_shared_layout(name: str, stages: tuple[int, int], layout: Layout, other: Layout) -> None:
    """A parameter shared by two pipeline stages is laid out alike in both (it is read once)."""
    if other.blocks_key != layout.blocks_key:
        raise PlanError(
            f"parameter {quoted(name)} is shared by pipeline stages {stages[0]} and {stages[1]} with different "
            f"layouts ({layout.describe()}; {other.describe()}); a parameter shared by stages is read once "
            "and needs one layout"
        )


def check_tensor_shape(name: str, meta: TensorMeta, layout: Layout, global_shape: tuple[int, ...],
                       rec: ParamLayout, follows: str | None) -> None:
    """The global shape a local shape and layout give is the strategy's recorded ``tensor_shape``
    (not checked for an optimizer state laid out like its parameter, whose record it is)."""
    if rec.tensor_shape is None:
        return
    if tuple(rec.tensor_shape) != global_shape and follows is None:
        raise PlanError(
            f"parameter {quoted(name)}: local shape {list(meta.shape)} with layout {layout.describe()} gives "
            f"global shape {list(global_shape)}, but the strategy says {bounded_list(rec.tensor_shape)}; "
            f"{REMEDY}"
        )


def check_sliceable(name: str, meta: TensorMeta, layout: Layout) -> None:
    if not dtypes.BY_NAME[meta.dtype].sliceable and layout.is_sharded:
        raise PlanError(f"parameter {quoted(name)}: {meta.dtype} tensors are packed and cannot be resharded")


def check_coverage(name: str, layout: Layout, global_shape: tuple[int, ...], holders: tuple[int, ...],
                   stages: tuple[int, ...], stage_devices: int, stage_files: Mapping[int, tuple[int, ...]]) -> None:
    """With some ranks lacking the parameter (MindSpore's ``remove_redundancy`` keeps each
    distinct block on one rank), every block must still be held by some rank. A block no file
    holds is refused when every file of its stages is at hand (otherwise an absent file may
    hold it, and the plan names the files it needs)."""
    F = stage_devices
    held = {layout.block(g % F) for g in holders}
    total = prod(layout.divisors)
    if len(held) < total and all(len(stage_files.get(s, ())) == F for s in stages):
        block = next(b for b in itertools.product(*(range(d) for d in layout.divisors)) if b not in held)
        would = sorted({s * F + layout.rank_holding(c, block) for s in stages for c in range(min(layout.chunks, 4))})
        raise PlanError(
            f"parameter {quoted(name)}: no source rank holds its block {show_block(layout, block, global_shape)} "
            f"({len(held)} of its {total} blocks are held); rank{'s' if len(would) > 1 else ''} "
            f"{bounded_list(would)} should; use the files of one save, saved with this strategy"
        )


def check_same_metas(index: Mapping[int, Mapping[str, TensorMeta]], name: str, ranks: Sequence[int],
                     meta: TensorMeta, *, laid_out: bool) -> None:
    """Every rank holding the parameter holds it with one dtype and one shape."""
    metas = [index[r][name] for r in ranks]
    if metas.count(meta) == len(metas):
        return
    for r in ranks:
        other = index[r][name]
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


def check_optimizer_states(resolved: Mapping[str, ParamSource]) -> None:
    """An optimizer state holds a tensor of its parameter's shape. Where the strategy lays out
    both, their global shapes must agree: optimizer-shard fields missing from (or added to) one
    of them make a rank's slice look like a different share of the tensor."""
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
