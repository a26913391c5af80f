"""Every golden scenario (written by MindSpore 2.10) converted by our API gives MindSpore's tensors,
in MindSpore's order, reading only files MindSpore would also ask for.

Categories starting with ``quirk`` in a manifest are MindSpore bugs (spec resharding-semantics §6.3):
those tensors are left out of the comparison, and we check what we do instead.
"""

from __future__ import annotations

import os

import numpy as np

from reshard_job import rank_list_for_transform, transform_checkpoint_by_rank, transform_checkpoints
from reshard_job.formats.ckpt import CheckpointReader
from reshard_job.formats.strategy import read_strategy
from reshard_job.core.layout import Layout
from reshard_job.core.topology import Topology


def variant_id(path) -> str:
    return "no-strategy" if path is None else os.path.basename(path)


def check_rank_output(scenario, rank, written, path, helpers, api):
    want = scenario.checked(rank, api)
    got = helpers.tensor_sha256s(path)
    assert list(got) == list(want), "parameter order differs from MindSpore's"
    for name, sha in want.items():
        assert got[name] == sha, f"rank {rank} {name}"
    assert written.tensors == got
    assert written.sha256 == helpers.file_sha256(path)
    quirks = [n for n in scenario.expected(rank) if scenario.is_quirk(rank, n, api)]
    if not quirks:  # nothing left out: the very same file MindSpore wrote
        assert written.sha256 == helpers.file_sha256(scenario.expected_file(rank))


def test_transform_checkpoints(golden_scenario, tmp_path, helpers):
    for i, src in enumerate(golden_scenario.src_strategy_variants):
        out = tmp_path / f"out{i}"
        result = transform_checkpoints(golden_scenario.src_checkpoints, out, "checkpoint_", src,
                                       golden_scenario.dst_strategy)
        assert sorted(result) == golden_scenario.dst_ranks
        assert sorted(os.listdir(out)) == sorted(f"rank_{r}" for r in golden_scenario.dst_ranks)
        for rank, written in result.items():
            path = out / f"rank_{rank}" / f"checkpoint_{rank}.ckpt"
            assert written.path == str(path)
            check_rank_output(golden_scenario, rank, written, path, helpers, "transform_checkpoints")


def test_rank_list_and_transform_by_rank(golden_scenario, tmp_path, helpers):
    sc = golden_scenario
    for i, src in enumerate(sc.src_strategy_variants):
        for rank in sc.dst_ranks:
            ours = rank_list_for_transform(rank, src, sc.dst_strategy)
            theirs = sc.rank_list(rank)
            # minimal=False: MindSpore's own list, as MindSpore 2.10 returned it (manifest.json)
            assert rank_list_for_transform(rank, src, sc.dst_strategy, minimal=False) == theirs
            assert ours == sorted(ours, reverse=True), "descending, as MindSpore returns it"
            assert set(ours) <= set(theirs), f"{variant_id(src)} rank {rank}: {ours} not within {theirs}"
            assert all(type(r) is int for r in ours)
            # sufficient: only the listed files are given
            files = {r: str(sc.src_file(r)) for r in ours}
            path = tmp_path / f"v{i}" / f"rank{rank}.ckpt"
            path.parent.mkdir(exist_ok=True)
            written = transform_checkpoint_by_rank(rank, files, str(path), src, sc.dst_strategy)
            check_rank_output(sc, rank, written, path, helpers, "by_rank")
            # MindSpore's (larger) list gives the same file
            files = {r: str(sc.src_file(r)) for r in theirs}
            again = transform_checkpoint_by_rank(rank, files, str(path.with_suffix(".all.ckpt")), src, sc.dst_strategy)
            assert again.sha256 == written.sha256


def test_quirk_categories_are_only_the_known_ones(all_golden_scenarios):
    """The only MindSpore bug in the goldens: pipeline-only parameters copied unchanged (§5.5)."""
    seen = set()
    for sc in all_golden_scenarios:
        for api in ("transform_checkpoints", "by_rank"):
            for rank, cats in sc.manifest["verification"][api]["categories"].items():
                seen |= {c for c in cats.values() if c.startswith("quirk")}
    assert seen == {"quirk_src_only_passthrough"}


