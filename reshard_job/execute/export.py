"""Export for inference: the full model as size-bounded safetensors shards plus an index.

The layout is the one ``transformers`` and inference servers load: ``model-00001-of-00003.safetensors``
... and ``model.safetensors.index.json`` = ``{"metadata": {"total_size": <bytes>}, "weight_map":
{<tensor name>: <shard file>}}``. It is what MindSpore's ``unified_safetensors`` offers, but
streamed: each shard is written by ``execute.execute_rank`` from a slice of an ordinary plan, so
memory stays bounded by one slice in flight, never by a shard or the model.

Input. The plan of one full target rank: a ``Planner`` with no target strategy gives one target
rank holding every tensor whole, and that ``RankPlan`` is what gets split into shards. Anything
else (a rank of a sharded target) is refused, because its tensors are not the model's.

Which tensors. ``include="weights"`` (default) leaves out training state; ``include="all"``
keeps everything. A name is training state when it starts with one of the optimizer prefixes
(``OPTIMIZER_PREFIXES`` of the topology: ``adam_m.``, ``adam_v.``, ``moments.``, ``accu_grads.``,
``exp_avg.`` ...) or is one of the optimizer's and training loop's own scalars and counters
(``TRAINING_STATE_NAMES``: ``global_step``, ``learning_rate``, ``epoch_num``, ``step_num``,
``loss_scale``, ``scale_sense``, ``current_iterator_step``, ``last_overflow_iterator_step``,
``beta1_power``, ``beta2_power``). Entries safetensors cannot hold (strings, map tensors) are left
out too. Everything left out is listed, with the reason, in ``ExportLayout.left_out``.

Shards. Tensors are taken in natural name order (``layers.2`` before ``layers.10``, so a layer's
tensors sit together) and packed greedily as ``transformers`` does: a shard is closed when the
next tensor would take its data past ``max_shard_size``; a tensor larger than the bound gets a
shard of its own. Sizes count tensor bytes, as ``transformers``' ``total_size`` does (headers
add a few KiB per shard). ``max_shard_size`` units follow ``transformers``: ``5GB`` is 5·10⁹
bytes, ``5GiB`` is 5·2³⁰. The shard names are always numbered, and the index is always written,
even for one shard, so a reader has one layout to expect.

Metadata. ``execute_rank`` writes MindSpore's flavour of safetensors by default, whose
``__metadata__`` is ``{"format": "ms"}``; ``transformers`` refuses a shard whose ``format`` is not
one of ``pt``, ``tf``, ``flax``, ``mlx``, so every shard is written with ``EXPORT_METADATA``
(``{"format": "pt"}``), which the ``safetensors`` library reads as well.
Tensor names are MindSpore's parameter names; mapping them to a ``transformers`` architecture's
names is not done here.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Sequence

from reshard_job.errors import ConfigError, FormatError, PlanError
from reshard_job.execute.rank_task import DEFAULT_MAX_MEMORY, Progress, execute_rank
from reshard_job.execute.tasks import FORMAT_SAFETENSORS
import reshard_job.core.dtypes as dtypes
from reshard_job.formats.ckpt import WrittenFile
from reshard_job.formats.multifile import MultiFileSources
from reshard_job.core.topology import OPTIMIZER_PREFIXES
from reshard_job.plan.planner import ParamPlan, RankPlan
from reshard_job.storage import StorageError, StorageOptions, absolute, storage_for
from reshard_job.storage.atomic import write_bytes_atomic
from reshard_job.core.sizes import parse_size

INDEX_FILE = "model.safetensors.index.json"
MAX_INDEX_BYTES = 1024**3  # an index larger than this is not one
SHARD_FILE = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")
INCLUDE_WEIGHTS = "weights"
INCLUDE_ALL = "all"
INCLUDE_CHOICES = (INCLUDE_WEIGHTS, INCLUDE_ALL)
DEFAULT_MAX_SHARD_SIZE = "5GB"
# the shards' safetensors __metadata__: transformers loads only files whose format it knows
EXPORT_METADATA = {"format": "pt"}

TRAINING_STATE_NAMES = frozenset({
    "global_step", "learning_rate", "epoch_num", "step_num", "loss_scale", "scale_sense",
    "current_iterator_step", "last_overflow_iterator_step", "beta1_power", "beta2_power",
})



# ========================================================================================= pure


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

    def sub_plan(self, shard: ExportShard) -> RankPlan:
        return RankPlan(self.target_rank, list(shard.params))


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
    return ExportLayout(rank_plan.target_rank, shards, tuple(left_out), bound)


# ========================================================================================== I/O


@dataclass(frozen=True)
class ExportResult:
    layout: ExportLayout
    shards: tuple[WrittenFile, ...]
    index: WrittenFile  # tensors: {}

    @property
    def files(self) -> list[WrittenFile]:
        return [*self.shards, self.index]


def write_export(layout: ExportLayout, sources, out_dir: str | os.PathLike, *,
                 max_memory: int = DEFAULT_MAX_MEMORY, progress: Progress | None = None) -> ExportResult:
    """Write every shard (each by ``execute_rank`` on its sub-plan), then the index, all atomically.

    `sources` is what ``execute_rank`` reads from (``execute.SourceFiles`` or
    ``MultiFileSources``). The index is written last, so a folder without it is incomplete.
    """
    out_dir = os.path.abspath(os.fspath(out_dir))
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for shard in layout.shards:
        wf = execute_rank(layout.sub_plan(shard), sources, os.path.join(out_dir, shard.file_name),
                          fmt=FORMAT_SAFETENSORS, max_memory=max_memory, progress=progress,
                          metadata=dict(EXPORT_METADATA))
        if sorted(wf.tensors) != sorted(shard.names):  # the writer must not add or drop tensors
            raise PlanError(f"{wf.path}: wrote {len(wf.tensors)} tensors, the shard lists {len(shard.names)}")
        written.append(wf)
    index_path = os.path.join(out_dir, INDEX_FILE)
    size, sha = write_bytes_atomic(index_path, layout.index_bytes())
    return ExportResult(layout, tuple(written), WrittenFile(index_path, size, sha, {}))


def export_safetensors(rank_plan: RankPlan, sources, out_dir: str | os.PathLike, *,
                       max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, include: str = INCLUDE_WEIGHTS,
                       max_memory: int = DEFAULT_MAX_MEMORY, progress: Progress | None = None) -> ExportResult:
    """``plan_export`` then ``write_export``: one full rank's tensors as shards plus index in `out_dir`."""
    layout = plan_export(rank_plan, max_shard_size=max_shard_size, include=include)
    return write_export(layout, sources, out_dir, max_memory=max_memory, progress=progress)


