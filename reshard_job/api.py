"""MindSpore-compatible functions: ``transform_checkpoints``, ``transform_checkpoint_by_rank``,
``rank_list_for_transform``, ``merge_pipeline_strategies`` (alias ``merge_pipeline_strategys``).

Same arguments as MindSpore 2.10's, plus ``output_format`` and a few keyword-only extras. The
differences are the point of the project: any M→N pair works (MindSpore rejects 8→6), bfloat16 is
never widened, memory stays bounded by one slice, only the boxes needed are read, outputs are
written atomically with their sha256, and errors name the file, rank or parameter at fault.
"""

from __future__ import annotations

import os
from typing import Mapping

from .errors import ConfigError, PlanError
from .execute import DEFAULT_MAX_MEMORY, SourceFiles, execute_rank
from .formats.base import WrittenFile
from .tasks import FORMAT_CKPT, FORMAT_SAFETENSORS
from .formats.strategy import merge_pipeline_strategies, merge_pipeline_strategys  # noqa: F401 (re-export)
from .plan import UNMAPPED_OMIT, Plan, Planner, source_ranks_for
from .sources import discover, load_strategy

__all__ = [
    "transform_checkpoints",
    "transform_checkpoint_by_rank",
    "rank_list_for_transform",
    "merge_pipeline_strategies",
    "merge_pipeline_strategys",
    "build_plan",
]


def output_path(dst_dir: str, prefix: str, rank: int, fmt: str = FORMAT_CKPT) -> str:
    """``<dst>/rank_<r>/<prefix><r>.<fmt>``, MindSpore's naming."""
    return os.path.join(dst_dir, f"rank_{rank}", f"{prefix}{rank}.{fmt}")


def _check_format(output_format: str) -> str:
    if output_format not in (FORMAT_CKPT, FORMAT_SAFETENSORS):
        raise ConfigError(f"output_format must be 'ckpt' or 'safetensors', got {output_format!r}")
    return output_format


def build_plan(src_checkpoints_dir, src_strategy_file=None, dst_strategy_file=None, *,
               select: str = "last", unmapped: str = UNMAPPED_OMIT, target_ranks=None) -> tuple[Plan, SourceFiles]:
    """Discover the sources, load both strategies and plan every (or the given) target rank."""
    found = discover(src_checkpoints_dir, select)
    src = load_strategy(src_strategy_file)
    dst = load_strategy(dst_strategy_file)
    files = {r: p for r, p in found.files.items() if r < src.topology.devices}
    sources = SourceFiles(files)
    try:
        planner = Planner(src.topology, dst.topology if dst_strategy_file is not None else None,
                          sources.index(), unmapped=unmapped)
        plan = planner.plan(target_ranks)
    except BaseException:
        sources.close()
        raise
    return plan, sources


def transform_checkpoints(src_checkpoints_dir, dst_checkpoints_dir, ckpt_prefix, src_strategy_file=None,
                          dst_strategy_file=None, process_num: int = 1, *, output_format: str = FORMAT_CKPT,
                          unmapped: str = UNMAPPED_OMIT, max_memory: int = DEFAULT_MAX_MEMORY,
                          select: str = "last") -> dict[int, WrittenFile]:
    """Convert every rank of a distributed checkpoint to the destination layout.

    Outputs go to ``<dst>/rank_<r>/<ckpt_prefix><r>.<output_format>``. Returns the written files by
    target rank (path, size, sha256, per-tensor sha256). ``process_num`` is accepted for MindSpore
    compatibility; the batch job (``python -m reshard_job``) runs ranks in parallel.
    """
    if not isinstance(ckpt_prefix, str):
        raise TypeError("ckpt_prefix must be a str")
    fmt = _check_format(output_format)
    plan, sources = build_plan(src_checkpoints_dir, src_strategy_file, dst_strategy_file,
                               select=select, unmapped=unmapped)
    dst_dir = os.path.abspath(os.fspath(dst_checkpoints_dir))
    out: dict[int, WrittenFile] = {}
    with sources:
        for rp in plan.ranks:
            out[rp.target_rank] = execute_rank(rp, sources, output_path(dst_dir, ckpt_prefix, rp.target_rank, fmt),
                                               fmt=fmt, max_memory=max_memory)
    return out


def transform_checkpoint_by_rank(rank_id, checkpoint_files_map: Mapping[int, str], save_checkpoint_file_name,
                                 src_strategy_file=None, dst_strategy_file=None, *,
                                 unmapped: str = UNMAPPED_OMIT, max_memory: int = DEFAULT_MAX_MEMORY) -> WrittenFile:
    """Convert one destination rank from the given source files ({global source rank: path}).

    The output format follows the file name (``.ckpt`` or ``.safetensors``).
    """
    if not isinstance(rank_id, int) or isinstance(rank_id, bool):
        raise TypeError("rank_id must be an int")
    if not isinstance(checkpoint_files_map, Mapping):
        raise TypeError("checkpoint_files_map must be a dict {source rank: checkpoint file}")
    name = os.fspath(save_checkpoint_file_name)
    if name.endswith(".ckpt"):
        fmt = FORMAT_CKPT
    elif name.endswith(".safetensors"):
        fmt = FORMAT_SAFETENSORS
    else:
        raise ConfigError(f"save_checkpoint_file_name {name} must end with .ckpt or .safetensors")
    for r, p in checkpoint_files_map.items():
        if not os.path.isfile(p):
            raise ConfigError(f"checkpoint file of source rank {r} not found: {p}")
    src = load_strategy(src_strategy_file)
    dst = load_strategy(dst_strategy_file)
    files = {int(r): os.path.abspath(p) for r, p in checkpoint_files_map.items()}
    with SourceFiles(files) as sources:
        planner = Planner(src.topology, dst.topology if dst_strategy_file is not None else None,
                          sources.index(), unmapped=unmapped)
        plan = planner.plan([rank_id])
        return execute_rank(plan.ranks[0], sources, os.path.abspath(name), fmt=fmt, max_memory=max_memory)


def rank_list_for_transform(rank_id, src_strategy_file=None, dst_strategy_file=None, *,
                            unmapped: str = UNMAPPED_OMIT) -> list[int]:
    """The source ranks whose checkpoints are read to produce destination rank `rank_id`,
    in descending order (as MindSpore returns them). The ranks the plan reads, plus per source
    stage read from the rank that parameters outside the strategies are copied from: a subset of
    MindSpore's list, and enough on its own."""
    if not isinstance(rank_id, int) or isinstance(rank_id, bool):
        raise TypeError("rank_id must be an int")
    src = load_strategy(src_strategy_file)
    if src_strategy_file is None:
        return [0]
    dst = load_strategy(dst_strategy_file)
    return source_ranks_for(src.topology, dst.topology if dst_strategy_file is not None else None, rank_id,
                            unmapped=unmapped)
