"""MindSpore-compatible functions: ``transform_checkpoints``, ``transform_checkpoint_by_rank``,
``rank_list_for_transform``, ``merge_pipeline_strategies`` (alias ``merge_pipeline_strategys``), and
the names ``mindspore.parallel`` gives them since MindSpore 2.5: ``convert_checkpoints``,
``convert_checkpoint_by_rank``, ``rank_list_for_convert`` (the same functions).

Same arguments as MindSpore 2.10's, positional ones included (``transform_checkpoints(src, dst,
prefix, src_strategy, dst_strategy, process_num, output_format)``), plus a few keyword-only extras. They run
the batch job's own stages (``job.prepare``: sources, strategies, cross-checks, plan; then one rank
task per target file), without its output-directory bookkeeping (journal, manifest, lineage). The
differences from MindSpore are the point of the project: any M→N pair works (MindSpore rejects
8→6), bfloat16 is never widened, memory stays bounded by one slice, only the boxes needed are
read, outputs are written atomically with their sha256, and errors name the file, rank or
parameter at fault.

MindFormers 2.x saves. ``src_checkpoints_dir`` may be a MindFormers checkpoint folder (the one
holding ``latest_checkpointed_iteration.txt``, or one ``iteration_XXXXXXXX/``) with
``src_strategy_file=None``: its ``metadata.json`` gives the layouts. A source rank is then the
tuple of files that rank wrote (``-model-`` and ``-opt-``): in ``transform_checkpoint_by_rank``,
``checkpoint_files_map`` maps a rank to one file or to a tuple of files (the files of one iteration
folder, as ``mindformers_rank_files`` lists them), and ``src_strategy_file`` is None or that
folder's ``metadata.json``; ``rank_list_for_transform`` takes the folder or its ``metadata.json``
as ``src_strategy_file``.

Export for inference. ``output_format="safetensors_index"`` (no destination strategy) writes the
full model into ``dst_checkpoints_dir`` as ``model-00001-of-0000N.safetensors`` shards of at most
``max_shard_size`` bytes of tensor data plus ``model.safetensors.index.json``, loadable by the
``safetensors`` library and by ``transformers``; ``include="weights"`` (default) leaves training
state out, ``include="all"`` keeps it.
"""

from __future__ import annotations

import os
from typing import Mapping

import numpy as np

from reshard_job.errors import ConfigError, MissingRankError, PlanError
from reshard_job.execute.rank_task import DEFAULT_MAX_MEMORY
from reshard_job.plan.export_shards import DEFAULT_MAX_SHARD_SIZE, parse_shard_size
from reshard_job.plan.selection import include_value, patterns_value, rename_value
from reshard_job.formats.base import WrittenFile
from reshard_job.formats.registry import kind_of
from reshard_job.formats.strategy import merge_pipeline_strategies, merge_pipeline_strategys  # noqa: F401 (re-export)
from reshard_job.plan.model import UNMAPPED_OMIT, Plan
from reshard_job.plan.mindspore_rank_list import mindspore_source_ranks
from reshard_job.plan.rank_list import source_ranks_for
from reshard_job.formats.mindformers_metadata import METADATA_FILE
from reshard_job.sources.base import reader_for_files
from reshard_job.sources.mindformers import MindFormersFolder, discover_mindformers
from reshard_job.sources.rank_folders import load_strategy
from reshard_job.storage import absolute, storage_for
from reshard_job.execute.tasks import (FORMAT_CKPT, FORMAT_SAFETENSORS_INDEX, TARGET_FORMATS, RankResult,
                                       WriteOptions)
from reshard_job.sources.open_files import files_of

__all__ = [
    "transform_checkpoints",
    "transform_checkpoint_by_rank",
    "rank_list_for_transform",
    "merge_pipeline_strategies",
    "merge_pipeline_strategys",
    "convert_checkpoints",
    "convert_checkpoint_by_rank",
    "rank_list_for_convert",
    "mindformers_rank_files",
    "build_plan",
]


def _specs(src_strategy_file, dst_strategy_file, *, src_dir=None, select="latest_step", fmt=FORMAT_CKPT,
           unmapped=UNMAPPED_OMIT, iteration=None, max_shard_size=DEFAULT_MAX_SHARD_SIZE, include=None,
           verify_replicas=True, exclude=None, rename=None):
    from reshard_job.job.config.spec import SourceSpec, TargetSpec

    source = SourceSpec(None if src_dir is None else absolute(src_dir),
                        None if src_strategy_file is None else absolute(src_strategy_file), select, iteration=iteration,
                        verify_replicas=_flag(verify_replicas, "verify_replicas"))
    target = TargetSpec(strategy=None if dst_strategy_file is None else absolute(dst_strategy_file), format=fmt,
                        unmapped=unmapped, max_shard_size=parse_shard_size(max_shard_size),
                        include=None if include is None else include_value(include),
                        exclude=patterns_value(exclude), rename=rename_value(rename))
    return source, target


