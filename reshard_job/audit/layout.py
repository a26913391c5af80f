"""A deterministic layered layout for lineage pictures, whose edges never pass under a box. Pure: no I/O.

The classic layered (Sugiyama-style) drawing, kept small so that no Graphviz is needed and the
output is byte-for-byte reproducible:

1. cycles (a round trip that reproduces its source) are broken by turning DFS back edges round
   for the layering; they are drawn the right way, dashed, along the reversed route;
2. layers by longest path from the sources, then sources pulled right to just before their first
   reader, so a strategy file read late does not sit in the first column;
3. an edge spanning several layers gets a dummy vertex in every layer it crosses: a slot with no
   height that takes part in ordering and placement like a box, so the packing keeps it a gap
   away from every box of that column;
4. order within layers by barycenter sweeps (fewer crossings), ties broken by a fixed key order;
5. vertical positions pulled toward the neighbours' mean and made non-overlapping by averaging a
   top-down and a bottom-up packing (both feasible, so their mean is too).

Every edge is then a route of waypoints: it leaves its source at the right edge of the source's
column, crosses each gap between adjacent columns (where there are no boxes), runs straight
through each column it crosses at its dummy's height (where there is no box either), and enters
its target at the left edge of the target's column. Whatever is drawn between two waypoints in a
gap stays in that gap if it stays between their x coordinates (a straight line, or a Bézier curve
whose control points do), so no edge can pass under a box.

Its cost is O(sweeps × (edges + dummies) × log) — fine for the thousands of files of a large conversion.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Hashable, NamedTuple, Sequence

ORDER_SWEEPS = 4
PLACEMENT_SWEEPS = 3

Point = tuple[float, float]


@dataclass(frozen=True)
class Box:
    x: float
    y: float
    width: float
    height: float
    layer: int

    @property
    def left_middle(self) -> Point:
        return self.x, self.y + self.height / 2

    @property
    def right_middle(self) -> Point:
        return self.x + self.width, self.y + self.height / 2


@dataclass(frozen=True)
class Layout:
    boxes: dict[str, Box]
    width: float
    height: float
    back_edges: frozenset[tuple[str, str]]  # drawn along the reversed route, not used to order the layers
    # Per edge, its waypoints from source to target: the source box's side, the two sides of every
    # column crossed (at one height: a straight run where no box is), the target box's side. Two
    # waypoints at different heights face each other across the gap between adjacent columns, where
    # no box is either. A back edge's route runs right to left.
    routes: dict[tuple[str, str], tuple[Point, ...]]


class _Dummy(NamedTuple):
    """Where edge number `edge` crosses layer `layer`; never equal to a key (those are strings).
    A tuple, not a dataclass: the ordering sweeps hash these millions of times."""
    edge: int
    layer: int


def layered_layout(keys: Sequence[str], edges: Sequence[tuple[str, str]], size: Callable[[str], tuple[float, float]],
                   *, layer_gap: float = 72, node_gap: float = 14, left: float = 24, top: float = 24,
                   right: float = 24, bottom: float = 24) -> Layout:
    """Positions for `keys` (their order is the tie-breaker everywhere) with `edges` drawn left to right.

    `size(key)` gives a box's (width, height). Edges naming unknown keys and self-loops are ignored.
    """
    index: dict[Hashable, int] = {key: i for i, key in enumerate(dict.fromkeys(keys))}
    keys = list(index)
    pairs = sorted({(a, b) for a, b in edges if a in index and b in index and a != b},
                   key=lambda e: (index[e[0]], index[e[1]]))
    successors: dict[str, list[str]] = defaultdict(list)
    for a, b in pairs:
        successors[a].append(b)
    back = _back_edges(keys, successors)
    # Forward edges, and back edges turned round: the layering's DAG, in the edges' order.
    forward = [(b, a) if (a, b) in back else (a, b) for a, b in pairs]
    preds: dict[Hashable, list[Hashable]] = defaultdict(list)
    succs: dict[Hashable, list[Hashable]] = defaultdict(list)
    for a, b in dict.fromkeys(forward):
        succs[a].append(b)
        preds[b].append(a)
    layer: dict[Hashable, int] = _layers(keys, index, preds, succs)

    chains = _chains(forward, layer, index, preds, succs)
    layers = _ordered_layers(list(index), layer, preds, succs, index)
    sizes: dict[Hashable, tuple[float, float]] = {key: size(key) for key in keys}
    sizes.update({vertex: (0.0, 0.0) for vertex in index if isinstance(vertex, _Dummy)})
    column = max((w for w, _ in sizes.values()), default=0)
    ys = _vertical_positions(layers, sizes, preds, succs, node_gap)

    def column_left(number: int) -> float:
        return left + number * (column + layer_gap)

    boxes = {}
    for number, members in enumerate(layers):
        for key in members:
            if not isinstance(key, _Dummy):
                w, h = sizes[key]
                boxes[key] = Box(column_left(number) + (column - w) / 2, top + ys[key], w, h, number)
    routes = {}
    both_ways = set(pairs)
    for (a, b), (start, end), chain in zip(pairs, forward, chains):
        # A file a run both read and wrote (a byte copy of an input): the way back leaves and enters
        # the boxes lower than the way there, so the two are not drawn over each other.
        shift = min(sizes[a][1], sizes[b][1]) / 4 if (a, b) in back and (b, a) in both_ways else 0.0
        points = _route(boxes[start], boxes[end], [top + ys[d] for d in chain], column_left, column, shift)
        routes[(a, b)] = tuple(reversed(points)) if (a, b) in back else points
    width = left + right + (len(layers) * column + max(len(layers) - 1, 0) * layer_gap)
    height = top + bottom + max((ys[k] + sizes[k][1] for k in index), default=0)
    return Layout(boxes, width, height, frozenset(back), routes)


def _chains(forward: list[tuple[str, str]], layer: dict[Hashable, int], index: dict[Hashable, int],
            preds, succs) -> list[list[_Dummy]]:
    """Split every edge spanning more than one layer into a chain through dummies, one per layer crossed.

    Adds the dummies to `layer`, `index` (after every key, in the edges' order), `preds` and `succs`,
    and replaces the long edge there by its chain. Returns each edge's dummies, left to right.
    """
    chains = []
    for number, (a, b) in enumerate(forward):
        chain = [_Dummy(number, n) for n in range(layer[a] + 1, layer[b])]
        chains.append(chain)
        if not chain:
            continue
        if b in succs[a]:
            succs[a][succs[a].index(b)] = chain[0]
            preds[b][preds[b].index(a)] = chain[-1]
        else:  # a back edge turned round onto an edge of the other way: a chain of its own beside it
            succs[a].append(chain[0])
            preds[b].append(chain[-1])
        for before, dummy, after in zip([a] + chain, chain, chain[1:] + [b]):
            layer[dummy] = dummy.layer
            index[dummy] = len(index)
            preds[dummy].append(before)
            succs[dummy].append(after)
    return chains


def _route(start: Box, end: Box, heights: list[float], column_left: Callable[[int], float], column: float,
           shift: float = 0.0) -> tuple[Point, ...]:
    """Waypoints from `start`'s right side to `end`'s left side through a column at each of `heights`;
    `shift` moves where the route meets the boxes down from their middles."""
    x, y = start.right_middle
    points = [(x, y + shift)]
    if x < column_left(start.layer) + column:  # a narrow box: straight on to its column's edge
        points.append((column_left(start.layer) + column, y + shift))
    for number, height in zip(range(start.layer + 1, end.layer), heights):
        points += [(column_left(number), height), (column_left(number) + column, height)]
    x, y = end.left_middle
    if x > column_left(end.layer):
        points.append((column_left(end.layer), y + shift))
    points.append((x, y + shift))
    return tuple(points)


def _back_edges(keys: list[str], successors: dict[str, list[str]]) -> set[tuple[str, str]]:
    """Edges closing a cycle in a depth-first search started from each key in order (iterative)."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    back: set[tuple[str, str]] = set()
    for start in keys:
        if start in state:
            continue
        state[start] = 1
        stack = [(start, iter(successors.get(start, ())))]
        while stack:
            key, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[key] = 2
                stack.pop()
            elif state.get(child) == 1:
                back.add((key, child))
            elif child not in state:
                state[child] = 1
                stack.append((child, iter(successors.get(child, ()))))
    return back


def _layers(keys: list[str], index, preds, succs) -> dict[Hashable, int]:
    remaining = {key: len(preds[key]) for key in keys}
    ready = [(index[key], key) for key in keys if remaining[key] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, key = heapq.heappop(ready)
        order.append(key)
        for child in succs[key]:
            remaining[child] -= 1
            if remaining[child] == 0:
                heapq.heappush(ready, (index[child], child))
    layer: dict[Hashable, int] = {}
    for key in order:
        layer[key] = max((layer[p] + 1 for p in preds[key]), default=0)
    # Sources sit just before their first reader, not all in the first column.
    for key in reversed(order):
        if not preds[key] and succs[key]:
            layer[key] = min(layer[s] for s in succs[key]) - 1
    return layer


def _ordered_layers(vertices: list[Hashable], layer, preds, succs, index) -> list[list[Hashable]]:
    count = max(layer.values(), default=-1) + 1
    layers: list[list[Hashable]] = [[] for _ in range(count)]
    for vertex in vertices:
        layers[layer[vertex]].append(vertex)

    position: dict[Hashable, float] = {}

    def centre(members: list[Hashable]) -> None:
        position.update((key, i - (len(members) - 1) / 2) for i, key in enumerate(members))

    for members in layers:
        centre(members)
    for _ in range(ORDER_SWEEPS):
        # Left to right by the predecessors' positions, then right to left by the successors'.
        for numbers, neighbours in ((range(1, count), preds), (range(count - 2, -1, -1), succs)):
            for number in numbers:
                layers[number] = _by_barycenter(layers[number], neighbours, position, index)
                centre(layers[number])
    return layers


def _by_barycenter(members: list[Hashable], neighbours, position: dict[Hashable, float], index) -> list[Hashable]:
    current = {key: i for i, key in enumerate(members)}

    def barycenter(key: Hashable) -> float:
        linked = neighbours[key]
        return sum(position[n] for n in linked) / len(linked) if linked else position[key]

    return sorted(members, key=lambda key: (barycenter(key), current[key], index[key]))


def _vertical_positions(layers: list[list[Hashable]], sizes, preds, succs, gap: float) -> dict[Hashable, float]:
    """Top y of every box and dummy: stacked and centred first, then pulled toward the neighbours' centres."""
    heights = [sum(sizes[k][1] for k in members) + gap * max(len(members) - 1, 0) for members in layers]
    tallest = max(heights, default=0)
    y: dict[Hashable, float] = {}
    for members, total in zip(layers, heights):
        cursor = (tallest - total) / 2
        for key in members:
            y[key] = cursor
            cursor += sizes[key][1] + gap

    def centre(key: Hashable) -> float:
        return y[key] + sizes[key][1] / 2

    for _ in range(PLACEMENT_SWEEPS):
        for members in layers + layers[::-1]:
            wanted = []
            for key in members:
                linked = preds[key] + succs[key]
                target = sum(centre(n) for n in linked) / len(linked) if linked else centre(key)
                wanted.append(target - sizes[key][1] / 2)
            packed = _pack(wanted, [sizes[k][1] for k in members], gap)
            for key, top in zip(members, packed):
                y[key] = top
    lowest = min(y.values(), default=0.0)
    return {key: value - lowest for key, value in y.items()}


def _pack(wanted: list[float], heights: list[float], gap: float) -> list[float]:
    """Tops as close to `wanted` as keeps the boxes in order and `gap` apart: the mean of a
    top-down and a bottom-up packing (the constraints are linear, so the mean satisfies them)."""
    down = []
    for i, target in enumerate(wanted):
        down.append(target if i == 0 else max(target, down[-1] + heights[i - 1] + gap))
    up = [0.0] * len(wanted)
    for i in range(len(wanted) - 1, -1, -1):
        up[i] = wanted[i] if i == len(wanted) - 1 else min(wanted[i], up[i + 1] - heights[i] - gap)
    return [(a + b) / 2 for a, b in zip(down, up)]
