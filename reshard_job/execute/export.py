"""Export for inference: the full model as size-bounded safetensors shards plus an index.

The layout is the one ``transformers`` and inference servers load (``formats.hf_index``). It is
what MindSpore's ``unified_safetensors`` offers, but streamed: each shard is written by
``execute_rank`` from a slice of an ordinary plan, so memory stays bounded by one slice in flight,
never by a shard or the model. Which tensor goes to which shard is planned in
``plan.export_shards`` (pure).

Input. The plan of one full target rank: a ``Planner`` with no target strategy gives one target
rank holding every tensor whole, and that ``RankPlan`` is what gets split into shards. Anything
else (a rank of a sharded target) is refused, because its tensors are not the model's.

Metadata. ``execute_rank`` writes MindSpore's flavour of safetensors by default, whose
``__metadata__`` is ``{"format": "ms"}``; ``transformers`` refuses a shard whose ``format`` is not
one of ``pt``, ``tf``, ``flax``, ``mlx``, so every shard is written with ``EXPORT_METADATA``
(``{"format": "pt"}``), which the ``safetensors`` library reads as well. The shard names are
always numbered, and the index is always written (last, so a folder without it is incomplete),
even for one shard, so a reader has one layout to expect. With several shards MindSpore's
``param_name_map.json`` is written too (before the index): ``load_distributed_checkpoint(...,
unified_safetensors_dir=...)`` refuses a folder of several shards without it. Tensor names are MindSpore's parameter
names; mapping them to a ``transformers`` architecture's names is not done here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from reshard_job.errors import PlanError
from reshard_job.execute.rank_task import DEFAULT_MAX_MEMORY, Progress, execute_rank
from reshard_job.execute.tasks import FORMAT_SAFETENSORS
from reshard_job.formats.ckpt import WrittenFile
from reshard_job.formats.hf_index import EXPORT_METADATA, INDEX_FILE, PARAM_NAME_MAP_FILE
from reshard_job.plan.export_shards import DEFAULT_MAX_SHARD_SIZE, INCLUDE_WEIGHTS, ExportLayout, plan_export
from reshard_job.plan.model import RankPlan
from reshard_job.storage import storage_for
from reshard_job.storage.atomic import write_bytes_atomic


@dataclass(frozen=True)
class ExportResult:
    layout: ExportLayout
    shards: tuple[WrittenFile, ...]
    index: WrittenFile  # tensors: {}
    param_name_map: WrittenFile | None = None  # MindSpore's, with several shards; tensors: {}

    @property
    def files(self) -> list[WrittenFile]:
        return [*self.shards, self.index, *([self.param_name_map] if self.param_name_map else [])]


def write_export(layout: ExportLayout, sources, out_dir: str | os.PathLike, *,
                 max_memory: int = DEFAULT_MAX_MEMORY, progress: Progress | None = None) -> ExportResult:
    """Write every shard (each by ``execute_rank`` on its sub-plan), then the index, all atomically.

    `sources` is what ``execute_rank`` reads from (``sources.open_files.SourceFiles`` or
    ``MultiFileSources``). The index is written last, so a folder without it is incomplete.
    """
    out_dir = os.path.abspath(os.fspath(out_dir))
    storage_for(out_dir).makedirs(out_dir)
    written = []
    for shard in layout.shards:
        wf = execute_rank(layout.sub_plan(shard), sources, os.path.join(out_dir, shard.file_name),
                          fmt=FORMAT_SAFETENSORS, max_memory=max_memory, progress=progress,
                          metadata=dict(EXPORT_METADATA))
        if sorted(wf.tensors) != sorted(shard.names):  # the writer must not add or drop tensors
            raise PlanError(f"{wf.path}: wrote {len(wf.tensors)} tensors, the shard lists {len(shard.names)}")
        written.append(wf)
    name_map, data = None, layout.param_name_map_bytes()
    if data is not None:  # several shards: what MindSpore's load_distributed_checkpoint(unified_safetensors_dir) needs
        map_path = os.path.join(out_dir, PARAM_NAME_MAP_FILE)
        name_map = WrittenFile(map_path, *write_bytes_atomic(map_path, data), {})
    index_path = os.path.join(out_dir, INDEX_FILE)
    size, sha = write_bytes_atomic(index_path, layout.index_bytes())
    return ExportResult(layout, tuple(written), WrittenFile(index_path, size, sha, {}), name_map)


def export_safetensors(rank_plan: RankPlan, sources, out_dir: str | os.PathLike, *,
                       max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, include: str = INCLUDE_WEIGHTS,
                       max_memory: int = DEFAULT_MAX_MEMORY, progress: Progress | None = None) -> ExportResult:
    """``plan_export`` then ``write_export``: one full rank's tensors as shards plus index in `out_dir`."""
    layout = plan_export(rank_plan, max_shard_size=max_shard_size, include=include)
    return write_export(layout, sources, out_dir, max_memory=max_memory, progress=progress)