def _check_format(output_format: str, dst_strategy_file=None) -> str:
    if output_format not in TARGET_FORMATS:
        raise ConfigError(f"output_format must be 'ckpt', 'safetensors' or 'safetensors_index', got {output_format!r}")
    if output_format == FORMAT_SAFETENSORS_INDEX and dst_strategy_file is not None:
        raise ConfigError("output_format='safetensors_index' writes the full, unsharded model: "
                          "give dst_strategy_file=None")
    return output_format


def _prepare(src_checkpoints_dir, src_strategy_file=None, dst_strategy_file=None, *,
             select: str = "latest_step", unmapped: str = UNMAPPED_OMIT, target_ranks=None, **extra):
    from reshard_job.job.stages.prepare import prepare

    source, target = _specs(src_strategy_file, dst_strategy_file, src_dir=src_checkpoints_dir, select=select,
                            unmapped=unmapped, **extra)
    return prepare(source, target, ranks=None if target_ranks is None else tuple(target_ranks))


def build_plan(src_checkpoints_dir, src_strategy_file=None, dst_strategy_file=None, *,
               select: str = "latest_step", unmapped: str = UNMAPPED_OMIT, target_ranks=None) -> tuple[Plan, object]:
    """Discover the sources, load both strategies and plan every (or the given) target rank.

    Returns the plan and the prepared conversion holding the open source readers (``close()`` it)."""
    prepared = _prepare(src_checkpoints_dir, src_strategy_file, dst_strategy_file, select=select, unmapped=unmapped,
                        target_ranks=target_ranks)
    return prepared.plan, prepared


def _guard(prepared, paths: dict[int, str], out_dir: str, argument: str, folders: bool = True) -> None:
    """The job's refusals before anything is written: no output over a source file (whatever its
    path), none into a source folder (`folders`) or out of `out_dir` through a link or ``..``."""
    from reshard_job.job.output.directory import OutputDir
    from reshard_job.job.runner import source_places
    from reshard_job.errors import OutputError

    source_dirs, source_files = source_places(prepared)
    out = OutputDir(out_dir, storage_for(out_dir), overwrite=True)
    try:
        out.refuse_if_locked()  # a job is writing there: its manifest would describe files replaced under it
        if folders:
            out.check_not_source(source_dirs, source_files)
        out.check_planned(list(paths.values()), source_files, source_dirs if folders else [])
    except OutputError as e:
        text = str(e)
        raise OutputError(argument + text[len("output.dir"):] if text.startswith("output.dir") else text) from None


def _run(prepared, paths: dict[int, str], options: WriteOptions, workers: int = 1) -> dict[int, WrittenFile]:
    """Run the tasks; written files by target rank, or for an export by file number (index last)."""
    from reshard_job.job.stages.convert import rank_tasks, write_export_index
    from reshard_job.job.run.local import LocalExecutor
    from reshard_job.job.stages.prepare import check_identical

    if prepared.missing:
        raise MissingRankError(prepared.missing, prepared.source.checkpoints or "")
    check_identical(prepared)
    results: dict[int, WrittenFile] = {}

    def done(r: RankResult) -> None:
        results[r.part if r.part is not None else r.target_rank] = WrittenFile(r.path, r.size, r.sha256, dict(r.tensors.items()))

    tasks = rank_tasks(prepared, paths, options)
    LocalExecutor(workers, prepared.readers).run(tasks, on_bytes=lambda n: None, on_done=done)
    if prepared.export is not None:
        path = paths[len(prepared.export.shards)]
        key, path, size, sha = write_export_index(prepared, paths, storage_for(path))
        results[key] = WrittenFile(path, size, sha, {})
    return dict(sorted(results.items()))


