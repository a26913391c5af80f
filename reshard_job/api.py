"""MindSpore-compatible functions: ``transform_checkpoints``, ``transform_checkpoint_by_rank``,
``rank_list_for_transform``, ``merge_pipeline_strategies`` (alias ``merge_pipeline_strategys``).

Same arguments as MindSpore 2.10's, plus ``output_format`` and a few keyword-only extras. They run
the batch job's own stages (``job.prepare``: sources, strategies, cross-checks, plan; then one rank
task per target file), without its output-directory bookkeeping (journal, manifest, lineage). The
differences from MindSpore are the point of the project: any M→N pair works (MindSpore rejects
8→6), bfloat16 is never widened, memory stays bounded by one slice, only the boxes needed are
read, outputs are written atomically with their sha256, and errors name the file, rank or
parameter at fault.
"""

from __future__ import annotations

import os
from typing import Mapping

from .errors import ConfigError, MissingRankError
from .execute import DEFAULT_MAX_MEMORY
from .formats.base import WrittenFile
from .formats.registry import kind_of
from .formats.strategy import merge_pipeline_strategies, merge_pipeline_strategys  # noqa: F401 (re-export)
from .plan import UNMAPPED_OMIT, Plan, source_ranks_for
from .sources import RankFiles, load_strategy
from .storage import absolute, storage_for
from .tasks import FORMAT_CKPT, OUTPUT_FORMATS, RankResult, WriteOptions

__all__ = [
    "transform_checkpoints",
    "transform_checkpoint_by_rank",
    "rank_list_for_transform",
    "merge_pipeline_strategies",
    "merge_pipeline_strategys",
    "build_plan",
]


def _specs(src_strategy_file, dst_strategy_file, *, src_dir=None, select="latest_step", fmt=FORMAT_CKPT,
           unmapped=UNMAPPED_OMIT):
    from .job.spec import SourceSpec, TargetSpec

    source = SourceSpec(None if src_dir is None else absolute(src_dir),
                        None if src_strategy_file is None else absolute(src_strategy_file), select)
    target = TargetSpec(strategy=None if dst_strategy_file is None else absolute(dst_strategy_file), format=fmt,
                        unmapped=unmapped)
    return source, target


def _check_format(output_format: str) -> str:
    if output_format not in OUTPUT_FORMATS:
        raise ConfigError(f"output_format must be 'ckpt' or 'safetensors', got {output_format!r}")
    return output_format


def _prepare(src_checkpoints_dir, src_strategy_file=None, dst_strategy_file=None, *,
             select: str = "latest_step", unmapped: str = UNMAPPED_OMIT, target_ranks=None):
    from .job.prepare import prepare

    source, target = _specs(src_strategy_file, dst_strategy_file, src_dir=src_checkpoints_dir, select=select,
                            unmapped=unmapped)
    return prepare(source, target, ranks=None if target_ranks is None else tuple(target_ranks))


def build_plan(src_checkpoints_dir, src_strategy_file=None, dst_strategy_file=None, *,
               select: str = "latest_step", unmapped: str = UNMAPPED_OMIT, target_ranks=None) -> tuple[Plan, object]:
    """Discover the sources, load both strategies and plan every (or the given) target rank.

    Returns the plan and the prepared conversion holding the open source readers (``close()`` it)."""
    prepared = _prepare(src_checkpoints_dir, src_strategy_file, dst_strategy_file, select=select, unmapped=unmapped,
                        target_ranks=target_ranks)
    return prepared.plan, prepared


def _run(prepared, paths: dict[int, str], options: WriteOptions, workers: int = 1) -> dict[int, RankResult]:
    from .job.convert import rank_tasks
    from .job.executors import LocalExecutor

    if prepared.missing:
        raise MissingRankError(prepared.missing, prepared.source.checkpoints or "")
    results: dict[int, RankResult] = {}
    tasks = rank_tasks(prepared, paths, options)
    LocalExecutor(workers, prepared.readers).run(tasks, on_bytes=lambda n: None,
                                                 on_done=lambda r: results.__setitem__(r.target_rank, r))
    return results


