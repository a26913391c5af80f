"""A target rank's plan spread from its stage's rows (``plan.bodies``) is the plan made parameter by
parameter for that rank, for every golden scenario (laid-out, pipeline, merged, split, tied and
unmapped parameters)."""

from __future__ import annotations

from pathlib import Path

import pytest

from reshard_job.api import build_plan
from reshard_job.plan.bodies import RankBodies
from reshard_job.plan.model import COUNTED_NEVER, UNMAPPED_FULL

GOLDEN = Path(__file__).parents[2] / "golden"
SCENARIOS = sorted(p for p in GOLDEN.glob("S*") if (p / "src_checkpoints").is_dir())


def plan_json(scenario: Path, to_itself: bool = False) -> dict:
    src = next((scenario / n for n in ("src_strategy.ckpt", "src_strategy_dir") if (scenario / n).exists()), None)
    dst = src if to_itself else scenario / "dst_strategy.ckpt"
    plan, prepared = build_plan(scenario / "src_checkpoints", src, dst if dst and dst.exists() else None,
                                unmapped=UNMAPPED_FULL)
    prepared.close()
    return plan.to_json()


@pytest.mark.parametrize("to_itself", [False, True], ids=["to_target", "to_own_layout"])
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda p: p.name)
def test_rows_spread_per_stage_plan_each_rank_as_parameter_by_parameter(scenario, to_itself, monkeypatch):
    """To its own layout, a pipeline's tied parameters lie in two target stages (counted in one)."""
    spread = plan_json(scenario, to_itself)
    monkeypatch.setattr(RankBodies, "_make_body", RankBodies._make_body_each)
    assert spread == plan_json(scenario, to_itself)


def test_a_parameter_of_two_target_stages_is_counted_in_its_first_only_either_way(monkeypatch):
    """A tied parameter (an embedding shared by the first and last pipeline stage) is written by
    both target stages and counted by the first."""
    from reshard_job.core.strategy_model import ParamLayout
    from reshard_job.core.tensor_meta import TensorMeta
    from reshard_job.core.topology import Topology
    from reshard_job.plan.planner import Planner

    split = ParamLayout((2,), (0, -1))
    dst = Topology(2, 2, {"emb": {0: split, 1: split}, "w": {0: split}, "x": {1: split}, "y": {0: split, 1: split}})
    index = {0: {n: TensorMeta("Float32", (4, 4)) for n in ("emb", "w", "x", "y", "z")}}

    def plan() -> list:
        ranks = Planner(Topology.unsharded(), dst, index, unmapped=UNMAPPED_FULL).plan().ranks
        return [(rp.target_rank, [(p.name, p.target_shape, p.copies, p.place) for p in rp.params], rp._summary)
                for rp in ranks]

    spread = plan()
    monkeypatch.setattr(RankBodies, "_make_body", RankBodies._make_body_each)
    assert spread == plan()
    emb = [place.counted for _, params, _ in spread for name, _, _, place in params if name == "emb"]
    assert len(emb) == 4 and emb.count(COUNTED_NEVER) == 2  # written by both stages, counted by one