def transform_checkpoints(src_checkpoints_dir, dst_checkpoints_dir, ckpt_prefix, src_strategy_file=None,
                          dst_strategy_file=None, process_num: int = 1, output_format: str = FORMAT_CKPT, *,
                          unmapped: str = UNMAPPED_OMIT, max_memory: int = DEFAULT_MAX_MEMORY,
                          select: str = "latest_step", iteration: int | None = None,
                          max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                          include=None, verify_replicas: bool = True, src_strategy=None, dst_strategy=None,
                          exclude=None, rename=None) -> dict[int, WrittenFile]:
    """Convert every rank of a distributed checkpoint to the destination layout.

    Outputs go to ``<dst>/rank_<r>/<ckpt_prefix><r>.<output_format>``. Returns the written files by
    target rank (path, size, sha256, per-tensor sha256). ``process_num`` worker processes convert
    ranks in parallel. `src_checkpoints_dir` may be a MindFormers checkpoint folder (module
    docstring; `iteration` picks another than the latest). ``output_format="safetensors_index"``
    exports the full model into `dst_checkpoints_dir` as shards plus an index (`max_shard_size`,
    `include`); the result is then keyed by file number: shards 0..n-1, the index n.
    `include` (``"all"``, ``"weights"`` or name patterns), `exclude` (name patterns) and `rename`
    (``{old prefix: new prefix}``) convert part of the model or rename it, as ``target.include``,
    ``target.exclude`` and ``target.rename`` do (``plan.selection``); by default everything is
    converted (an export leaves training state out).
    Tensors the source strategy says several ranks hold identically (replicas, tensors it does not
    lay out) are compared by content first; ``verify_replicas=False`` skips that, for checkpoints
    whose replicas differ on purpose. ``src_strategy``/``dst_strategy`` are other spellings of
    ``src_strategy_file``/``dst_strategy_file`` (keyword only; giving both of a pair is an error).
    """
    from reshard_job.job.stages.convert import unit_paths

    src_strategy_file = _one_spelling(src_strategy_file, src_strategy, "src_strategy")
    dst_strategy_file = _one_spelling(dst_strategy_file, dst_strategy, "dst_strategy")

    if (not isinstance(ckpt_prefix, str) or any(c in ckpt_prefix for c in "/\\\0") or ckpt_prefix in (".", "..")
            or not ckpt_prefix.isprintable()):
        raise ConfigError(f"ckpt_prefix must be the start of a file name (no '/'), got {ckpt_prefix!r:.80}")
    workers = _positive_int(process_num, "process_num")
    _positive_int(max_memory, "max_memory")
    fmt = _check_format(output_format, dst_strategy_file)
    dst_dir = absolute(dst_checkpoints_dir)
    with _prepare(src_checkpoints_dir, src_strategy_file, dst_strategy_file, select=select, unmapped=unmapped,
                  fmt=fmt, iteration=iteration, max_shard_size=max_shard_size, include=include,
                  verify_replicas=verify_replicas, exclude=exclude, rename=rename) as prepared:
        paths = unit_paths(prepared, dst_dir, ckpt_prefix, fmt, storage_for(dst_dir))
        _guard(prepared, paths, dst_dir, "dst_checkpoints_dir")
        if prepared.export is not None:
            storage_for(dst_dir).makedirs(dst_dir)
        return _run(prepared, paths, WriteOptions(fmt, max_memory), workers)


def _flag(value, name: str) -> bool:
    """True or False as given: a string such as 'no' is not taken as true (what ``bool()`` would do)."""
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise ConfigError(f"{name} must be True or False, got {value!r:.80}")


def _positive_int(value, name: str) -> int:
    if value is None and name == "process_num":
        return 1
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r:.80}")
    return value


def _one_spelling(value, alias, name: str):
    """`value` (MindSpore's ``<name>_file``) or its keyword-only alias `name`; not both."""
    if alias is None:
        return value
    if value is not None:
        raise TypeError(f"give {name}_file or {name}, not both")
    return alias