# ================================================================================ S3: accu_grads


def s3(scenarios):
    return next(s for s in scenarios if s.name.startswith("S3_"))


def rebuild_global(scenario, name: str) -> np.ndarray:
    """A parameter's global tensor put together from the source slices (checking replicas agree)."""
    sf = read_strategy(scenario.src_strategy_merged)
    topo = Topology.from_strategy(sf)
    stage = topo.lowest_stage(name)
    meta = next(p for p in scenario.manifest["params"] if p["name"] == name)
    shape = tuple(meta["shape"])
    out = np.full(shape, np.nan, dtype=np.float32)
    layout = Layout.from_recorded(topo.layout(name, stage), len(shape), topo.stage_devices, name)
    for local in range(topo.stage_devices):
        g = topo.global_rank(stage, local)
        with CheckpointReader(scenario.src_file(g)) as r:
            part = r.read(name).view(np.float32)
        box = tuple(slice(a, b) for a, b in layout.box(local, shape))
        seen = out[box]
        assert np.all(np.isnan(seen) | (seen == part)), f"replicas of {name} disagree"
        out[box] = part
    assert not np.isnan(out).any()
    return out


def test_s3_accu_grads_are_omitted_by_default(all_golden_scenarios, tmp_path, helpers):
    sc = s3(all_golden_scenarios)
    accu = [p["name"] for p in sc.manifest["params"] if p["name"].startswith("accu_grads.")]
    assert len(accu) == 30
    assert all(not p["in_dst_strategy"] for p in sc.manifest["params"] if p["name"] in accu)
    for src in sc.src_strategy_variants:
        result = transform_checkpoints(sc.src_checkpoints, tmp_path / variant_id(src), "checkpoint_", src,
                                       sc.dst_strategy)
        for rank, written in result.items():
            assert not any(n.startswith("accu_grads.") for n in written.tensors)
            assert all(sc.is_quirk(rank, n) for n in accu)


def test_s3_accu_grads_as_full_tensors_on_request(all_golden_scenarios, tmp_path, helpers):
    sc = s3(all_golden_scenarios)
    accu = [p["name"] for p in sc.manifest["params"] if p["name"].startswith("accu_grads.")]
    full = {n: rebuild_global(sc, n) for n in accu}
    for src in sc.src_strategy_variants:
        out = tmp_path / variant_id(src)
        result = transform_checkpoints(sc.src_checkpoints, out, "checkpoint_", src, sc.dst_strategy, unmapped="full")
        for rank, written in result.items():
            # everything else is unchanged: still MindSpore's tensors
            for name, sha in sc.checked(rank).items():
                assert written.tensors[name] == sha
            with CheckpointReader(written.path) as r:
                for name in accu:
                    assert r.entries[name].shape == full[name].shape
                    assert r.read(name).view(np.float32).tobytes() == full[name].tobytes(), name
        rank = sc.dst_ranks[-1]
        needed = rank_list_for_transform(rank, src, sc.dst_strategy, unmapped="full")
        assert set(needed) <= set(sc.rank_list(rank))
        by_rank = transform_checkpoint_by_rank(rank, {r: str(sc.src_file(r)) for r in needed},
                                               str(tmp_path / "by_rank.ckpt"), src, sc.dst_strategy, unmapped="full")
        assert by_rank.sha256 == result[rank].sha256


def test_s3_source_strategy_directory_and_merged_file_agree(all_golden_scenarios, tmp_path):
    sc = s3(all_golden_scenarios)
    a = transform_checkpoints(sc.src_checkpoints, tmp_path / "a", "checkpoint_", sc.src_strategy, sc.dst_strategy)
    b = transform_checkpoints(sc.src_checkpoints, tmp_path / "b", "checkpoint_", sc.src_strategy_merged,
                              sc.dst_strategy)
    assert {r: w.sha256 for r, w in a.items()} == {r: w.sha256 for r, w in b.items()}
