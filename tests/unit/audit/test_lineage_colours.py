"""Lineage pictures: every status and role has a colour of its own, far from every other's in CIELAB."""

from __future__ import annotations

import itertools
import math

from reshard_job.audit.drawing import MIN_COLOUR_DISTANCE, STATUS_COLOURS, role_colours, legend
from reshard_job.lineage.status import RunStatus


def _lab(colour: str) -> tuple[float, float, float]:
    """CIELAB (D65) of an sRGB '#rrggbb'."""
    linear = []
    for i in (1, 3, 5):
        c = int(colour[i:i + 2], 16) / 255
        linear.append(c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4)
    r, g, b = linear
    xyz = ((0.4124 * r + 0.3576 * g + 0.1805 * b) / 0.95047, 0.2126 * r + 0.7152 * g + 0.0722 * b,
           (0.0193 * r + 0.1192 * g + 0.9505 * b) / 1.08883)
    fx, fy, fz = (t ** (1 / 3) if t > 216 / 24389 else (24389 / 27 * t + 16) / 116 for t in xyz)
    return 116 * fy - 16, 500 * (fx - fy), 200 * (fy - fz)


def _distance(a: str, b: str) -> float:
    return math.dist(_lab(a), _lab(b))


def test_lab_conversion_matches_known_values():
    assert all(abs(x - y) < 0.05 for x, y in zip(_lab("#ffffff"), (100, 0, 0)))
    assert all(abs(x - y) < 0.2 for x, y in zip(_lab("#ff0000"), (53.24, 80.09, 67.20)))


def test_every_status_and_role_has_its_own_distinct_colour():
    colours = role_colours()
    assert set(STATUS_COLOURS) == set(RunStatus)
    assert {"checkpoint", "strategy", "manifest", "asked about"} | {f"run {s}" for s in RunStatus} == set(colours)
    close = [(a, b, round(_distance(colours[a], colours[b]), 1)) for a, b in itertools.combinations(colours, 2)
             if _distance(colours[a], colours[b]) < MIN_COLOUR_DISTANCE]
    assert not close, f"colours too alike (CIE76 ΔE < {MIN_COLOUR_DISTANCE}): {close}"


def test_the_bound_rejects_the_amber_that_read_as_interrupted():
    # "asked about" was #f0b429 beside "interrupted" #f08c00: the bound must call them alike.
    assert _distance("#f0b429", "#f08c00") < MIN_COLOUR_DISTANCE


def test_the_legend_shows_every_colour():
    pieces, _ = legend()
    drawn = "".join(pieces)
    for name, colour in role_colours().items():
        assert colour in drawn and f">{name}<" in drawn, name
