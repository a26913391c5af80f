"""The layered layout of lineage pictures, hammered with random graphs (it is pure: no I/O).

The geometric tests read the edges as drawn (the SVG path data) and check that no edge passes
under a box other than its own two ends: straight pieces exactly, Bézier curves finely sampled.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard_job.audit.drawing import edge_path
from reshard_job.audit.graph import Box, Layout, layered_layout

GAP = 14.0
INSIDE = 0.5  # a piece touching a box's outline is not under it; one reaching this far inside is
CURVE_STEPS = 32


@st.composite
def graphs(draw):
    count = draw(st.integers(min_value=1, max_value=24))
    keys = [f"n{i}" for i in range(count)]
    dag = draw(st.booleans())
    pairs = st.tuples(st.integers(0, count - 1), st.integers(0, count - 1))
    edges = []
    for a, b in draw(st.lists(pairs, max_size=3 * count)):
        if dag and a >= b:
            continue  # only forward edges: acyclic
        edges.append((keys[a], keys[b]))
    heights = draw(st.lists(st.sampled_from([40.0, 64.0, 90.0]), min_size=count, max_size=count))
    return keys, edges, dict(zip(keys, heights)), dag


def _pieces(d: str) -> list[tuple[tuple[float, float], tuple[float, float]]]:
    """The straight pieces of SVG path data made of M, L and C commands, curves sampled finely."""
    tokens = re.findall(r"[MLC]|-?\d+(?:\.\d+)?", d)
    pieces, at, i = [], None, 0
    while i < len(tokens):
        command, i = tokens[i], i + 1
        count = {"M": 1, "L": 1, "C": 3}[command]
        numbers = [float(t) for t in tokens[i:i + 2 * count]]
        i += 2 * count
        points = list(zip(numbers[::2], numbers[1::2]))
        if command == "M":
            at = points[0]
        elif command == "L":
            pieces.append((at, points[0]))
            at = points[0]
        else:
            (x0, y0), ((x1, y1), (x2, y2), (x3, y3)) = at, points
            previous = at
            for step in range(1, CURVE_STEPS + 1):
                t = step / CURVE_STEPS
                a, b, c, e = (1 - t) ** 3, 3 * (1 - t) ** 2 * t, 3 * (1 - t) * t * t, t ** 3
                point = (a * x0 + b * x1 + c * x2 + e * x3, a * y0 + b * y1 + c * y2 + e * y3)
                pieces.append((previous, point))
                previous = point
            at = (x3, y3)
    return pieces


def _enters(piece, box: Box) -> bool:
    """Whether the straight `piece` reaches inside `box` (Liang–Barsky clipping against its inner part)."""
    (x0, y0), (x1, y1) = piece
    dx, dy = x1 - x0, y1 - y0
    low, high = 0.0, 1.0
    for p, q in ((-dx, x0 - (box.x + INSIDE)), (dx, box.x + box.width - INSIDE - x0),
                 (-dy, y0 - (box.y + INSIDE)), (dy, box.y + box.height - INSIDE - y0)):
        if p == 0:
            if q < 0:
                return False
        elif p < 0:
            low = max(low, q / p)
        else:
            high = min(high, q / p)
    return low < high


def assert_no_edge_passes_under_a_box(layout: Layout, edges) -> None:
    columns: dict[tuple[float, float], list[tuple[str, Box]]] = {}  # boxes by their x extent, to check fewer
    for key, box in layout.boxes.items():
        columns.setdefault((box.x, box.x + box.width), []).append((key, box))
    for source, target in dict.fromkeys((a, b) for a, b in edges if a != b):
        pieces = _pieces(edge_path(layout, source, target))
        assert pieces, (source, target)
        for piece in pieces:
            low, high = sorted((piece[0][0], piece[1][0]))
            for (left, right), boxes in columns.items():
                if high <= left or low >= right:
                    continue
                under = [key for key, box in boxes if key not in (source, target) and _enters(piece, box)]
                assert not under, f"edge {source} -> {target} passes under {under[0]} at {piece}"


def _acyclic(keys, edges) -> bool:
    incoming = {key: 0 for key in keys}
    for _, b in edges:
        incoming[b] += 1
    ready = [key for key in keys if incoming[key] == 0]
    seen = 0
    while ready:
        key = ready.pop()
        seen += 1
        for a, b in edges:
            if a == key:
                incoming[b] -= 1
                if incoming[b] == 0:
                    ready.append(b)
    return seen == len(keys)


@settings(max_examples=150, deadline=None)
@given(graphs())
def test_layout_places_every_box_without_overlap_and_edges_left_to_right(graph):
    keys, edges, heights, dag = graph
    layout = layered_layout(keys, edges, lambda key: (200.0, heights[key]), node_gap=GAP)
    assert layout == layered_layout(keys, edges, lambda key: (200.0, heights[key]), node_gap=GAP)  # deterministic
    assert set(layout.boxes) == set(keys)
    for box in layout.boxes.values():
        assert 0 <= box.x and box.x + box.width <= layout.width + 1e-6
        assert 0 <= box.y and box.y + box.height <= layout.height + 1e-6
    by_layer: dict[int, list] = {}
    for box in layout.boxes.values():
        by_layer.setdefault(box.layer, []).append(box)
    for boxes in by_layer.values():
        assert len({box.x for box in boxes}) == 1  # one column per layer
        boxes.sort(key=lambda box: box.y)
        for upper, lower in zip(boxes, boxes[1:]):
            assert lower.y >= upper.y + upper.height + GAP - 1e-6
    real = [(a, b) for a, b in edges if a != b]
    kept = [(a, b) for a, b in real if (a, b) not in layout.back_edges]
    assert layout.back_edges <= set(real)
    assert _acyclic(keys, kept)
    for a, b in kept:
        assert layout.boxes[a].layer < layout.boxes[b].layer
    if dag:
        assert not layout.back_edges
    assert_no_edge_passes_under_a_box(layout, edges)
    for a, b in real:  # each edge leaves one box's side and enters the other's
        (x0, y0), (x1, y1) = layout.routes[(a, b)][0], layout.routes[(a, b)][-1]
        start, end = layout.boxes[a], layout.boxes[b]
        if (a, b) in layout.back_edges:
            assert x0 == start.x and x1 == end.x + end.width
        else:
            assert x0 == start.x + start.width and x1 == end.x
        assert start.y < y0 < start.y + start.height and end.y < y1 < end.y + end.height


def _two_hop(skip: bool):
    """8 sources and a strategy into run A, its 4 outputs and strategy into run B, 2 outputs and a
    strategy out of B; with `skip`, the target strategy is read by A and written again by B (a byte
    copy), and A's first source is read by B too: edges that skip columns."""
    sources = [f"src{r}" for r in range(8)]
    middle = [f"mid{r}" for r in range(4)] + ["mid_strategy"]
    final = ["out0", "out1", "strategy"]
    edges = [(s, "runA") for s in sources + ["src_strategy"]] + [("runA", m) for m in middle]
    edges += [(m, "runB") for m in middle] + [("runB", f) for f in final]
    if skip:
        edges += [("runA", "strategy"), ("src0", "runB")]
    return sources + ["src_strategy"] + middle + final + ["runA", "runB"], edges


