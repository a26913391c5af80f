"""MindFormers layouts as a strategy file: how a MindFormers save meets the planner (pure).

The planner understands MindSpore strategy files, so the metadata layouts are turned into a
``StrategyFile`` of ``ParamLayout``s (keys ``"<stage>-<name>"`` when there are pipeline stages).
That is exact, not an approximation: MindFormers' layouts already have the optimizer split folded
into the tensor map (extra axes on dimension 0, sometimes a split device axis), and
``reshard_job.core.layout.Layout`` reads a multi-axis tensor map the same way the spec computes a
shard (first-listed axis most significant, axes counted from the right), so the synthesized
layouts carry no optimizer-shard fields.
"""

from __future__ import annotations

from reshard_job.core.strategy_model import FORMAT_PROTOBUF, MERGED_KEY, ParamLayout, StrategyFile
from reshard_job.formats.mindformers_metadata import MindFormersFormatError, ParamMetadata, brief, short_name


def synthesize_strategy(params: dict[str, ParamMetadata], path: str) -> StrategyFile | None:
    """The metadata layouts as a strategy file the planner reads (pure); None when nothing is sharded.

    Every layout must cover one whole pipeline stage: ``rank_list`` is ``range(s*S, s*S+S)`` for
    one stage size ``S`` shared by all parameters. Keys are ``"<stage>-<name>"`` when there are
    several stages (or when a plain name would itself look like such a key).
    """
    laid_out = [p for p in params.values() if p.layout is not None]
    if not laid_out:
        return None
    sizes = {len(p.layout.rank_list) for p in laid_out}
    if len(sizes) > 1:
        raise MindFormersFormatError(
            path, f"layouts cover different numbers of ranks {sorted(sizes)}; "
                  f"every layout must cover one pipeline stage")
    stage_size = sizes.pop()
    stage_of: dict[str, int] = {}
    for p in laid_out:
        ranks = p.layout.rank_list
        stage = ranks[0] // stage_size
        if ranks != tuple(range(stage * stage_size, (stage + 1) * stage_size)):
            raise MindFormersFormatError(
                path, f"parameter {short_name(p.name)!r}: rank_list {brief(list(ranks))} is not one pipeline stage "
                      f"of {stage_size} consecutive ranks")
        stage_of[p.name] = stage
    stages = sorted(set(stage_of.values()))
    if stages != list(range(len(stages))):
        empty = sorted(set(range(stages[-1] + 1)) - set(stages))
        raise MindFormersFormatError(path, f"no parameter lives in pipeline stage(s) {empty} (found stages {stages})")
    merged = len(stages) > 1 or any(MERGED_KEY.match(name) for name in stage_of)
    layouts = {}
    for p in laid_out:
        key = f"{stage_of[p.name]}-{p.name}" if merged else p.name
        layouts[key] = ParamLayout(dev_matrix=p.layout.device_matrix, tensor_map=p.layout.tensor_map,
                                   tensor_shape=p.global_shape)
    return StrategyFile(layouts, [], 1, FORMAT_PROTOBUF, path)
