"""Our ``rank_list_for_transform``: the source ranks one target rank reads, from the strategies alone.

A target rank reads only source ranks whose boxes intersect its own box, so the list is the set a
plan actually reads, plus per source stage read from the file that parameters outside the
strategies are copied from. It is within MindSpore's list (``plan.mindspore_rank_list``, which
gathers whole groups of ranks), but for stage 0's such file when MindSpore's list holds no stage-0
rank, and for MindSpore's quirk with one device per target stage (it then takes ``rank_id``
itself as the local rank).

Strategies cannot tell a redundancy-removed save (each slice stored by one of its replicas only):
for one, the list must come from the save itself (``api.rank_list_for_transform`` with the
checkpoints).
"""

from __future__ import annotations

from reshard_job.core.layout import Layout, common_ndim
from reshard_job.core.topology import Topology
from reshard_job.errors import PlanError
from reshard_job.plan.model import UNMAPPED_FULL, UNMAPPED_OMIT
from reshard_job.plan.patterns import needed_local_ranks
from reshard_job.text import shorten


def source_ranks_for(src: Topology, dst: Topology | None, target_rank: int, *,
                     unmapped: str = UNMAPPED_OMIT) -> list[int]:
    """The source ranks a plan reads for one target rank, from the strategies alone.

    Shapes do not matter (a copy pattern only depends on the two layouts), so every strategy
    parameter is planned on its unit shape. Parameters outside the source strategy (copied, or
    whole tensors such as ``global_step``) are read from source local rank ``r mod F`` of the
    lowest stage holding them, so that rank of stage 0 and of every stage read from is included:
    given only these files, the plan takes such parameters from the same file as with all files
    at hand.
    """
    dst_t = dst if dst is not None else Topology.unsharded()
    T, F = dst_t.stage_devices, src.stage_devices
    if not isinstance(target_rank, int) or target_rank < 0 or (dst is not None and target_rank >= dst_t.devices):
        raise PlanError(f"target rank {shorten(target_rank, 40)} is outside 0..{dst_t.devices - 1}")
    if dst is None:
        # MindSpore takes `rank_id` itself as the local rank when there is no target strategy
        # (one whole checkpoint): the list is that of the replicas source rank `rank_id mod F`
        # reads. Kept so our list stays a subset of MindSpore's for any rank_id.
        t_stage, r = 0, target_rank
    else:
        t_stage, r = divmod(target_rank, T)
    needed = {r % F}
    for name, per_stage in src.layouts.items():
        if dst is not None:
            if name not in dst:
                if unmapped != UNMAPPED_FULL:
                    continue
                t_layout = None
            elif t_stage not in dst.stages_of(name):
                continue
            else:
                t_layout = dst.layout(name, t_stage)
        else:
            t_layout = None
        stage = min(per_stage)
        rec = per_stage[stage]
        ndim = common_ndim([rec] if t_layout is None else [rec, t_layout])
        s = Layout.from_recorded(rec, ndim, F, name)
        t = Layout.from_recorded(t_layout, ndim, T, name) if t_layout is not None else Layout.replicated(ndim, T)
        needed.update(stage * F + q for q in needed_local_ranks(s, t, r))
        needed.add(stage * F + r % F)
    return sorted(needed, reverse=True)
