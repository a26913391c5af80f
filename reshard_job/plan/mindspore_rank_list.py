"""MindSpore 2.10's own ``rank_list_for_transform``: the source ranks its converter requires.

Our rank list (``rank_list.source_ranks_for``) is what a plan reads. MindSpore's converter gathers
whole groups of ranks along device axes before slicing, so its ``transform_checkpoint_by_rank``
requires more files and refuses ours ("The checkpoint file of rank 3 is missing"). This module
gives MindSpore's list, from the strategies alone, following the algorithm of
``spec/resharding-semantics.md`` §7 (matched against MindSpore 2.10 in ~6 200 queries there):

1. The source list keeps the lowest stage's layout of a parameter shared by stages; the target
   list picks per parameter the layout of the target rank's stage (stage 0, else the last later
   one). Parameters the target stage does not hold leave both lists.
2. Per parameter in both lists, both layouts are rebuilt flat the way MindSpore's converter
   builds them (optimizer sharding included, ``_flat_layout``), their device counts equalised,
   and their device matrices refined into common axes. Source axes along which the target
   layout steps differently are gathered; the source ranks that agree with the target local
   rank on every other axis are needed.
3. The union over parameters is offered in every stage the source list holds, descending.

Pure code over ``Topology`` (layouts as recorded); nothing enumerates a stage's devices beyond
the ranks returned.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import lru_cache
from math import prod

from reshard_job.core.strategy_model import ParamLayout
from reshard_job.core.topology import Topology
from reshard_job.errors import PlanError
from reshard_job.text import bounded_list, quoted


@dataclass(frozen=True)
class FlatLayout:
    """A layout as MindSpore's converter builds it: one device axis (or -1) per sub-dimension."""

    dev: tuple[int, ...]  # device matrix
    tmap: tuple[int, ...]  # per sub-dimension: device axis counted from the right, or -1
    shape: tuple[int, ...]  # a row-major refinement of the global shape


def _entries(pl: ParamLayout) -> list[tuple[int, ...]]:
    """Per tensor dimension, its device axes (counted from the right), most significant first."""
    return [tuple(a for a in (e if isinstance(e, tuple) else (e,)) if a != -1) for e in pl.tensor_map]


def _axis_size(dev, axis: int) -> int:
    return dev[len(dev) - 1 - axis]


def _expand(dev: list[int], entries: list[tuple[int, ...]], shape: list[int]) -> FlatLayout:
    """Multi-axis dimensions become sub-dimensions [d(a1), ..., d(a(m-1)), rest] (first axis outer)."""
    tmap, sizes = [], []
    for axes, size in zip(entries, shape):
        if not axes:
            tmap.append(-1)
            sizes.append(size)
            continue
        for a in axes[:-1]:
            d = _axis_size(dev, a)
            tmap.append(a)
            sizes.append(d)
            size //= d
        tmap.append(axes[-1])
        sizes.append(size)
    return FlatLayout(tuple(dev), tuple(tmap), tuple(sizes))


