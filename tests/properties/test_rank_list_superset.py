"""Our rank list (what a plan reads) against MindSpore's (``minimal=False``) on random layouts,
pipelines, optimizer sharding and multi-axis maps included: ours is within MindSpore's, but for
the file parameters outside the strategies are copied from (stage 0's rank r mod F), which
MindSpore's list lacks when the target stage's parameters all come from later source stages.

MindSpore's own quirk is left out: with one device per target stage it takes `rank_id` itself as
the local rank (spec/resharding-semantics.md §7.2), so for rank_id >= 1 it may name another
replica than its converter then reads.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings

from reshard_job.errors import PlanError
from reshard_job.plan.mindspore_rank_list import mindspore_source_ranks
from reshard_job.plan.rank_list import source_ranks_for

from .test_roundtrip_properties import cases, topology


@settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(case=cases(pipeline=True))
def test_ours_is_within_mindspores(case):
    src, dst = topology(case.src), topology(case.dst)
    if src is None:
        return
    for t in range(dst.devices if dst else 1):
        if t >= 1 and (dst is None or dst.stage_devices == 1):
            continue  # MindSpore's rank_id-as-local-rank quirk
        ours = source_ranks_for(src, dst, t)
        try:
            theirs = mindspore_source_ranks(src, dst, t)
        except PlanError:  # layouts MindSpore's converter refuses (e.g. an optimizer step it cannot rebuild)
            return
        assert theirs == sorted(theirs, reverse=True)
        r = (t % dst.stage_devices if dst else t) % src.stage_devices
        assert set(ours) <= set(theirs) | {r}, (t, ours, theirs)