def _fan_in(width: int):
    files = [f"file{i}" for i in range(width)]
    return files + ["run", "out"], [(f, "run") for f in files] + [("run", "out")]


def _long_chain(hops: int):
    """file → run → file … `hops` times; one strategy read by every run, one log written by the first
    and the last run: edges across many columns."""
    keys, edges = ["f0", "strategy", "log"], []
    for hop in range(hops):
        keys += [f"r{hop}", f"f{hop + 1}"]
        edges += [(f"f{hop}", f"r{hop}"), (f"r{hop}", f"f{hop + 1}"), ("strategy", f"r{hop}")]
    return keys, edges + [("r0", "log"), (f"r{hops - 1}", "log")]


def _skipping_layers():
    """Edges from every column to every later one, and one cycle (a round trip) closing it."""
    keys = [f"n{i}" for i in range(7)]
    edges = [(a, b) for i, a in enumerate(keys) for b in keys[i + 1:]]
    return keys, edges + [("n6", "n0"), ("n5", "n2")]


@pytest.mark.parametrize("graph", [_two_hop(False), _two_hop(True), _fan_in(8), _long_chain(30), _skipping_layers()],
                         ids=["two-hop", "two-hop-skipping", "fan-in-8", "chain-30", "skipping-layers"])
@pytest.mark.parametrize("run_width", [288.0, 150.0], ids=["same-widths", "narrow-runs"])
def test_no_edge_passes_under_a_box(graph, run_width):
    keys, edges = graph
    files = ("f", "s", "m", "o")  # files are 288 × 80, runs `run_width` × 64 (centred in their column)
    layout = layered_layout(keys, edges, lambda key: (288.0, 80.0) if key.startswith(files) else (run_width, 64.0))
    assert_no_edge_passes_under_a_box(layout, edges)
    assert set(layout.routes) == set(edges)