def _optimizer_size(pl: ParamLayout) -> tuple[list[tuple[int, ...]], list[int], int]:
    """(per dimension its axes, split factors, effective optimizer shard size or 0) of a layout."""
    dev = [int(d) for d in pl.dev_matrix]
    entries = _entries(pl)
    split = [prod(_axis_size(dev, a) for a in axes) for axes in entries]
    step, size = pl.opt_shard_step, pl.opt_shard_size
    k = (prod(dev) // prod(split) if size == -1 else size) if step and size and entries else 0
    return entries, split, max(k, 0)


def _origin_shape(src: ParamLayout, fake: int) -> list[int]:
    """The global shape MindSpore infers from a source slice of `fake` in every dimension (§5.3)."""
    _, split, k = _optimizer_size(src)
    shape = [fake * s for s in split]
    if k and shape:
        shape[0] *= k
    return shape


def _flat_layout(pl: ParamLayout, origin: list[int], name: str) -> FlatLayout:
    """MindSpore's layout of a parameter of global shape `origin` (§5.4)."""
    dev = [int(d) for d in pl.dev_matrix]
    entries, split, k = _optimizer_size(pl)
    step = pl.opt_shard_step
    shape = list(origin)
    if not k:
        return _expand(dev, entries, shape)
    used = {len(dev) - 1 - a for axes in entries for a in axes}
    repeated = [p for p in range(len(dev)) if p not in used and dev[p] > 1]
    where = f"parameter {quoted(name)}"
    if not repeated and k == 1:  # one optimizer shard is no sharding (MindSpore would raise here)
        return _expand(dev, entries, shape)
    if not repeated:
        raise PlanError(f"{where}: device matrix {bounded_list(dev)} has no replicated axis for its optimizer sharding")
    if len(repeated) == 1 and prod(dev[repeated[0] + 1:]) != step:
        raise PlanError(f"{where}: optimizer shard step {step} is not the model-parallel size "
                        f"{prod(dev[repeated[0] + 1:])} (MindSpore refuses this layout)")
    flat = not pl.nested
    if flat and (repeated == [0] or len(repeated) == len(dev)):
        return _fast_path(dev, split, step, k, shape)
    return _expand(*_optimizer_axes(dev, entries, shape, split[0], repeated, k, where))


def _fast_path(dev: list[int], split: list[int], step: int, k: int, shape: list[int]) -> FlatLayout:
    """MindSpore's shortcut when only the leading axis (or every axis) replicates: each tensor
    dimension on its own axis, dimension 0 most significant, the optimizer axis just left of them."""
    nd = len(split)
    replicas = prod(dev) // (step * k)
    new_dev = ([replicas] if replicas > 1 else []) + [k] + split
    dims = [nd - 1 - i if s > 1 else -1 for i, s in enumerate(split)]
    tmap = [dims[0], nd] + dims[1:]
    return FlatLayout(tuple(new_dev), tuple(tmap), (split[0], shape[0] // split[0], *shape[1:]))


def _optimizer_axes(dev: list[int], entries: list[tuple[int, ...]], shape: list[int], split0: int,
                    repeated: list[int], k: int, where: str):
    """The general rule (training's own): the innermost replicated axes, split where only part of
    one is needed, cut dimension 0 inside its model-parallel block."""
    dev, entries = list(dev), [list(e) for e in entries]
    rem, chosen = k, []
    for p in reversed(repeated):
        axis = len(dev) - 1 - p
        z = dev[p]
        if rem < z:
            if z % rem:
                raise PlanError(f"{where}: optimizer shard size {k} does not divide device axis {axis} of size {z}")
            dev[p:p + 1] = [z // rem, rem]
            entries = [[a + 1 if a >= axis else a for a in e] for e in entries]
            z = rem
        if rem % z:
            raise PlanError(f"{where}: optimizer shard size {k} does not fit the replicated device axes")
        rem //= z
        chosen.append(axis)
        if rem == 1:
            break
    if rem != 1:
        raise PlanError(f"{where}: optimizer shard size {k} exceeds the replicated device axes")
    chosen.sort(reverse=True)  # left to right
    sizes = [_axis_size(dev, a) for a in chosen]
    rest = shape[0] // split0 // prod(sizes[:-1])
    new_entries = [tuple(entries[0])] + [(a,) for a in chosen] + [tuple(e) for e in entries[1:]]
    new_shape = [split0] + sizes[:-1] + [rest] + shape[1:]
    return dev, new_entries, new_shape


def _equalise(f: FlatLayout, t: FlatLayout) -> tuple[FlatLayout, FlatLayout]:
    """The smaller device matrix gets the ratio prepended (MindSpore's ``_construct_from_to_tensor_layout``)."""
    nf, nt = prod(f.dev), prod(t.dev)
    if nf % nt and nt % nf:
        raise PlanError(f"cannot compare layouts over {nf} and {nt} devices (neither divides the other)")
    if nf > nt:
        t = FlatLayout((nf // nt,) + t.dev, t.tmap, t.shape)
    elif nt > nf:
        f = FlatLayout((nt // nf,) + f.dev, f.tmap, f.shape)
    return f, t


def _weights(dev: tuple[int, ...]) -> list[int]:
    return [prod(dev[p + 1:]) for p in range(len(dev))]


def _strides(layout: FlatLayout, axes: list[tuple[int, int]]) -> dict[int, int]:
    """For each refined axis (weight, size) inside a used position: how many flat elements one step
    along it moves in the tensor."""
    out = {}
    n, weights = len(layout.dev), _weights(layout.dev)
    for j, a in enumerate(layout.tmap):
        if a == -1 or layout.dev[n - 1 - a] == 1:
            continue
        p = n - 1 - a
        W, d = weights[p], layout.dev[p]
        tau = prod(layout.shape[j + 1:])
        for w, z in axes:
            if z > 1 and W <= w < W * d:
                out[w] = (w // W) * tau * (layout.shape[j] // d)
    return out


@lru_cache(maxsize=1024)
def _ranks_agreeing(r: int, kept: tuple[tuple[int, int], ...], varied: tuple[tuple[int, int], ...],
                    F: int) -> frozenset[int]:
    """{s mod F : s agrees with r on every kept axis}, the other axes taking every value: as many
    ranks as the answer may hold, at most the stage's (remembered: layouts share few such splits)."""
    base = sum(((r // w) % z) * w for w, z in kept)
    return frozenset((base + sum(c * w for c, (w, _) in zip(digits, varied))) % F
                     for digits in itertools.product(*(range(z) for _, z in varied)))


def needed_local_ranks(src: ParamLayout, dst: ParamLayout, r: int, F: int, name: str = "?") -> frozenset[int]:
    """The source local ranks MindSpore requires for target local rank `r` of one parameter (§7.3)."""
    if len(src.tensor_map) != len(dst.tensor_map):
        raise PlanError(f"parameter {quoted(name)}: source tensor map {list(src.tensor_map)} and target tensor map "
                        f"{list(dst.tensor_map)} have different lengths")
    origin = _origin_shape(src, max(prod(src.dev_matrix), prod(dst.dev_matrix)))
    f, t = _equalise(_flat_layout(src, origin, name), _flat_layout(dst, origin, name))
    cuts = sorted({prod(f.dev[p:]) for p in range(len(f.dev) + 1)} | {prod(t.dev[p:]) for p in range(len(t.dev) + 1)})
    if any(b % a for a, b in zip(cuts, cuts[1:])):
        # device matrices that refine no common chain: every axis the source uses is gathered
        n, weights = len(f.dev), _weights(f.dev)
        used = {n - 1 - a for a in f.tmap if a != -1}
        axes = [(weights[p], f.dev[p]) for p in range(n) if f.dev[p] > 1]
        kept = [(weights[p], f.dev[p]) for p in range(n) if f.dev[p] > 1 and p not in used]
        return _ranks_agreeing(r, tuple(kept), tuple(a for a in axes if a not in kept), F)
    axes = [(w, b // w) for w, b in zip(cuts, cuts[1:]) if b // w > 1]
    s_strides, t_strides = _strides(f, axes), _strides(t, axes)
    gathered = {w for w, stride in s_strides.items() if t_strides.get(w) != stride}
    return _ranks_agreeing(r, tuple(a for a in axes if a[0] not in gathered), tuple(a for a in axes if a[0] in gathered),
                           F)


def _target_layout(per_stage: dict[int, ParamLayout], rank_id: int) -> ParamLayout:
    """The layout MindSpore's target list keeps for a parameter: stage 0's for ranks of the first
    stage, else the last one of a later stage."""
    stages = list(per_stage)
    chosen = per_stage[stages[0]]
    for s in stages:
        lay = per_stage[s]
        first = rank_id // max(1, prod(lay.dev_matrix)) == 0
        if (first and s == 0) or (not first and s > 0):
            chosen = lay
    return chosen


def mindspore_source_ranks(src: Topology, dst: Topology | None, rank_id: int) -> list[int]:
    """MindSpore 2.10's ``rank_list_for_transform(rank_id, src, dst)``, descending (§7)."""
    src_list = {name: (per[min(per)], sorted(per)) for name, per in src.layouts.items()}
    dst_list: dict[str, ParamLayout] | None = None
    if dst is not None:
        dst_list = {name: _target_layout(per, rank_id) for name, per in dst.layouts.items()}
        T = prod(next(iter(dst_list.values())).dev_matrix)
        t_stage = rank_id // T
        for name in [n for n in dst_list if t_stage not in dst.layouts[n]]:
            del dst_list[name]
            src_list.pop(name, None)
    if not src_list:
        return []
    F = prod(next(iter(src_list.values()))[0].dev_matrix)
    T = prod(next(iter(dst_list.values())).dev_matrix) if dst_list else 1
    r = rank_id % T if T > 1 else rank_id  # MindSpore takes rank_id itself when T is 1
    local: set[int] = set()
    seen: set[tuple] = set()
    for name, (s_layout, _) in src_list.items():
        if dst_list is not None and name not in dst_list:
            continue
        t_layout = dst_list[name] if dst_list is not None else ParamLayout((1,), (-1,) * len(s_layout.tensor_map))
        key = (s_layout, t_layout)
        if key not in seen:
            seen.add(key)
            local |= needed_local_ranks(s_layout, t_layout, r, F, name)
            if len(local) >= F:  # every rank of the stage already: the rest cannot add any
                break
    stages = {s for _, per in src_list.values() for s in per}
    return sorted({s * F + x for s in stages for x in local}, reverse=True)