def transform_checkpoints(src_checkpoints_dir, dst_checkpoints_dir, ckpt_prefix, src_strategy_file=None,
                          dst_strategy_file=None, process_num: int = 1, *, output_format: str = FORMAT_CKPT,
                          unmapped: str = UNMAPPED_OMIT, max_memory: int = DEFAULT_MAX_MEMORY,
                          select: str = "latest_step") -> dict[int, WrittenFile]:
    """Convert every rank of a distributed checkpoint to the destination layout.

    Outputs go to ``<dst>/rank_<r>/<ckpt_prefix><r>.<output_format>``. Returns the written files by
    target rank (path, size, sha256, per-tensor sha256). ``process_num`` worker processes convert
    ranks in parallel.
    """
    from .job.convert import output_paths

    if not isinstance(ckpt_prefix, str):
        raise TypeError("ckpt_prefix must be a str")
    fmt = _check_format(output_format)
    dst_dir = absolute(dst_checkpoints_dir)
    with _prepare(src_checkpoints_dir, src_strategy_file, dst_strategy_file, select=select,
                  unmapped=unmapped) as prepared:
        paths = output_paths(prepared.plan, dst_dir, ckpt_prefix, fmt, storage_for(dst_dir))
        results = _run(prepared, paths, WriteOptions(fmt, max_memory), max(1, int(process_num or 1)))
    return {r: WrittenFile(x.path, x.size, x.sha256, x.tensors) for r, x in sorted(results.items())}


def transform_checkpoint_by_rank(rank_id, checkpoint_files_map: Mapping[int, str], save_checkpoint_file_name,
                                 src_strategy_file=None, dst_strategy_file=None, *,
                                 unmapped: str = UNMAPPED_OMIT, max_memory: int = DEFAULT_MAX_MEMORY) -> WrittenFile:
    """Convert one destination rank from the given source files ({global source rank: path}).

    The output format follows the file name (``.ckpt`` or ``.safetensors``).
    """
    from .job.prepare import prepare_files

    if not isinstance(rank_id, int) or isinstance(rank_id, bool):
        raise TypeError("rank_id must be an int")
    if not isinstance(checkpoint_files_map, Mapping):
        raise TypeError("checkpoint_files_map must be a dict {source rank: checkpoint file}")
    name = absolute(save_checkpoint_file_name)
    fmt = kind_of(name)
    if fmt is None:
        raise ConfigError(f"save_checkpoint_file_name {name} must end with .ckpt or .safetensors")
    files = {int(r): absolute(p) for r, p in checkpoint_files_map.items()}
    for r, p in files.items():
        info = storage_for(p).info(p)
        if info is None or not info.is_file:
            raise ConfigError(f"checkpoint file of source rank {r} not found: {p}")
    kinds = {kind_of(p) or FORMAT_CKPT for p in files.values()}
    source, target = _specs(src_strategy_file, dst_strategy_file, unmapped=unmapped)
    found = RankFiles(os.path.dirname(os.path.commonprefix(list(files.values()))) or "/", files,
                      kinds.pop() if len(kinds) == 1 else FORMAT_CKPT)
    with prepare_files(found, source, target, ranks=(rank_id,)) as prepared:
        result = _run(prepared, {rank_id: name}, WriteOptions(fmt, max_memory))[rank_id]
    return WrittenFile(result.path, result.size, result.sha256, result.tensors)


def rank_list_for_transform(rank_id, src_strategy_file=None, dst_strategy_file=None, *,
                            unmapped: str = UNMAPPED_OMIT) -> list[int]:
    """The source ranks whose checkpoints are read to produce destination rank `rank_id`,
    in descending order (as MindSpore returns them). The ranks the plan reads, plus per source
    stage read from the rank that parameters outside the strategies are copied from: a subset of
    MindSpore's list, and enough on its own."""
    if not isinstance(rank_id, int) or isinstance(rank_id, bool):
        raise TypeError("rank_id must be an int")
    src = load_strategy(None if src_strategy_file is None else absolute(src_strategy_file))
    if src_strategy_file is None:
        return [0]
    dst = load_strategy(None if dst_strategy_file is None else absolute(dst_strategy_file))
    return source_ranks_for(src.topology, dst.topology if dst_strategy_file is not None else None, rank_id,
                            unmapped=unmapped)

