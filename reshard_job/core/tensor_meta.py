"""What a source file holds under one name, as the planner sees it."""

from __future__ import annotations

from typing import NamedTuple


class TensorMeta(NamedTuple):
    """What a source file holds under one name (a tuple: an index holds one per name and rank)."""

    dtype: str
    shape: tuple[int, ...]
    kind: str = "tensor"  # tensor | str | map
    nbytes: int = 0
