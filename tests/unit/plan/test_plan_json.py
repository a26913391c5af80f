"""A plan survives its JSON form (what plan.json and the lineage record hold)."""

from __future__ import annotations

import json
from pathlib import Path

from reshard_job.api import build_plan
from reshard_job.plan.model import Plan

S3 = Path(__file__).parents[2] / "golden" / "S3_pipeline2x4opt_to_4"


def test_plan_round_trips_through_json():
    plan, sources = build_plan(S3 / "src_checkpoints", S3 / "src_strategy_dir", S3 / "dst_strategy.ckpt")
    sources.close()
    doc = json.loads(json.dumps(plan.to_json()))
    again = Plan.from_json(doc)
    assert [(rp.target_rank, [(p.name, p.action, p.target_shape, p.copies) for p in rp.params]) for rp in again.ranks] == \
           [(rp.target_rank, [(p.name, p.action, p.target_shape, p.copies) for p in rp.params]) for rp in plan.ranks]
    assert doc["totals"] == plan.totals() and doc["omitted"] == plan.omitted
    tensor, slice_ = doc["ranks"][0]["params"][:2]  # index pairs into the shared tables
    target_shape, _, copies = doc["slices"][slice_]
    assert doc["tensors"][tensor][0] == plan.ranks[0].params[0].name
    first = copies[0]
    assert isinstance(first[0], int) and len(first[1]) == 2 * len(target_shape)


def test_a_plan_written_in_pieces_is_the_plan_and_is_what_the_lineage_keeps(tmp_path):
    """The lineage store writes the plan from ``to_json(lazy=True)`` (its long tables made as they
    are written): the text must be exactly that of the eager document, and reading the run's plan
    back from the database must give that document."""
    from reshard_job.jsonchunks import iter_json
    from reshard_job.lineage import LineageStore
    from reshard_job.audit.queries import run_details

    plan, sources = build_plan(S3 / "src_checkpoints", S3 / "src_strategy_dir", S3 / "dst_strategy.ckpt")
    sources.close()
    eager = plan.to_json()
    assert "".join(iter_json(plan.to_json(lazy=True))) == json.dumps(eager)
    with LineageStore(f"sqlite:///{tmp_path / 'lineage.db'}") as store:
        store.ensure_schema()
        run_id = store.start_run(config={"x": 1}, overrides=[], tool_version="t", output_dir=str(tmp_path / "out"),
                                 source_devices=None, target_devices=None)
        store.record_plan(run_id, plan.to_json(lazy=True))
        with store.read_session() as session:
            assert run_details(session, run_id).plan == json.loads(json.dumps(eager))
