"""Boxes: axis-aligned sub-blocks of a tensor, as tuples of half-open (start, stop) ranges.

Pure helpers shared by the readers, the planner and the executor. A box is the natural unit of
resharding: every rank of a layout holds one box of the global tensor, and a target box is
assembled from its intersections with source boxes.
"""

from __future__ import annotations

from math import prod
from typing import Iterator, Sequence

Box = tuple[tuple[int, int], ...]


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def box_size(box: Box) -> int:
    return prod(box_shape(box))


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes, or None when it is empty."""
    out = []
    for (a0, a1), (b0, b1) in zip(a, b, strict=True):
        lo, hi = max(a0, b0), min(a1, b1)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def shift(box: Box, origin: Box) -> Box:
    """Express `box` (global coordinates) relative to the start of `origin`."""
    return tuple((s - o, e - o) for (s, e), (o, _) in zip(box, origin, strict=True))


def contains(outer: Box, inner: Box) -> bool:
    return all(o0 <= i0 and i1 <= o1 for (o0, o1), (i0, i1) in zip(outer, inner, strict=True))


def split_rows(box: Box, row_bytes: int, budget: int) -> Iterator[Box]:
    """Cut `box` along its first dimension into pieces of at most `budget` bytes each.

    `row_bytes` is the size of one index step of dimension 0 inside the box. A single row larger
    than the budget is cut further along the next dimension, recursively, so no piece exceeds the
    budget unless one element does.
    """
    if not box:
        yield box
        return
    (start, stop), rest = box[0], box[1:]
    if stop <= start:
        yield box
        return
    rows_per_piece = budget // row_bytes if row_bytes else stop - start
    if rows_per_piece >= 1 or not rest:
        step = max(1, rows_per_piece)
        for lo in range(start, stop, step):
            yield ((lo, min(stop, lo + step)),) + rest
        return
    inner_row = row_bytes // max(1, rest[0][1] - rest[0][0])
    for r in range(start, stop):
        for piece in split_rows(rest, inner_row, budget):
            yield ((r, r + 1),) + piece