def read_index(out_dir: str | os.PathLike, storage: StorageOptions | None = None) -> dict[str, str]:
    """The weight map of an export folder's index (tensor -> shard file), checked for shape."""
    out_dir = absolute(out_dir)
    where = storage_for(out_dir, storage)
    path = where.join(out_dir, INDEX_FILE)
    try:
        doc = json.loads(where.read_bytes(path, MAX_INDEX_BYTES).decode("utf-8"))
    except FileNotFoundError:
        raise FormatError(path, "index not found (not a safetensors export folder, or an incomplete one)") from None
    except (OSError, StorageError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise FormatError(path, f"cannot be read as JSON ({e})") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise FormatError(path, "expected an object with a 'weight_map' of tensor names to file names")
    bad = next((v for v in weight_map.values() if os.path.basename(v) != v or v in ("", ".", "..")), None)
    if bad is not None:
        raise FormatError(path, f"weight_map names {bad!r}, which is not a file of the export folder")
    return weight_map


def check_against_index(reader, weight_map: dict[str, str], index_path: str) -> None:
    """Every tensor of an export folder's shards (one ``MultiFileReader``) is where the index says,
    and every tensor the index lists is there."""
    for name in reader.names():
        where = os.path.basename(reader.file_of(name))
        if weight_map.get(name) != where:
            raise FormatError(index_path, f"tensor {name!r} is in {where} but the index "
                                          f"says {weight_map.get(name) or 'nothing about it'}")
    absent = [n for n in weight_map if n not in reader]
    if absent:
        raise FormatError(index_path, f"lists tensor {absent[0]!r} in {weight_map[absent[0]]}, which lacks it")


def export_files(out_dir: str | os.PathLike, storage: StorageOptions | None = None) -> tuple[str, ...]:
    """The shard files an export folder's index names (absolute, sorted); FormatError if one is absent."""
    out_dir = absolute(out_dir)
    where = storage_for(out_dir, storage)
    present = {e.name for e in where.listdir(out_dir) if e.is_file}
    names = sorted(set(read_index(out_dir, storage).values()))
    for name in names:
        if name not in present:
            raise FormatError(where.join(out_dir, INDEX_FILE), f"names {name}, which is not in the folder")
    return tuple(where.join(out_dir, name) for name in names)


def open_export(out_dir: str | os.PathLike, *, verify_crc: bool = True) -> MultiFileSources:
    """An export folder as one unsharded source rank (rank 0), its files checked against the index."""
    out_dir = os.path.abspath(os.fspath(out_dir))
    weight_map = read_index(out_dir)
    sources = MultiFileSources({0: export_files(out_dir)}, verify_crc=verify_crc)
    try:
        check_against_index(sources.reader(0), weight_map, os.path.join(out_dir, INDEX_FILE))
    except BaseException:
        sources.close()
        raise
    return sources
