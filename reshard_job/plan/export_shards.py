"""Which tensor of one full target rank goes to which shard of an export for inference (pure).

Which tensors. ``include="weights"`` (default) leaves out training state; ``include="all"``
keeps everything. A name is training state when it starts with one of the optimizer prefixes
(``OPTIMIZER_PREFIXES`` of the topology: ``adam_m.``, ``adam_v.``, ``moments.``, ``accu_grads.``,
``exp_avg.`` ...) or is one of the optimizer's and training loop's own scalars and counters
(``TRAINING_STATE_NAMES``). Entries safetensors cannot hold (strings, map tensors) are left out
too. Everything left out is listed, with the reason, in ``ExportLayout.left_out``.

Shards. Tensors are taken in natural name order (``layers.2`` before ``layers.10``, so a layer's
tensors sit together) and packed greedily as ``transformers`` does: a shard is closed when the
next tensor would take its data past ``max_shard_size``; a tensor larger than the bound gets a
shard of its own. Sizes count tensor bytes, as ``transformers``' ``total_size`` does. Units
follow ``core.sizes``: ``5GB`` is 5·10⁹ bytes, ``5GiB`` is 5·2³⁰.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Sequence

import reshard_job.core.dtypes as dtypes
from reshard_job.core.sizes import parse_size
from reshard_job.core.topology import OPTIMIZER_PREFIXES
from reshard_job.errors import ConfigError, PlanError
from reshard_job.plan.model import ParamPlan, RankPlan

INCLUDE_WEIGHTS = "weights"
INCLUDE_ALL = "all"
INCLUDE_CHOICES = (INCLUDE_WEIGHTS, INCLUDE_ALL)
DEFAULT_MAX_SHARD_SIZE = "5GB"

TRAINING_STATE_NAMES = frozenset({
    "global_step", "learning_rate", "epoch_num", "step_num", "loss_scale", "scale_sense",
    "current_iterator_step", "last_overflow_iterator_step", "beta1_power", "beta2_power",
})


def parse_shard_size(value: int | str) -> int:
    """Bytes from an int or a size text (``core.sizes``: ``"5GB"`` powers of 10 as ``transformers``
    counts, ``"4GiB"`` powers of 2)."""
    try:
        size = parse_size(value)
    except ValueError:
        raise ConfigError(f"target.max_shard_size {value!r} is not a size (e.g. 5GB, 500MB, 4GiB or bytes)") from None
    if size < 1:
        raise ConfigError(f"target.max_shard_size must be at least 1 byte, got {value!r}")
    return size


def is_training_state(name: str, optimizer_prefixes: Sequence[str] = OPTIMIZER_PREFIXES) -> bool:
    """Optimizer state or training-loop bookkeeping rather than a model weight (module docstring)."""
    return name in TRAINING_STATE_NAMES or any(name.startswith(p) for p in optimizer_prefixes)


def shard_file_name(number: int, count: int) -> str:
    """``transformers``' shard name: ``model-00001-of-00003.safetensors`` (numbers from 1)."""
    return f"model-{number:05d}-of-{count:05d}.safetensors"


def natural_key(name: str) -> tuple:
    """Sort key comparing digit runs as numbers: ``layers.2`` < ``layers.10`` (ties such as
    ``a1``/``a01`` broken by the plain name, so the order never depends on the input's)."""
    parts = tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name) if part)
    return parts, name


@dataclass(frozen=True)
class ExportShard:
    file_name: str
    params: tuple[ParamPlan, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.params]


@dataclass(frozen=True)
class ExportLayout:
    """Which tensor goes to which shard, and what was left out (plain data, no I/O)."""

    target_rank: int
    shards: tuple[ExportShard, ...]
    left_out: tuple[tuple[str, str], ...]  # (name, reason)
    max_shard_size: int
    counting: frozenset[int] | None = None  # the full rank's (``RankPlan.counting``)

    @property
    def total_size(self) -> int:
        return sum(s.nbytes for s in self.shards)

    def weight_map(self) -> dict[str, str]:
        return {p.name: s.file_name for s in self.shards for p in s.params}

    def index_document(self) -> dict:
        return {"metadata": {"total_size": self.total_size}, "weight_map": self.weight_map()}

    def index_bytes(self) -> bytes:
        """The index as ``transformers`` writes it: sorted keys, two-space indent, final newline."""
        return (json.dumps(self.index_document(), indent=2, sort_keys=True) + "\n").encode("utf-8")

    def param_name_map_bytes(self) -> bytes | None:
        """MindSpore's ``param_name_map.json`` as ``unified_safetensors`` writes it (weight map in shard
        order, four-space indent), for MindSpore's unified loader; None for one shard, which it maps itself."""
        if len(self.shards) < 2:
            return None
        return json.dumps(self.index_document(), indent=4).encode("utf-8")

    def sub_plan(self, shard: ExportShard) -> RankPlan:
        return RankPlan(self.target_rank, list(shard.params), counting=self.counting)


def plan_export(rank_plan: RankPlan, *, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                include: str = INCLUDE_WEIGHTS,
                optimizer_prefixes: Sequence[str] = OPTIMIZER_PREFIXES) -> ExportLayout:
    """Assign the tensors of one full target rank to shards (see the module docstring)."""
    if include not in INCLUDE_CHOICES:
        raise ConfigError(f"target.include must be one of {', '.join(INCLUDE_CHOICES)}, got {include!r}")
    bound = parse_shard_size(max_shard_size)
    kept: list[ParamPlan] = []
    left_out: list[tuple[str, str]] = []
    for p in rank_plan.params:
        if tuple(p.target_shape) != tuple(p.global_shape):
            raise PlanError(
                f"parameter {p.name!r}: target shape {list(p.target_shape)} is a slice of {list(p.global_shape)}; "
                f"an export needs the plan of one full rank (no target strategy)")
        if p.kind != "tensor":
            left_out.append((p.name, f"a {p.kind} entry; safetensors holds tensors only"))
            continue
        if include == INCLUDE_WEIGHTS and is_training_state(p.name, optimizer_prefixes):
            left_out.append((p.name, "training state (include=all keeps it)"))
            continue
        dt = dtypes.BY_NAME.get(p.dtype)
        if dt is None or dt.safetensors is None:
            raise PlanError(f"parameter {p.name!r}: {p.dtype} has no safetensors dtype, so it cannot be exported")
        kept.append(p)
    if not kept:
        raise PlanError(f"nothing to export: all {len(rank_plan.params)} entries were left out "
                        f"(include={include})")
    groups: list[list[ParamPlan]] = []
    current: list[ParamPlan] = []
    filled = 0
    for p in sorted(kept, key=lambda q: natural_key(q.name)):
        if current and (filled + p.nbytes > bound or p.nbytes > bound):
            groups.append(current)
            current, filled = [], 0
        current.append(p)
        filled += p.nbytes
        if p.nbytes > bound:  # alone in its shard
            groups.append(current)
            current, filled = [], 0
    if current:
        groups.append(current)
    shards = tuple(ExportShard(shard_file_name(i + 1, len(groups)), tuple(g)) for i, g in enumerate(groups))
    return ExportLayout(rank_plan.target_rank, shards, tuple(left_out), bound, rank_plan.counting)
