"""Copy patterns: which source boxes build a target block, in units, from the two layouts alone.

A pattern only depends on the pair of layouts, the source optimizer chunk read and the target
block, so one pattern serves every parameter with those layouts (``scale_pattern`` turns units
into elements for a global shape). It is computed arithmetically (``Layout.rank_holding``): the
cost is the number of pieces, never the number of devices a strategy declares, and it stops early
when it would need more source ranks than are present (``limit``).
"""

from __future__ import annotations

import itertools
from functools import lru_cache
from math import gcd, prod
from typing import NamedTuple

from reshard_job.core.boxes import Box
from reshard_job.core.layout import Layout


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
    return chunk_copy_pattern(src, dst, src.chunk(target_local % src.devices),
                              dst.block(target_local % dst.devices), limit)


@lru_cache(maxsize=4096)
def chunk_copy_pattern(src: Layout, dst: Layout, chunk: int, t_block: tuple[int, ...], limit: int | None) -> Pattern:
    """``copy_pattern`` from source optimizer chunk `chunk` into target block `t_block`."""
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


def scale_pattern(pattern: Pattern, global_shape: tuple[int, ...]):
    """The pattern's pieces in elements of a tensor of `global_shape`."""
    scale = [n // u for n, u in zip(global_shape, pattern.units)]
    return [
        (q, tuple((a * s, b * s) for (a, b), s in zip(sb, scale)), tuple((a * s, b * s) for (a, b), s in zip(tb, scale)))
        for q, sb, tb in pattern.pieces
    ]