def transform_checkpoint_by_rank(rank_id, checkpoint_files_map: Mapping[int, str | tuple[str, ...]],
                                 save_checkpoint_file_name, src_strategy_file=None, dst_strategy_file=None, *,
                                 unmapped: str = UNMAPPED_OMIT, max_memory: int = DEFAULT_MAX_MEMORY,
                                 verify_replicas: bool = True) -> WrittenFile:
    """Convert one destination rank from the given source files ({global source rank: path}).

    The output format follows the file name (``.ckpt`` or ``.safetensors``). For a MindFormers
    save, a rank maps to a file or a tuple of files of one iteration folder (module docstring).
    """
    if not isinstance(rank_id, int) or isinstance(rank_id, bool):
        raise TypeError("rank_id must be an int")
    if not isinstance(checkpoint_files_map, Mapping):
        raise TypeError("checkpoint_files_map must be a dict {source rank: checkpoint file}")
    name = absolute(save_checkpoint_file_name)
    fmt = kind_of(name)
    if fmt is None:
        raise ConfigError(f"save_checkpoint_file_name {name} must end with .ckpt or .safetensors")
    try:
        files = {int(r): tuple(absolute(p) for p in files_of(ps)) for r, ps in checkpoint_files_map.items()}
    except (TypeError, ValueError) as e:
        raise ConfigError(f"checkpoint_files_map must map source ranks to checkpoint files (a path, or a tuple of "
                          f"paths for a MindFormers rank): {e}") from None
    for r, paths in files.items():
        for p in paths:
            info = storage_for(p).info(p)
            if info is None or not info.is_file:
                raise ConfigError(f"checkpoint file of source rank {r} not found: {p}")
    with _prepare_by_rank(rank_id, files, src_strategy_file, dst_strategy_file, unmapped=unmapped,
                          verify_replicas=verify_replicas) as prepared:
        _guard(prepared, {rank_id: name}, os.path.dirname(name), "save_checkpoint_file_name's folder", folders=False)
        return _run(prepared, {rank_id: name}, WriteOptions(fmt, max_memory))[rank_id]


def _prepare_by_rank(rank_id: int, files: dict[int, tuple[str, ...]], src_strategy_file, dst_strategy_file, *,
                     unmapped: str, verify_replicas: bool = True):
    """Sources, strategies and plan of one destination rank from the given files (rank -> paths)."""
    from reshard_job.job.stages.prepare import prepare_from

    reader = reader_for_files(files, src_strategy_file)
    if isinstance(reader, MindFormersFolder):  # its layouts come from its metadata.json
        source, target = _specs(None, dst_strategy_file, src_dir=reader.root, unmapped=unmapped)
    else:
        source, target = _specs(src_strategy_file, dst_strategy_file, unmapped=unmapped,
                                verify_replicas=verify_replicas)
    return prepare_from(reader, reader.discover(source), source, target, ranks=(rank_id,))


def mindformers_rank_files(src_checkpoints_dir, iteration: int | None = None) -> dict[int, tuple[str, ...]]:
    """The files each rank of a MindFormers save wrote ({storage rank: (model file, opt file)}), as
    ``transform_checkpoint_by_rank`` takes them; the latest iteration unless `iteration` is given."""
    return dict(discover_mindformers(absolute(src_checkpoints_dir), iteration)[0].files)


def rank_list_for_transform(rank_id, src_strategy_file=None, dst_strategy_file=None, *,
                            unmapped: str = UNMAPPED_OMIT, minimal: bool = True,
                            src_checkpoints_dir=None) -> list[int]:
    """The source ranks whose checkpoints are read to produce destination rank `rank_id`,
    in descending order (as MindSpore returns them).

    ``minimal=True`` (default): the ranks the plan reads, plus per source stage read from the rank
    that parameters outside the strategies are copied from. Enough for our
    ``transform_checkpoint_by_rank``, and within MindSpore's list (``plan.rank_list`` says where
    not), which MindSpore's own ``transform_checkpoint_by_rank`` requires in full ("The
    checkpoint file of rank N is missing"). ``minimal=False``: MindSpore 2.10's list exactly
    (``plan.mindspore_rank_list``), quirks included.

    Strategies cannot tell a redundancy-removed save (``save_checkpoint(...,
    remove_redundancy=True)``, MindFormers' ``save_remove_redundancy``), where each slice is stored
    by one of its replicas only: a list from strategies alone may then name files that lack the
    slices. Give the save (``src_checkpoints_dir``, or a MindFormers folder as
    `src_strategy_file`, whose metadata.json records where each shard is stored) and the list
    names the ranks whose files hold the needed slices, as the conversion reads them (plus any
    rank our ``transform_checkpoint_by_rank`` asks for when given only those files); with
    ``minimal=False`` MindSpore's list is added to it.
    """
    if not isinstance(rank_id, int) or isinstance(rank_id, bool):
        raise TypeError("rank_id must be an int")
    minimal = _flag(minimal, "minimal")
    if src_strategy_file is None and src_checkpoints_dir is None:
        return [0]
    src_topology, mf_folder = (None, None) if src_strategy_file is None else _source_topology(absolute(src_strategy_file))
    if src_checkpoints_dir is not None or (mf_folder is not None and mf_folder.save.deduplicated):
        ranks = set(_ranks_read(rank_id, src_checkpoints_dir, src_strategy_file, dst_strategy_file, mf_folder,
                                unmapped))
        if not minimal:
            ranks |= set(_mindspore_list(rank_id, src_topology, src_checkpoints_dir, dst_strategy_file))
        return sorted(ranks, reverse=True)
    dst = _dst_topology(dst_strategy_file)
    if not minimal:
        return mindspore_source_ranks(src_topology, dst, rank_id)
    return source_ranks_for(src_topology, dst, rank_id, unmapped=unmapped)


