"""A deliberately simple reference for which box of a global tensor a rank holds, written from the
prose of spec/resharding-semantics.md §1–§3 without using ``reshard_job.core.layout``, and hypothesis
strategies for random layouts.

The reference favours the literal reading of the spec over speed: the replica group of a rank is
found by listing every rank of the stage, not by a formula.
"""

from __future__ import annotations

from math import gcd, prod

from hypothesis import strategies as st

from reshard_job.core.strategy_model import ParamLayout


def axes_of(entry) -> list[int]:
    """Device axes (counted from the right) of one tensor-map entry, most significant first."""
    values = entry if isinstance(entry, (tuple, list)) else (entry,)
    return [a for a in values if a != -1]


def reference_box(dev_matrix, tensor_map, opt_step, opt_size, global_shape, rank):
    """The box ((start, stop) per dimension) of the global tensor that local `rank` holds."""
    n = len(dev_matrix)
    devices = prod(dev_matrix)
    # §1: W_p = prod(d_{p+1..n-1}); c_p = (q div W_p) mod d_p -- the last position varies fastest
    weight = [prod(dev_matrix[p + 1:]) for p in range(n)]

    def coord(q, p):
        return (q // weight[p]) % dev_matrix[p]

    # §1: tensor-map value m names position n-1-m
    positions = [[n - 1 - a for a in axes_of(e)] for e in tensor_map]
    used = {p for ps in positions for p in ps}
    # §2: split factor and block index (first listed axis most significant) per dimension
    box, splits = [], []
    for dim, ps in enumerate(positions):
        split, block = 1, 0
        for p in ps:
            split *= dev_matrix[p]
            block = block * dev_matrix[p] + coord(rank, p)
        size = global_shape[dim] // split
        box.append([block * size, (block + 1) * size])
        splits.append(split)
    # §3: optimizer sharding of dimension 0
    if opt_step != 0 and opt_size != 0 and tensor_map:
        k = devices // prod(splits) if opt_size == -1 else opt_size
        group = [q for q in range(devices) if all(coord(q, p) == coord(rank, p) for p in used)]  # ascending
        u = group.index(rank)
        part = (global_shape[0] // splits[0]) // k
        start = box[0][0] + (u % k) * part
        box[0] = [start, start + part]
    return tuple((a, b) for a, b in box)


def divisors(layout: ParamLayout) -> list[int]:
    """How many equal parts each dimension is cut into (dimension 0 includes optimizer parts)."""
    dev = layout.dev_matrix
    n = len(dev)
    splits = [prod(dev[n - 1 - a] for a in axes_of(e)) for e in layout.tensor_map]
    if splits and layout.opt_shard_step != 0 and layout.opt_shard_size not in (0,):
        k = prod(dev) // prod(splits) if layout.opt_shard_size == -1 else layout.opt_shard_size
        splits[0] *= k
    return splits


def lcm(a: int, b: int) -> int:
    return a * b // gcd(a, b)


# ================================================================================ hypothesis


def dev_matrices(max_devices: int = 16, max_axes: int = 3, max_size: int = 4):
    return st.lists(st.integers(1, max_size), min_size=1, max_size=max_axes).filter(
        lambda d: prod(d) <= max_devices).map(tuple)


@st.composite
def param_layouts(draw, dev_matrix, ndim: int, allow_opt: bool = True) -> ParamLayout:
    """A random valid layout of an `ndim`-dimensional parameter over `dev_matrix`: each device axis
    splits some dimension or none; several axes on one dimension make a multi-axis entry; optimizer
    sharding (size k or -1, step != 0) over the replicas when there are any."""
    n = len(dev_matrix)
    owner = [draw(st.integers(-1, ndim - 1)) if ndim else -1 for _ in range(n)]
    entries = []
    for dim in range(ndim):
        axes = draw(st.permutations([m for m in range(n) if owner[m] == dim]))
        if not axes:
            entries.append(-1)
        elif len(axes) == 1 and draw(st.booleans()):
            entries.append(axes[0])
        else:
            entries.append(tuple(axes))
    split = prod(dev_matrix[n - 1 - m] for m in range(n) if owner[m] != -1)
    replicas = prod(dev_matrix) // split
    step, size = 0, 0
    if allow_opt and ndim and replicas > 1 and draw(st.booleans()):
        choices = [-1] + [k for k in range(2, replicas + 1) if replicas % k == 0]
        size = draw(st.sampled_from(choices))
        step = draw(st.integers(1, 8))
    elif draw(st.integers(0, 4)) == 0:
        step, size = draw(st.sampled_from([(0, 0), (3, 0), (1, 1)]))  # inactive forms
    return ParamLayout(tuple(dev_matrix), tuple(entries), step, size)


@st.composite
def layout_and_shape(draw, max_devices: int = 16):
    dev = draw(dev_matrices(max_devices))
    ndim = draw(st.integers(0, 3))
    layout = draw(param_layouts(dev, ndim))
    shape = tuple(d * draw(st.integers(1, 3)) for d in divisors(layout))
    return layout, shape
