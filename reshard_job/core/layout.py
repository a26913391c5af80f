"""Layout math: which box of a parameter's global tensor each rank of a pipeline stage holds.

Pure code, no I/O. The rules are those of training (``spec/resharding-semantics.md`` §1–§3):

* a rank's coordinates are the mixed-radix digits of its local rank over the device matrix, the
  last position varying fastest;
* a tensor-map value ``m`` names device-matrix position ``n-1-m`` (axes count from the right); a
  multi-axis entry lists positions most significant first; the dimension is cut into as many equal
  blocks as the product of its axes' sizes;
* device positions that no dimension uses replicate the block; with optimizer sharding of size
  ``k`` the replicas (ordered by their coordinates on the unused positions, left to right) form
  chunks of ``k`` consecutive ranks, and rank ``u mod k`` of a chunk holds part ``u mod k`` of its
  model-parallel block of dimension 0 (model-parallel index outer, optimizer index inner).

These are the training-time semantics, so they are what a checkpoint written by training holds.
MindSpore's converter reconstructs optimizer-sharded layouts by a "fast path" that disagrees with
them for non-canonical tensor maps (spec §5.4, §6.3); we always follow the training semantics.

Boxes are computed in *units*: dimension ``i`` of a layout is cut into ``divisor[i]`` equal parts
(the split factor, times ``k`` on dimension 0), so a rank's block is one unit index per dimension.
Working in units keeps the planning independent of the actual tensor sizes, which lets the same
copy pattern serve every parameter with the same pair of layouts.

Cost: every query is arithmetic on one rank's coordinates, O(number of device axes); nothing
enumerates the devices of a stage. The inverse query (which rank of an optimizer chunk holds a
given block, ``rank_holding``) is computed from the block's digits, so a declared device matrix
of a million devices costs no more than one of eight. Device matrices are bounded by
``MAX_DEVICES`` devices and ``MAX_AXES`` axes, checked before anything else.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from functools import cached_property, lru_cache
from math import comb, prod

from reshard_job.errors import LayoutError
from reshard_job.core.boxes import Box
from reshard_job.core.strategy_model import MAX_AXES, MAX_DEVICES, ParamLayout
from reshard_job.text import bounded_list, quoted, shorten


def coords(rank: int, dev_matrix: tuple[int, ...]) -> tuple[int, ...]:
    """Mixed-radix digits of `rank` over `dev_matrix`, last position fastest."""
    out = [0] * len(dev_matrix)
    for p in range(len(dev_matrix) - 1, -1, -1):
        d = dev_matrix[p]
        out[p] = rank % d
        rank //= d
    return tuple(out)


def mixed_radix(digits: list[int], radices: list[int]) -> int:
    value = 0
    for digit, radix in zip(digits, radices):
        value = value * radix + digit
    return value


@dataclass(frozen=True)
class Layout:
    """A parameter's placement over the devices of one pipeline stage.

    `dim_axes[i]` lists the device-matrix positions (indices from the left) that split tensor
    dimension `i`, most significant first; empty means not split. `opt_shard` is the number of
    optimizer-parallel parts of dimension 0 (1 when there is no optimizer sharding).
    """

    dev_matrix: tuple[int, ...]
    dim_axes: tuple[tuple[int, ...], ...]
    opt_shard: int = 1

    # ------------------------------------------------------------------------------ construction
    @staticmethod
    def replicated(ndim: int, devices: int = 1) -> "Layout":
        """Every rank holds the whole tensor (no strategy, or a fully replicated parameter)."""
        return _replicated(ndim, devices)

    @staticmethod
    def from_recorded(pl: ParamLayout, ndim: int, stage_devices: int | None = None, name: str = "?") -> "Layout":
        """Normalise a layout as recorded in a strategy file, validating it against the tensor's rank.

        If the parameter's device matrix covers fewer devices than the stage (`stage_devices`), it is
        extended on the left by a replication factor, as MindSpore does when equalising layouts.
        Most parameters share a few layouts, so valid ones are built once and shared (which also
        shares their cached rank tables); an invalid one is rebuilt to name the parameter.
        """
        if len(pl.tensor_map) != ndim and is_flattened(pl):  # a JSON multi-axis map (see unflatten)
            pl = unflatten(pl, ndim, stage_devices=stage_devices, name=name)
        try:
            return _shared_layout(pl, ndim, stage_devices)
        except LayoutError:
            return Layout._build(pl, ndim, stage_devices, name)

    @staticmethod
    def _build(pl: ParamLayout, ndim: int, stage_devices: int | None, name: str) -> "Layout":
        where = f"parameter {quoted(name)}"
        dev, devices = _device_matrix(pl, where)
        dim_axes = _dim_axes(pl, ndim, dev, where)
        if stage_devices is not None and devices != stage_devices:
            if devices > stage_devices or stage_devices % devices:
                raise LayoutError(
                    f"{where}: device matrix {bounded_list(dev)} covers {devices} devices, "
                    f"which does not divide the {stage_devices} devices of its stage"
                )
            factor = stage_devices // devices
            dev = (factor,) + dev  # leading replication factor; positions shift right by one
            dim_axes = [tuple(p + 1 for p in axes) for axes in dim_axes]
            devices = stage_devices
        split = prod(dev[p] for axes in dim_axes for p in axes)
        k = _optimizer_shard(pl, ndim, devices // split, dev, where)
        return Layout(dev, tuple(dim_axes), k)

    def __hash__(self) -> int:
        return self._hash

    @cached_property
    def _hash(self) -> int:
        # layouts key the planner's caches, once per parameter and target rank: hash them once
        return hash((self.dev_matrix, self.dim_axes, self.opt_shard))

    # ------------------------------------------------------------------------------ properties
    @property
    def ndim(self) -> int:
        return len(self.dim_axes)

    @cached_property
    def devices(self) -> int:
        return prod(self.dev_matrix)

    @cached_property
    def split(self) -> tuple[int, ...]:
        """Model-parallel split factor of each dimension."""
        return tuple(prod(self.dev_matrix[p] for p in axes) for axes in self.dim_axes)

    @cached_property
    def divisors(self) -> tuple[int, ...]:
        """Number of equal units each dimension is cut into (dimension 0 includes optimizer parts)."""
        if not self.dim_axes:
            return ()
        return (self.split[0] * self.opt_shard,) + self.split[1:]

    @cached_property
    def unused_positions(self) -> tuple[int, ...]:
        used = {p for axes in self.dim_axes for p in axes}
        return tuple(p for p in range(len(self.dev_matrix)) if p not in used)

    @property
    def replicas(self) -> int:
        return self.devices // prod(self.split) if self.dim_axes else self.devices

    @cached_property
    def is_sharded(self) -> bool:
        return any(d > 1 for d in self.divisors)

    @cached_property
    def _origin(self) -> tuple[int, ...]:
        return (0,) * len(self.dim_axes)

    # ------------------------------------------------------------------------------ rank math
    def replica_index(self, rank: int) -> int:
        """u(rank): position of the rank among the replicas of its block (unused coords, left first)."""
        c = coords(rank, self.dev_matrix)
        ps = self.unused_positions
        return mixed_radix([c[p] for p in ps], [self.dev_matrix[p] for p in ps])

    def chunk(self, rank: int) -> int:
        """Which optimizer chunk (set of ranks that together hold one full copy) the rank is in."""
        return self.replica_index(rank) // self.opt_shard

    def block(self, rank: int) -> tuple[int, ...]:
        """The rank's unit index in every dimension."""
        if not self.is_sharded:
            return self._origin
        c = coords(rank, self.dev_matrix)
        out = [mixed_radix([c[p] for p in axes], [self.dev_matrix[p] for p in axes]) for axes in self.dim_axes]
        if out and self.opt_shard > 1:
            out[0] = out[0] * self.opt_shard + self.replica_index(rank) % self.opt_shard
        return tuple(out)

    def check_shape(self, global_shape: tuple[int, ...], name: str = "?") -> None:
        for i, (n, d) in enumerate(zip(global_shape, self.divisors)):
            if n % d:
                raise LayoutError(
                    f"parameter {quoted(name)}: dimension {i} of size {n} cannot be split into {d} equal parts"
                )

    def local_shape(self, global_shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(n // d for n, d in zip(global_shape, self.divisors))

    def global_shape(self, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(n * d for n, d in zip(local_shape, self.divisors))

    def box(self, rank: int, global_shape: tuple[int, ...]) -> Box:
        """The box of the global tensor that `rank` (local to the stage) holds."""
        unit = [n // d for n, d in zip(global_shape, self.divisors)]
        return tuple((b * u, (b + 1) * u) for b, u in zip(self.block(rank), unit))

    @cached_property
    def _weights(self) -> tuple[int, ...]:
        """W_p = prod(dev_matrix[p+1:]): how far one step on position p moves the rank."""
        out, w = [], 1
        for d in reversed(self.dev_matrix):
            out.append(w)
            w *= d
        return tuple(reversed(out))

    def rank_holding(self, chunk: int, block: tuple[int, ...]) -> int:
        """The rank of optimizer chunk `chunk` that holds `block` (one unit index per dimension).

        The inverse of ``(chunk(q), block(q))``, computed from the digits: the block's model-parallel
        index of each dimension gives the coordinates on that dimension's positions, and the
        replica index ``chunk * k + part`` (``part`` = the optimizer part of dimension 0) gives the
        coordinates on the unused positions. The blocks of one chunk tile the tensor, so every
        block has exactly one holder in every chunk.
        """
        k = self.opt_shard
        digits = [0] * len(self.dev_matrix)
        part = 0
        for i, axes in enumerate(self.dim_axes):
            b = block[i]
            if i == 0 and k > 1:
                b, part = divmod(b, k)
            for p in reversed(axes):
                b, digits[p] = divmod(b, self.dev_matrix[p])
        u = chunk * k + part
        for p in reversed(self.unused_positions):
            u, digits[p] = divmod(u, self.dev_matrix[p])
        return sum(c * w for c, w in zip(digits, self._weights))

    @cached_property
    def blocks_key(self) -> tuple:
        """What decides the block every rank holds: equal for layouts whose ranks hold the same
        blocks (they may differ in axes of size 1, or in how the replicas are ordered)."""
        weights = self._weights
        dims = tuple(tuple((self.dev_matrix[p], weights[p]) for p in axes if self.dev_matrix[p] > 1)
                     for axes in self.dim_axes)
        unused = tuple((self.dev_matrix[p], weights[p]) for p in self.unused_positions if self.dev_matrix[p] > 1)
        return self.devices, dims, self.opt_shard, unused if self.opt_shard > 1 else ()

    @property
    def chunks(self) -> int:
        """Number of optimizer chunks: sets of ranks that together hold one full copy."""
        return self.replicas // self.opt_shard

    def describe(self) -> str:
        axes = [("*" if not a else "(" + ",".join(str(len(self.dev_matrix) - 1 - p) for p in a) + ")") for a in self.dim_axes]
        opt = f", optimizer shards {self.opt_shard}" if self.opt_shard > 1 else ""
        return shorten(f"dev {list(self.dev_matrix)} map [{', '.join(axes)}]{opt}", 160)


@lru_cache(maxsize=256)
def _replicated(ndim: int, devices: int) -> Layout:
    return Layout((devices,), tuple(() for _ in range(ndim)), 1)


@lru_cache(maxsize=4096)
def _shared_layout(pl: ParamLayout, ndim: int, stage_devices: int | None) -> Layout:
    return Layout._build(pl, ndim, stage_devices, "?")


def _device_matrix(pl: ParamLayout, where: str) -> tuple[tuple[int, ...], int]:
    """(device matrix, its device count) of a recorded layout, within ``MAX_AXES`` and ``MAX_DEVICES``."""
    if not pl.dev_matrix or len(pl.dev_matrix) > MAX_AXES or any(int(d) < 1 for d in pl.dev_matrix):
        raise LayoutError(f"{where}: device matrix {bounded_list(pl.dev_matrix)} must be 1 to {MAX_AXES} "
                          "positive sizes")
    dev = tuple(int(d) for d in pl.dev_matrix)
    devices = 1
    for d in dev:  # checked as it grows: a hostile product is never computed in full
        devices *= d
        if devices > MAX_DEVICES:
            raise LayoutError(f"{where}: device matrix {bounded_list(dev)} declares more than "
                              f"{MAX_DEVICES} devices")
    return dev, devices


def _dim_axes(pl: ParamLayout, ndim: int, dev: tuple[int, ...], where: str) -> list[tuple[int, ...]]:
    """Per tensor dimension, the device-matrix positions splitting it (each position used once)."""
    if len(pl.tensor_map) != ndim:
        raise LayoutError(
            f"{where}: tensor map {_show_map(pl.tensor_map)} has {len(pl.tensor_map)} entries "
            f"but the checkpoint tensor has {ndim} dimension(s)"
        )
    n = len(dev)
    used: set[int] = set()
    dim_axes = []
    for entry in pl.tensor_map:
        values = entry if isinstance(entry, tuple) else (entry,)
        positions = []
        for m in values:
            if m == -1:
                continue
            if not 0 <= m < n:
                raise LayoutError(
                    f"{where}: tensor map {_show_map(pl.tensor_map)} names device axis {m}, "
                    f"but device matrix {bounded_list(dev)} has axes 0..{n - 1}"
                )
            p = n - 1 - m
            if p in used:
                raise LayoutError(f"{where}: device axis {m} splits more than one dimension")
            used.add(p)
            positions.append(p)
        dim_axes.append(tuple(positions))
    return dim_axes


def _optimizer_shard(pl: ParamLayout, ndim: int, replicas: int, dev: tuple[int, ...], where: str) -> int:
    """The number of optimizer-parallel parts of dimension 0 (1 without optimizer sharding)."""
    step, size = pl.opt_shard_step, pl.opt_shard_size
    if size not in (0, 1) and step != 0:
        if ndim == 0:
            raise LayoutError(f"{where}: optimizer sharding on a scalar")
        k = replicas if size == -1 else size
        if k < 1 or replicas % k:
            raise LayoutError(
                f"{where}: optimizer shard size {size} does not divide the {replicas} replicas "
                f"of device matrix {bounded_list(dev)} with tensor map {_show_map(pl.tensor_map)}"
            )
        return k
    if size not in (0, 1, -1) and step == 0:
        raise LayoutError(
            f"{where}: optimizer shard size {size} with step 0 is inconsistent "
            "(MindSpore records both or neither)"
        )
    return 1


def _show_map(tensor_map) -> str:
    return shorten("[" + ", ".join(str(list(e)) if isinstance(e, tuple) else str(e) for e in tensor_map) + "]", 120)


# ============================================================================ JSON's flattened maps
#
# MindSpore's JSON writer records a dimension split over several device axes as several entries:
# the dimension becomes sub-dimensions [d(a1), ..., d(a(m-1)), rest] mapped to [a1, ..., am], and
# `tensor_shape` holds the sub-dimensions' sizes (the "extended" shape). A [32, 64] weight laid
# out as (("dp", "mp"), None) is recorded `tensor_map [2, 0, -1]`, `tensor_shape [2, 16, 64]`,
# where the protobuf file of the same layout holds `[[2, 0], -1]`.
#
# Folding it back needs the tensor's number of dimensions, which only the checkpoint tells, so it
# is done where layouts meet tensors (the planner), not when the file is read. Two neighbouring
# entries may belong to one dimension only if both name an axis and the first one's size is its
# axis's size; among the ways to merge such neighbours into the right number of dimensions, the
# one whose global shape agrees with the checkpoint's local shape (or a known global shape) is
# taken. Distinct foldings that agree with the tensor equally are refused as ambiguous.

MAX_FOLDINGS = 4096  # ways to fold one map tried at most (a map has at most MAX_AXES entries)


def is_flattened(pl: ParamLayout) -> bool:
    """A JSON layout that may hold multi-axis dimensions as several entries (flat map, and one
    extended-shape entry per map entry)."""
    return (pl.tensor_shape is not None and len(pl.tensor_shape) == len(pl.tensor_map)
            and not any(isinstance(e, tuple) for e in pl.tensor_map))


def _mergeable(pl: ParamLayout) -> list[int]:
    """Boundaries j (between entries j and j+1) that may lie inside one multi-axis dimension."""
    dev, tm, ts = pl.dev_matrix, pl.tensor_map, pl.tensor_shape
    n = len(dev)
    return [j for j in range(len(tm) - 1)
            if tm[j] != -1 and tm[j + 1] != -1 and 0 <= tm[j] < n and ts[j] == dev[n - 1 - tm[j]]]


def folded_ndims(pl: ParamLayout) -> range:
    """The numbers of dimensions a recorded layout can describe: its map's length, and for a
    flattened JSON map down to as many merges as its neighbours allow."""
    if not is_flattened(pl):
        return range(len(pl.tensor_map), len(pl.tensor_map) + 1)
    return range(len(pl.tensor_map) - len(_mergeable(pl)), len(pl.tensor_map) + 1)


def unflatten(pl: ParamLayout, ndim: int, *, stage_devices: int | None = None, local_shape=None,
              global_shape=None, name: str = "?") -> ParamLayout:
    """The layout `pl` records, with a flattened JSON map folded into `ndim` dimensions (nested
    entries for multi-axis ones) and ``tensor_shape`` the tensor's global shape. Layouts that need
    no folding are returned as they are."""
    tm, ts = pl.tensor_map, pl.tensor_shape
    if len(tm) == ndim or not is_flattened(pl) or len(tm) < ndim:
        return pl
    where = f"parameter {quoted(name)}"
    merges = len(tm) - ndim
    eligible = _mergeable(pl)
    what = (f"{where}: JSON tensor map {_show_map(tm)} with tensor_shape {bounded_list(ts)} (multi-axis dimensions "
            f"recorded flattened)")
    if len(eligible) < merges or comb(len(eligible), merges) > MAX_FOLDINGS:
        raise LayoutError(f"{what} does not fold into the {ndim} dimension(s) of the checkpoint tensor")
    found: dict[tuple, ParamLayout] = {}
    for cut in itertools.combinations(eligible, merges):
        groups, start = [], 0
        for j in range(len(tm)):
            if j not in cut:
                groups.append(range(start, j + 1))
                start = j + 1
        entries = tuple(tuple(tm[j] for j in g) if len(g) > 1 else tm[g[0]] for g in groups)
        shape = tuple(prod(ts[j] for j in g) for g in groups)
        if global_shape is not None and tuple(global_shape) != shape:
            continue
        candidate = dataclasses.replace(pl, tensor_map=entries, tensor_shape=shape)
        try:
            layout = Layout.from_recorded(candidate, ndim, stage_devices, name)
        except LayoutError:
            continue
        if local_shape is not None and (layout.global_shape(tuple(local_shape)) != shape
                                        or any(n % d for n, d in zip(shape, layout.divisors))):
            continue
        found.setdefault((layout.blocks_key, shape), candidate)
    if len(found) == 1:
        return next(iter(found.values()))
    against = f" (local shape {bounded_list(local_shape)})" if local_shape is not None else ""
    if not found:
        raise LayoutError(f"{what} does not fold into the {ndim} dimension(s) of the checkpoint tensor{against}")
    raise LayoutError(f"{what} folds into {ndim} dimension(s) in {len(found)} ways that fit the tensor{against}; "
                      "give the strategy as protobuf (.ckpt), which records multi-axis dimensions unambiguously")


def common_ndim(layouts: list[ParamLayout]) -> int:
    """The number of dimensions of a tensor known only from recorded layouts (the first one's and
    the other side's): the largest all of them can describe whose foldings agree on the global
    shape where it is recorded. Used where no checkpoint tells (rank lists from strategies alone)."""
    first = layouts[0]
    candidates = set(folded_ndims(first))
    for other in layouts[1:]:
        candidates &= set(folded_ndims(other))
    for ndim in sorted(candidates, reverse=True):
        try:
            shapes = {unflatten(pl, ndim).tensor_shape for pl in layouts if pl.tensor_shape is not None}
        except LayoutError:
            continue
        if len(shapes) <= 1:
            return ndim
    return len(first.tensor_map)  # nothing fits: building the layout names the mismatch

