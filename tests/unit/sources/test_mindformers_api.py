"""MindFormers saves and the export for inference through the Python API and the job's prepare
stage: ``transform_checkpoints`` on a MindFormers folder, ``transform_checkpoint_by_rank`` with a
tuple of files per rank, ``rank_list_for_transform`` from the folder's layouts, the export as
``output_format="safetensors_index"`` and its round trip, redundancy-removed saves (refused in one
line until the planner reads each slice from whichever rank stored it), and the refusals.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from reshard_job import api
from reshard_job.errors import ConfigError, PlanError, ReshardError
from reshard_job.formats.ckpt import CheckpointReader
from reshard_job.sources.mindformers_save import load_mindformers
from reshard_job.formats.safetensors import SafetensorsReader
from reshard_job.job.stages.prepare import prepare
from reshard_job.job.config.spec import SourceSpec, TargetSpec

from mf_save import dedup_params, dedup_writer, write_mf_save  # tests/mf_save.py

GOLDEN = Path(__file__).resolve().parents[2] / "golden"
M1A = GOLDEN / "M1a_mf_llama_dp2mp2os_bf16_to_mp4"
M1B = GOLDEN / "M1b_mf_llama_pp2dp2mp2os2_to_mp4"
S1 = GOLDEN / "S1_mlp_tutorial_8to4"
OPTIONAL = "quirk_not_in_metadata_optional"


def sha256s(path) -> dict[str, str]:
    with CheckpointReader(path) as r:
        return {n: hashlib.sha256(r.read_raw(n)).hexdigest() for n in r.names()}


def check_against_mindformers(scenario: Path, rank: int, got: dict[str, str]) -> None:
    golden = json.loads((scenario / "manifest.json").read_text())
    cats = golden["verification"]["mindformers_load_checkpoint"]["categories"][str(rank)]
    want = golden["expected"][str(rank)]
    assert set(got) <= set(want)
    for name, info in want.items():
        if cats[name] == OPTIONAL and name not in got:
            continue
        assert got[name] == info["sha256"], (rank, name)


@pytest.mark.parametrize("scenario", [M1A, M1B], ids=lambda p: p.name[:3])
def test_transform_checkpoints_reads_a_mindformers_folder(scenario, tmp_path):
    written = api.transform_checkpoints(scenario / "src_mindformers", tmp_path, "ckpt_", None,
                                        scenario / "dst_strategy.ckpt", output_format="safetensors")
    assert sorted(written) == [0, 1, 2, 3]
    for rank, wf in written.items():
        assert wf.path == str(tmp_path / f"rank_{rank}" / f"ckpt_{rank}.safetensors")
        check_against_mindformers(scenario, rank, wf.tensors)


@pytest.mark.parametrize("scenario", [M1A, M1B], ids=lambda p: p.name[:3])
def test_by_rank_takes_a_tuple_of_files_per_rank(scenario, tmp_path):
    """rank_list_for_transform from the folder (or its metadata.json), then exactly those ranks'
    files (mindformers_rank_files) give each destination rank."""
    folder = scenario / "src_mindformers"
    files = api.mindformers_rank_files(folder)
    save = load_mindformers(folder)
    assert files == save.rank_files and all(len(f) == 2 for f in files.values())
    dst = scenario / "dst_strategy.ckpt"
    for rank in range(4):
        ranks = api.rank_list_for_transform(rank, folder, dst)
        assert ranks == sorted(ranks, reverse=True) and ranks == api.rank_list_for_transform(rank, save.metadata_path,
                                                                                            dst)
        out = tmp_path / f"r{rank}.ckpt"
        wf = api.transform_checkpoint_by_rank(rank, {r: files[r] for r in ranks}, out, None, dst)
        check_against_mindformers(scenario, rank, wf.tensors)
        assert sha256s(out) == wf.tensors
    # the metadata.json may be named as the source strategy, and lists stand for tuples
    wf = api.transform_checkpoint_by_rank(0, {r: list(files[r]) for r in files}, tmp_path / "all.ckpt",
                                          save.metadata_path, dst)
    check_against_mindformers(scenario, 0, wf.tensors)


def test_by_rank_refusals_name_the_file_and_rank(tmp_path):
    folder = M1A / "src_mindformers"
    files = api.mindformers_rank_files(folder)
    dst = M1A / "dst_strategy.ckpt"
    with pytest.raises(ConfigError, match=r"llama-opt-0000002-0000004.safetensors: not a file of source rank 1 "):
        api.transform_checkpoint_by_rank(0, {1: (files[1][0], files[2][1])}, tmp_path / "x.ckpt", None, dst)
    with pytest.raises(ConfigError, match="give src_strategy_file=None or .*metadata.json"):
        api.transform_checkpoint_by_rank(0, dict(files), tmp_path / "x.ckpt", M1A / "src_strategy.ckpt", dst)
    model_files = {r: f[0] for r, f in files.items()}  # no opt files
    with pytest.raises(PlanError, match=r"'adam_[mv]\..*: no source rank holds its block .*rank \[1\] should") as err:
        api.transform_checkpoint_by_rank(0, {**files, 1: model_files[1]}, tmp_path / "x.ckpt", None, None)
    assert "\n" not in str(err.value)
    s1 = {r: str(S1 / "src_checkpoints" / f"rank_{r}" / f"checkpoint_{r}.ckpt") for r in range(2)}
    with pytest.raises(ConfigError, match="several files for a rank"):
        api.transform_checkpoint_by_rank(0, {0: (s1[0], s1[1])}, tmp_path / "x.ckpt", S1 / "src_strategy.ckpt",
                                         S1 / "dst_strategy.ckpt")
    assert not list(tmp_path.iterdir())
    # without opt files the optimizer states are in no source file: left out (with a warning), the
    # weights converted as with every file
    wf = api.transform_checkpoint_by_rank(0, model_files, tmp_path / "w.ckpt", None, dst)
    golden = json.loads((M1A / "manifest.json").read_text())["expected"]["0"]
    assert wf.tensors == {n: e["sha256"] for n, e in golden.items()
                          if not n.startswith("adam_") and n not in ("global_step", "learning_rate")}


@pytest.mark.parametrize("include", ["weights", "all"])
def test_export_through_the_api_and_back_to_the_saved_layout(include, tmp_path):
    golden = json.loads((M1A / "manifest.json").read_text())
    written = api.transform_checkpoints(M1A / "src_mindformers", tmp_path / "exp", "",
                                        output_format="safetensors_index", max_shard_size="10KB", include=include)
    shards = sorted(p.name for p in (tmp_path / "exp").glob("model-*.safetensors"))
    assert [os.path.basename(w.path) for w in written.values()] == shards + ["model.safetensors.index.json"]
    index = json.loads((tmp_path / "exp" / "model.safetensors.index.json").read_text())
    loaded = {}  # bfloat16 has no numpy dtype, so the library gives shapes and dtypes, our reader the bytes
    for name in shards:
        with safe_open(str(tmp_path / "exp" / name), framework="numpy") as f:
            assert f.metadata() == {"format": "pt"}
            part = {n: (f.get_slice(n).get_dtype(), f.get_slice(n).get_shape()) for n in f.keys()}
        with SafetensorsReader(str(tmp_path / "exp" / name)) as r:
            assert {n: (r.entries[n].extra["safetensors_dtype"], list(r.entries[n].shape)) for n in r.names()} == part
            part = {n: r.read_raw(n) for n in r.names()}
        assert not set(part) & set(loaded)
        loaded.update(part)
    assert index["metadata"]["total_size"] == sum(len(b) for b in loaded.values())
    assert set(index["weight_map"]) == set(loaded)
    names = {p["name"] for p in golden["params"]}
    assert {"global_step", "learning_rate"} <= names  # listed by the golden, though not in metadata.json
    weights = {n for n in names if not n.startswith(("adam_m.", "adam_v.")) and n not in ("global_step",
                                                                                         "learning_rate")}
    assert set(loaded) == (weights if include == "weights" else names)
    back = api.transform_checkpoints(tmp_path / "exp", tmp_path / "back", "c_", None, M1A / "src_strategy.ckpt")
    save = load_mindformers(M1A / "src_mindformers")
    for rank, files in save.rank_files.items():
        want = {}
        for f in files:
            want.update({n: e["sha256"] for n, e in golden["src_mindformers_files"][os.path.basename(f)].items()
                         if n in loaded})
        assert back[rank].tensors == want, rank


def test_export_needs_an_unsharded_target(tmp_path):
    with pytest.raises(ConfigError, match="dst_strategy_file=None"):
        api.transform_checkpoints(M1A / "src_mindformers", tmp_path, "", None, M1A / "dst_strategy.ckpt",
                                  output_format="safetensors_index")
    with pytest.raises(ConfigError, match="target.include"):
        api.transform_checkpoints(M1A / "src_mindformers", tmp_path, "", output_format="safetensors_index",
                                  include="weights_only")


# ================================================================================ prepare


def m1a_copy(tmp_path: Path) -> Path:
    root = tmp_path / "mf"
    shutil.copytree(M1A / "src_mindformers", root)
    return root


def test_prepare_refuses_a_strategy_file_or_an_iteration_that_does_not_fit(tmp_path):
    root = m1a_copy(tmp_path)
    with pytest.raises(ConfigError, match="MindFormers checkpoint folder.*set source.strategy=null"):
        prepare(SourceSpec(str(root), str(M1A / "src_strategy.ckpt")), TargetSpec())
    with pytest.raises(ReshardError, match="iteration 3 does not exist"):
        prepare(SourceSpec(str(root), iteration=3), TargetSpec())
    with pytest.raises(ConfigError, match="source.iteration=20 picks an iteration of a MindFormers checkpoint folder"):
        prepare(SourceSpec(str(S1 / "src_checkpoints"), str(S1 / "src_strategy.ckpt"), iteration=20), TargetSpec())


def test_only_the_files_the_plan_reads_are_sources(tmp_path):
    """An export of the weights reads no opt file: it is neither hashed nor recorded."""
    with prepare(SourceSpec(str(M1B / "src_mindformers")), TargetSpec(format="safetensors_index")) as prepared:
        assert all(len(files) == 1 and "-model-" in files[0] for files in prepared.source_paths.values())
        assert prepared.export is not None and not any(n.startswith("adam") for n in prepared.export.weight_map())
        assert {o["name"] for o in prepared.plan.omitted} >= {"global_step", "learning_rate"}
    with prepare(SourceSpec(str(M1B / "src_mindformers")), TargetSpec()) as prepared:
        assert all(len(files) == 2 for files in prepared.source_paths.values())


def test_redundancy_removed_save_gives_each_rank_only_what_it_stored(tmp_path):
    """The index the planner gets lists, per rank, exactly what that rank stored (nothing for a rank
    that stored nothing), and the conversion reads each slice from whichever rank holds it: the
    output is exactly the saved tensors."""
    params = dedup_params()
    write_mf_save(tmp_path / "mf", params, stored_by=dedup_writer, world=4)
    save = load_mindformers(tmp_path / "mf")
    with prepare(SourceSpec(str(tmp_path / "mf")), TargetSpec()) as prepared:
        assert {r: set(names) for r, names in prepared.index.items()} == {
            r: set(save.stored_by(r)) for r in range(4)}
        written = api.transform_checkpoints(tmp_path / "mf", tmp_path / "out", "c_")
    with CheckpointReader(written[0].path) as r:
        for name, (array, *_rest) in params.items():
            assert np.array_equal(r.read(name), array), name
