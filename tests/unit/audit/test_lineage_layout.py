"""The layered layout of lineage pictures, hammered with random graphs (it is pure: no I/O)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from reshard_job.audit.graph import layered_layout

GAP = 14.0


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
