"""What a strategy file says, as plain values: each parameter's layout, the operator entries, the
file's stage. Pure: parsing and writing the bytes are ``reshard_job.formats.strategy``'s.
"""

from __future__ import annotations

import dataclasses
import re
from operator import itemgetter, methodcaller
from dataclasses import dataclass, field

JSON_SUFFIX = ".json"
FORMAT_PROTOBUF = "protobuf"
FORMAT_JSON = "json"
MERGED_KEY = re.compile(r"^(\d+)-(.+)$", re.S)

# Ceilings on what a strategy may declare. Real clusters have thousands to tens of thousands of
# devices; these are far above that and far below sizes whose mere enumeration would hang or
# exhaust memory. Every count or index taken from a strategy is checked against them before it
# sizes a loop or an allocation.
MAX_DEVICES = 2**20  # devices of one pipeline stage, and of all stages together
MAX_STAGES = 2**20  # pipeline stages (a stage number must be below it)
MAX_AXES = 64  # entries of a device matrix, of a tensor map, of one multi-axis tensor-map entry

AxisEntry = int | tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ParamLayout:
    """One parameter's layout exactly as a strategy file records it.

    Slotted, its hash computed once as it is made: a model of 600,000 parameters holds one layout
    per parameter until equal ones are shared, and a ``__dict__`` each would be most of their size.
    """

    dev_matrix: tuple[int, ...]
    tensor_map: tuple[AxisEntry, ...]  # ints (flat) or tuples of ints (multi-axis dims)
    opt_shard_step: int = 0
    opt_shard_size: int = 0
    param_split_shape: tuple[int, ...] = ()
    indices_offset: tuple[int, ...] = ()
    field: int = 0
    tensor_shape: tuple[int, ...] | None = None  # JSON only; informational
    # layouts key caches once per parameter: hash each one once
    _hash: int = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.dev_matrix, self.tensor_map, self.opt_shard_step,
                                                self.opt_shard_size, self.param_split_shape, self.indices_offset,
                                                self.field, self.tensor_shape)))

    def __hash__(self) -> int:
        return self._hash

    @property
    def nested(self) -> bool:
        return any(isinstance(e, tuple) for e in self.tensor_map)

    def flattened(self) -> "ParamLayout":
        """The form MindSpore's JSON writer records a multi-axis layout in: a dimension split over
        axes [a1, ..., am] becomes sub-dimensions of sizes [d(a1), ..., d(a(m-1)), rest] mapped to
        [a1, ..., am], with those sizes in ``tensor_shape`` (the "extended" shape). Needs the
        global shape in ``tensor_shape``; raises ValueError without it."""
        if not self.nested:
            return self
        if self.tensor_shape is None or len(self.tensor_shape) != len(self.tensor_map):
            raise ValueError("a multi-axis layout is written to JSON flattened, which needs the tensor's global "
                             "shape (tensor_shape)")
        n = len(self.dev_matrix)
        entries: list[int] = []
        shape: list[int] = []
        for entry, size in zip(self.tensor_map, self.tensor_shape):
            axes = [m for m in (entry if isinstance(entry, tuple) else (entry,)) if m != -1]
            if not axes:
                entries.append(-1)
                shape.append(size)
                continue
            rest = size
            for m in axes[:-1]:
                d = self.dev_matrix[n - 1 - m] if 0 <= m < n else 0
                if d < 1 or rest % d:
                    raise ValueError(f"a dimension of size {size} cannot be split over device axes {axes}")
                entries.append(m)
                shape.append(d)
                rest //= d
            entries.append(axes[-1])
            shape.append(rest)
        return dataclasses.replace(self, tensor_map=tuple(entries), tensor_shape=tuple(shape))

    def to_json_dict(self) -> dict:
        """The JSON strategy entry (multi-axis dimensions flattened, as MindSpore writes them)."""
        flat = self.flattened()
        if flat is not self:
            return flat.to_json_dict()
        d = {
            "dev_matrix": list(self.dev_matrix),
            "tensor_map": [list(e) if isinstance(e, tuple) else e for e in self.tensor_map],
        }
        if self.tensor_shape is not None:
            d["tensor_shape"] = list(self.tensor_shape)
        d["field"] = self.field
        d["opt_weight_shard_step"] = self.opt_shard_step
        d["opt_weight_shard_size"] = self.opt_shard_size
        if self.param_split_shape or self.indices_offset:
            d["param_split_shape"] = list(self.param_split_shape)
            d["indices_offset"] = list(self.indices_offset)
        return d


@dataclass(frozen=True, slots=True)
class StrategyItem:
    """An operator's entry (node name, pipeline stage, per-input shard factors)."""

    node_name: str
    stage: int
    strategies: tuple[tuple[int, ...], ...] = ()


@dataclass
class StrategyFile:
    layouts: dict[str, ParamLayout]
    items: list[StrategyItem] = field(default_factory=list)
    current_stage: int = 1
    format: str = FORMAT_PROTOBUF
    path: str | None = None

    @property
    def merged(self) -> bool:
        """True for a merged pipeline file: every layout key carries a ``"<stage>-"`` prefix.

        Names are split on the first ``-`` only, so parameter names that contain ``-`` work both in
        merged and in plain files (MindSpore splits on every ``-`` and fails on such names).
        """
        return bool(self.layouts) and all(map(MERGED_KEY.match, self.layouts)) and self._prefixes_are_stages()

    def _prefixes_are_stages(self) -> bool:
        if not self.items:
            return True
        stages = {it.stage for it in self.items}
        return {int(p) for p in stage_prefixes(self.layouts)} <= stages

    @property
    def file_stage(self) -> int:
        """The stage of an unmerged file: that of its first strategy item (0 without items)."""
        return self.items[0].stage if self.items else 0


def stage_prefixes(keys) -> set[str]:
    """The distinct ``"<stage>"`` parts of merged layout keys (each matching ``MERGED_KEY``: the
    part before the first ``-``), split in C rather than matched one by one."""
    return set(map(itemgetter(0), map(methodcaller("partition", "-"), keys)))


def missing_stages(stages: list[int], limit: int = 9) -> list[int]:
    """Up to `limit` numbers of ``0..max(stages)`` absent from the sorted `stages`, found from the
    gaps between them (never by listing ``range(max(stages))``, which a hostile file makes huge)."""
    out: list[int] = []
    expected = 0
    for s in stages:
        while expected < s and len(out) < limit:
            out.append(expected)
            expected += 1
        if len(out) >= limit:
            break
        expected = s + 1
    return out
