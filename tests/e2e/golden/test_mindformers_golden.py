"""The MindFormers golden scenarios (saves written by MindFormers 2.1's own saver) planned by the
unchanged Planner from the synthesized strategy and executed through the multi-file reader give
exactly the tensors MindFormers' own loader put into the destination network.

``global_step`` and ``learning_rate`` sit in every opt file but not in metadata.json; the manifest
flags them ``quirk_not_in_metadata_optional``: an output may leave them out, and if it has them
they must be the saved values.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reshard_job.execute.tasks import FORMAT_CKPT, FORMAT_SAFETENSORS

from reshard_job.execute.rank_task import execute_rank
from reshard_job.formats.ckpt import CheckpointReader
from reshard_job.sources.mindformers_save import load_mindformers
from reshard_job.formats.strategy import read_strategy
from reshard_job.plan.planner import Planner
from reshard_job.core.topology import Topology

GOLDEN = Path(__file__).resolve().parents[2] / "golden"
SCENARIOS = sorted(p for p in GOLDEN.iterdir() if (p / "src_mindformers").is_dir())
OPTIONAL = "quirk_not_in_metadata_optional"


def test_both_mindformers_goldens_are_present():
    assert [p.name[:3] for p in SCENARIOS] == ["M1a", "M1b"]


def expected(manifest: dict, rank: int) -> tuple[dict[str, str], set[str]]:
    """(name -> sha256 that must match, names that may be absent)."""
    cats = manifest["verification"]["mindformers_load_checkpoint"]["categories"][str(rank)]
    want = {n: e["sha256"] for n, e in manifest["expected"][str(rank)].items()}
    return want, {n for n, c in cats.items() if c == OPTIONAL}


@pytest.mark.parametrize("fmt", [FORMAT_CKPT, FORMAT_SAFETENSORS])
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda p: p.name)
def test_golden_conversion_matches_mindformers_loader(scenario, fmt, tmp_path):
    manifest = json.loads((scenario / "manifest.json").read_text())
    src = load_mindformers(scenario / "src_mindformers")
    assert src.devices == manifest["src"]["device_num"]
    assert src.topology.num_stages == manifest["src"]["pipeline_stages"]
    dst = Topology.from_strategy(read_strategy(scenario / manifest["dst"]["strategy_file"]))
    plan = Planner(src.topology, dst, src.index()).plan()
    assert sorted(rp.target_rank for rp in plan.ranks) == sorted(int(r) for r in manifest["expected"])
    assert plan.omitted == []
    with src.sources() as sources:
        for rp in plan.ranks:
            out = tmp_path / f"rank_{rp.target_rank}.{fmt}"
            written = execute_rank(rp, sources, str(out), fmt=fmt)
            want, optional = expected(manifest, rp.target_rank)
            assert set(written.tensors) <= set(want), "a tensor MindFormers' loader did not produce"
            for name, sha in want.items():
                if name in optional and name not in written.tensors:
                    continue
                assert written.tensors.get(name) == sha, f"rank {rp.target_rank} {name}"
            assert set(want) - optional <= set(written.tensors)
            for name, meta in manifest["expected"][str(rp.target_rank)].items():
                assert tuple(p.target_shape for p in rp.params if p.name == name) == (tuple(meta["shape"]),)


def test_training_step_is_carried_from_the_opt_files(tmp_path):
    """global_step is copied whole from a source rank's opt file, as saved (= the iteration)."""
    for scenario in SCENARIOS:
        src = load_mindformers(scenario / "src_mindformers")
        plan = Planner(src.topology, None, src.index()).plan()
        (rp,) = plan.ranks
        with src.sources() as sources:
            written = execute_rank(rp, sources, str(tmp_path / f"{scenario.name}.ckpt"))
        with CheckpointReader(written.path) as r:
            assert r.read("global_step").tolist() == [src.iteration]
            assert r.entries["learning_rate"].shape == ()
            assert set(r.names()) == set(src.params) | {"global_step", "learning_rate"}
            for name, p in src.params.items():
                assert r.entries[name].shape == p.global_shape and r.entries[name].dtype == p.dtype


def test_plan_reads_the_rank_holding_each_shard():
    """M1a's wq is split 4 ways along rows, dp-minor: ranks 0, 1, 2, 3 hold shards 0, 2, 1, 3. Target
    rank t of mp4 needs rows 8t..8t+8, shard t, so exactly one source rank: 0, 2, 1, 3."""
    scenario = next(p for p in SCENARIOS if p.name.startswith("M1a"))
    src = load_mindformers(scenario / "src_mindformers")
    dst = Topology.from_strategy(read_strategy(scenario / "dst_strategy.ckpt"))
    plan = Planner(src.topology, dst, src.index()).plan()
    for target, holder in enumerate([0, 2, 1, 3]):
        wq = next(p for p in plan.rank(target).params if p.name == "model.layers.0.attention.wq.weight")
        assert [(c.source_rank, c.source_box, c.target_box) for c in wq.copies] == [
            (holder, ((0, 8), (0, 32)), ((0, 8), (0, 32)))]
