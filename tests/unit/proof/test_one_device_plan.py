"""The one-device plan of the sources made with the conversion's plan (``Planner.one_device``,
``prepare(one_device=True)``) is the plan ``single_device_plan`` makes on its own, on every golden
source and whatever the conversion's target leaves out; where the target is one device, the
conversion's own plan serves, and reads every converted parameter as that plan does."""

from __future__ import annotations

from pathlib import Path

import pytest

from reshard_job.job.config.spec import SourceSpec, TargetSpec
from reshard_job.job.stages.prepare import prepare
from reshard_job.plan.model import UNMAPPED_FULL
from reshard_job.proof.collect import single_device_plan

GOLDEN = Path(__file__).parents[2] / "golden"
# a compiled strategy of one device that lays out every parameter
ONE_DEVICE_LAYOUT = {"mesh": {"dp": 1, "mp": 1}, "rules": [{"match": ".*", "dims": []}]}
SCENARIOS = sorted(p.name for p in GOLDEN.iterdir() if (p / "manifest.json").is_file())


def _targets(d: Path) -> list[TargetSpec]:
    out = [TargetSpec(devices=1), TargetSpec(devices=3), TargetSpec(devices=1, layout=ONE_DEVICE_LAYOUT)]
    if (d / "dst_strategy.ckpt").exists():
        out += [TargetSpec(strategy=str(d / "dst_strategy.ckpt"), unmapped=u) for u in ("omit", "drop", "full")]
    return out


def _source(d: Path) -> SourceSpec:
    if (d / "src_mindformers").exists():
        return SourceSpec(str(d / "src_mindformers"))
    strategy = next((str(p) for p in (d / "src_strategy.ckpt", d / "src_strategy_dir") if p.exists()), None)
    return SourceSpec(str(d / "src_checkpoints"), strategy)


@pytest.mark.parametrize("name", SCENARIOS)
def test_the_one_device_plan_made_with_the_conversions_is_the_one_made_alone(name):
    d = GOLDEN / name
    compared = 0
    for target in _targets(d):
        try:
            prepared = prepare(_source(d), target, one_device=True)
        except Exception:  # a target this source cannot take: refused as without one_device
            with pytest.raises(Exception):
                prepare(_source(d), target)
            continue
        with prepared:
            assert prepared.one_device is not None
            alone = single_device_plan(prepared.strategy, prepared.index, unmapped=UNMAPPED_FULL)
            if prepared.one_device is prepared.plan.ranks[0]:  # a one-device target: its own plan
                assert prepared.target.topology is None or prepared.target.topology.devices == 1
                assert _reads(prepared.one_device, converted=prepared.plan) == _reads(alone, converted=prepared.plan)
            else:
                assert prepared.one_device.to_json() == alone.to_json()
            compared += 1
    assert compared >= 1
    with prepare(_source(d), TargetSpec(devices=1)) as prepared:
        assert prepared.one_device is None  # only when asked for


def _reads(rank_plan, converted) -> dict[str, tuple]:
    """What the fingerprints' taps take of each converted tensor: its facts and its copies."""
    names = {p.name for rp in converted.ranks for p in rp.params}
    return {p.name: (p.tensor.dtype, p.tensor.kind, tuple(p.tensor.global_shape), p.copies)
            for p in rank_plan.params if p.name in names}


def test_a_one_device_target_serves_as_its_own_one_device_plan():
    d = GOLDEN / "S1_mlp_tutorial_8to4"
    for target in (TargetSpec(devices=1), TargetSpec(devices=1, layout=ONE_DEVICE_LAYOUT)):
        with prepare(_source(d), target, one_device=True) as prepared:
            assert prepared.one_device is prepared.plan.ranks[0]
    with prepare(_source(d), TargetSpec(devices=2, layout={"mesh": {"mp": 2}, "rules": [{"match": ".*", "dims": []}]}), one_device=True) as prepared:
        assert prepared.one_device not in prepared.plan.ranks


def _facts(plan_ranks) -> dict[str, object]:
    out = {}
    for rank_plan in plan_ranks:
        params = rank_plan.params
        for t in getattr(params, "tensors", None) or [p.tensor for p in params]:
            out.setdefault(t.name, t)
    return out


def test_the_two_plans_share_the_facts_of_each_parameter_they_treat_alike():
    d = GOLDEN / "S1_mlp_tutorial_8to4"
    with prepare(_source(d), TargetSpec(devices=1), one_device=True) as prepared:
        converted, alone = _facts(prepared.plan.ranks), _facts([prepared.one_device])
    assert converted.keys() == alone.keys() and converted
    assert all(alone[n] is t for n, t in converted.items())  # one object, not an equal copy
    with prepare(_source(d), TargetSpec(strategy=str(d / "dst_strategy.ckpt"), unmapped="full"),
                 one_device=True) as prepared:
        converted, alone = _facts(prepared.plan.ranks), _facts([prepared.one_device])
    differ = [n for n, t in converted.items() if t.action != alone[n].action]  # left out of the target: full
    assert all((alone[n] is t) == (n not in differ) for n, t in converted.items())