def _mindspore_list(rank_id: int, src_topology, src_checkpoints_dir, dst_strategy_file) -> list[int]:
    """MindSpore's list next to a save: from the source strategy, or a MindFormers save's layouts;
    [0] without either, as MindSpore answers without a source strategy."""
    if src_topology is None and src_checkpoints_dir is not None and MindFormersFolder.detect(
            absolute(src_checkpoints_dir)):
        src_topology = _source_topology(absolute(src_checkpoints_dir))[0]
    if src_topology is None:
        return [0]
    return mindspore_source_ranks(src_topology, _dst_topology(dst_strategy_file), rank_id)


def _dst_topology(dst_strategy_file):
    return None if dst_strategy_file is None else load_strategy(absolute(dst_strategy_file)).topology


def _ranks_read(rank_id: int, src_checkpoints_dir, src_strategy_file, dst_strategy_file, mf_folder,
                unmapped: str) -> list[int]:
    """The source ranks the conversion of `rank_id` reads, planned from the checkpoints themselves
    (the job's own sources and plan: a slice is read from whichever file holds it)."""
    if dst_strategy_file is None and rank_id != 0:
        raise PlanError(f"target rank {rank_id} is outside 0..0 (without a target strategy the one target rank "
                        "holds the whole model)")
    if mf_folder is not None:  # its metadata.json is the strategy and the map of the files
        src_checkpoints_dir, src_strategy_file = mf_folder.root, None
    elif MindFormersFolder.detect(absolute(src_checkpoints_dir)):
        src_strategy_file = None
    plan, prepared = build_plan(src_checkpoints_dir, src_strategy_file, dst_strategy_file, unmapped=unmapped,
                                target_ranks=[rank_id])
    with prepared:
        if prepared.missing:
            raise MissingRankError(prepared.missing, prepared.source.checkpoints or "")
        ranks = set(plan.rank(rank_id).source_ranks)
        paths = (prepared.every_file or prepared.found).files
    return _enough_by_rank(rank_id, ranks, paths, src_strategy_file, dst_strategy_file, unmapped)


def _enough_by_rank(rank_id: int, ranks: set[int], paths: Mapping, src_strategy_file, dst_strategy_file,
                    unmapped: str) -> list[int]:
    """`ranks`, plus any rank ``transform_checkpoint_by_rank`` asks for given only their files.

    Given some files only, the per-rank conversion takes a slice from the rank MindSpore reads it
    from whenever that rank's file is absent (it may hold it), even when a file at hand holds the
    same slice: such ranks are added, so that the list's files alone always convert the rank."""
    for _ in range(len(paths)):
        files = {r: tuple(files_of(paths[r])) for r in sorted(ranks)}
        with _prepare_by_rank(rank_id, files, src_strategy_file, dst_strategy_file, unmapped=unmapped) as prepared:
            wanted = set(prepared.missing) & set(paths)
        if not wanted - ranks:
            break
        ranks |= wanted
    return sorted(ranks, reverse=True)


def _source_topology(src_strategy: str):
    """(topology, MindFormers folder or None) of a strategy file (or per-stage folder), or of a
    MindFormers folder or its metadata.json (whose layouts are the strategy)."""
    if os.path.basename(src_strategy) == METADATA_FILE and os.path.isfile(src_strategy):
        folder = MindFormersFolder(os.path.dirname(src_strategy))
        return folder.layouts().topology, folder
    if MindFormersFolder.detect(src_strategy):  # a MindFormers folder is its own strategy
        folder = MindFormersFolder(src_strategy)
        return folder.layouts().topology, folder
    return load_strategy(src_strategy).topology, None  # a strategy file, or a folder of per-stage files


# MindSpore 2.5+ names (``mindspore.parallel.convert_checkpoints`` & co.): the same functions, so the
# same arguments by position and by keyword (``ckpt_prefix``, ``src_strategy_file``, ``process_num``, ...)
convert_checkpoints = transform_checkpoints
convert_checkpoint_by_rank = transform_checkpoint_by_rank
rank_list_for_convert = rank_list_for_transform