def test_the_old_straight_drawing_would_fail_the_geometric_check():
    """The check bites: run A's edge to the final strategy, drawn straight from box to box, passes
    under a box of the middle column (the picture that read A → rank_2 → the next run)."""
    keys, edges = _two_hop(True)
    layout = layered_layout(keys, edges, lambda key: (288.0, 64.0))
    (x0, y0), (x1, y1) = layout.boxes["runA"].right_middle, layout.boxes["strategy"].left_middle
    middle = [key for key, box in layout.boxes.items() if box.layer == layout.boxes["runA"].layer + 1]
    assert any(_enters(((x0, y0), (x1, y1)), layout.boxes[key]) for key in middle)
    assert len(layout.routes[("runA", "strategy")]) > 2  # the real route goes round, through the gaps


def test_a_source_read_late_sits_just_before_its_reader():
    # s1 -> r1 -> f1 -> r2 -> f2, and a strategy file s2 read only by r2.
    edges = [("s1", "r1"), ("r1", "f1"), ("f1", "r2"), ("s2", "r2"), ("r2", "f2")]
    layout = layered_layout(["s1", "s2", "r1", "f1", "r2", "f2"], edges, lambda key: (100, 50))
    layers = {key: box.layer for key, box in layout.boxes.items()}
    assert layers == {"s1": 0, "r1": 1, "f1": 2, "s2": 2, "r2": 3, "f2": 4}


def test_a_fan_in_is_centred_on_its_run():
    sources = [f"src{i}" for i in range(5)]
    layout = layered_layout(sources + ["run"], [(s, "run") for s in sources], lambda key: (100, 40))
    centres = [layout.boxes[s].y + 20 for s in sources]
    assert abs(layout.boxes["run"].y + 20 - sum(centres) / len(centres)) < 1e-6


def test_a_file_read_and_written_by_one_run_shows_both_ways_apart():
    """A run that read a file and wrote the same bytes back (a copied strategy): two edges, not one on the other."""
    keys, edges = ["source", "strategy", "run", "output"], [("source", "run"), ("strategy", "run"),
                                                             ("run", "strategy"), ("run", "output")]
    layout = layered_layout(keys, edges, lambda key: (288.0, 80.0))
    (a, b), = layout.back_edges
    assert {(a, b)} < {("run", "strategy"), ("strategy", "run")}
    there, back = layout.routes[(b, a)], layout.routes[(a, b)]
    assert back[0][0] == layout.boxes[a].x and back[-1][0] == layout.boxes[b].x + 288  # right to left
    assert not set(there) & set(back)
    assert_no_edge_passes_under_a_box(layout, edges)
