"""The formats MindFormers users have, through ``python -m reshard_job`` in a subprocess: MindFormers
2.x saves as sources (from MindFormers' own saver, ``tests/golden/M1*``), the export for inference
(``target=hf_export``) with its shards as journaled, verified, resumable outputs, the export read
back as a source, and MindFormers' legacy per-rank names with several saves in a rank folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from reshard_job.formats.ckpt import CheckpointReader
from reshard_job.sources.mindformers_save import load_mindformers

GOLDEN = Path(__file__).parents[2] / "golden"
M1A = GOLDEN / "M1a_mf_llama_dp2mp2os_bf16_to_mp4"
M1B = GOLDEN / "M1b_mf_llama_pp2dp2mp2os2_to_mp4"
S1 = GOLDEN / "S1_mlp_tutorial_8to4"
OPTIONAL = "quirk_not_in_metadata_optional"  # global_step, learning_rate: not in metadata.json
INDEX = "model.safetensors.index.json"


@pytest.fixture
def run_app(app):
    """``python -m reshard_job`` as its own process (forked by the e2e `app` launcher), without progress lines."""
    return lambda cwd, *args: app(cwd, *args, "job.progress=false", timeout=180)


def sha256s(path: Path) -> dict[str, str]:
    with CheckpointReader(path) as r:
        return {n: hashlib.sha256(r.read_raw(n)).hexdigest() for n in r.names()}


def events(db: Path, direction: str) -> list[tuple]:
    """(role, rank, path) of every file the last run read or wrote, as the lineage database has them."""
    with sqlite3.connect(db) as con:
        (run,) = con.execute("select id from runs order by started_at desc limit 1").fetchone()
        return sorted(con.execute("select role, rank, path from events where run_id = ? and direction = ?",
                                  (run, direction)), key=lambda e: (e[0], -1 if e[1] is None else e[1], e[2]))


def source_tensors(manifest: dict, files) -> dict[str, str]:
    """name -> sha256 of what a MindFormers rank's files hold, from the golden manifest."""
    out = {}
    for f in files:
        out.update({n: e["sha256"] for n, e in manifest["src_mindformers_files"][os.path.basename(f)].items()})
    return out


@pytest.mark.parametrize("scenario", [M1A, M1B], ids=lambda p: p.name[:3])
def test_mindformers_save_converts_like_mindformers_loader_and_is_recorded_file_by_file(scenario, tmp_path, run_app):
    golden = json.loads((scenario / "manifest.json").read_text())
    res = run_app(tmp_path, "source=checkpoints", f"source.checkpoints={scenario / 'src_mindformers'}",
                  "target=strategy", f"target.strategy={scenario / 'dst_strategy.ckpt'}", "output.dir=out")
    assert res.returncode == 0, res.stderr
    cats = golden["verification"]["mindformers_load_checkpoint"]["categories"]
    for rank, params in golden["expected"].items():
        got = sha256s(tmp_path / "out" / f"rank_{rank}" / f"checkpoint_{rank}.ckpt")
        assert set(got) <= set(params)
        for name, info in params.items():
            if cats[rank][name] == OPTIONAL:
                assert got.get(name, info["sha256"]) == info["sha256"]  # carried whole, as saved
                continue
            assert got[name] == info["sha256"], (rank, name)
        assert "global_step" in got  # copied from an opt file, as MindSpore copies it
    save = load_mindformers(scenario / "src_mindformers")
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    source = manifest["source"]
    every_file = sorted((r, f) for r, files in save.rank_files.items() for f in files)
    assert sorted((f["rank"], f["path"]) for f in source["files"]) == every_file  # each file, with its rank
    assert source["strategy"]["path"] == save.metadata_path and source["strategy"]["kind"] == "mindformers_metadata"
    assert source["strategy"]["sha256"] == hashlib.sha256(Path(save.metadata_path).read_bytes()).hexdigest()
    assert source["mindformers"]["iteration"] == save.iteration
    assert source["mindformers"]["not_in_metadata"] == ["global_step", "learning_rate"]
    inputs = events(tmp_path / "runs" / "lineage.db", "input")
    assert [(rank, path) for role, rank, path in inputs if role == "source_checkpoint"] == every_file
    assert sorted((role, path) for role, _, path in inputs if role != "source_checkpoint") == sorted([
        ("strategy", save.metadata_path), ("strategy", str(scenario / "dst_strategy.ckpt"))])  # the target's too


def test_plan_lists_the_files_of_each_rank_and_iterations_are_chosen(tmp_path, run_app):
    root = tmp_path / "mf"
    shutil.copytree(M1A / "src_mindformers", root)
    shutil.copytree(root / "iteration_00000020", root / "iteration_00000010")  # an older save, same content
    res = run_app(tmp_path, "source=checkpoints", f"source.checkpoints={root}", "target=single", "job=plan",
                  "hydra.run.dir=plan")
    assert res.returncode == 0, res.stderr
    assert "rank 1: {llama-model-0000001-0000004.safetensors, llama-opt-0000001-0000004.safetensors}" in res.stdout
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert plan["source_files"]["3"] == [str(root / "iteration_00000020" / f"llama-{kind}-0000003-0000004.safetensors")
                                         for kind in ("model", "opt")]
    res = run_app(tmp_path, "source=checkpoints", f"source.checkpoints={root}", "source.iteration=10",
                  "target=single", "output.dir=older", "lineage.enabled=false")
    assert res.returncode == 0, res.stderr
    manifest = json.loads((tmp_path / "older" / "manifest.json").read_text())
    assert manifest["source"]["mindformers"]["iteration"] == 10
    assert all("/iteration_00000010/" in f["path"] for f in manifest["source"]["files"])
    res = run_app(tmp_path, "source=checkpoints", f"source.checkpoints={root}", "source.iteration=99",
                  "target=single", "output.dir=none")
    assert res.returncode == 2 and res.stderr.count("\n") == 1
    assert "iteration 99 does not exist" in res.stderr and "available: [10, 20]" in res.stderr
    assert not (tmp_path / "none").exists()


def check_export(folder: Path, bound: int) -> dict[str, np.ndarray]:
    """Every shard loads with the safetensors library as a transformers shard (format pt), is within
    the bound (or holds one tensor), and the index lists every tensor once with the right total."""
    index = json.loads((folder / INDEX).read_text())
    shards = sorted(p.name for p in folder.glob("model-*.safetensors"))
    assert len(shards) >= 3 and shards == sorted(set(index["weight_map"].values()))
    tensors, total = {}, 0
    for name in shards:
        with safe_open(str(folder / name), framework="numpy") as f:
            assert f.metadata() == {"format": "pt"}
            names = list(f.keys())
        loaded = load_file(str(folder / name))
        size = sum(a.nbytes for a in loaded.values())
        assert size <= bound or len(loaded) == 1
        assert all(index["weight_map"][n] == name for n in names)
        assert not set(loaded) & set(tensors)
        tensors.update(loaded)
        total += size
    assert set(tensors) == set(index["weight_map"]) and index["metadata"]["total_size"] == total
    return tensors


def test_export_is_journaled_verified_resumed_and_converts_back_to_the_saved_layout(tmp_path, run_app):
    golden = json.loads((M1B / "manifest.json").read_text())
    common = ["source=checkpoints", f"source.checkpoints={M1B / 'src_mindformers'}", "target=hf_export",
              "target.max_shard_size=12KB", "target.include=all", "output.dir=exp"]
    res = run_app(tmp_path, *common)
    assert res.returncode == 0, res.stderr
    exp = tmp_path / "exp"
    tensors = check_export(exp, 12_000)
    save = load_mindformers(M1B / "src_mindformers")
    assert set(tensors) == set(save.params) | {"global_step", "learning_rate"}  # include=all: everything
    manifest = json.loads((exp / "manifest.json").read_text())
    files = manifest["target"]["files"]
    on_disk = sorted(p.name for p in exp.iterdir() if p.is_file() and p.name != "manifest.json")
    assert sorted(f["file"] for f in files) == on_disk and {f["rank"] for f in files} == {0}
    assert [f["part"] for f in files] == list(range(len(on_disk)))
    for f in files:
        assert hashlib.sha256(Path(f["path"]).read_bytes()).hexdigest() == f["sha256"]
    # MindSpore's load_distributed_checkpoint(unified_safetensors_dir=exp) needs this beside several shards
    assert manifest["target"]["export"]["param_name_map"] == "param_name_map.json"
    name_map = json.loads((exp / "param_name_map.json").read_text())
    assert name_map == json.loads((exp / "model.safetensors.index.json").read_text())
    assert files[-1]["file"] == "param_name_map.json"  # listed and hashed like the other outputs
    outputs = events(tmp_path / "runs" / "lineage.db", "output")
    assert sorted(p for role, rank, p in outputs if role == "target_checkpoint" and rank == 0) == sorted(
        str(exp / n) for n in on_disk)
    audit = subprocess.run([sys.executable, "-m", "reshard_job.audit", "verify", str(exp)], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
    assert audit.returncode == 0 and f"all {len(on_disk) + 1} files intact" in audit.stdout, audit.stdout
    before = {n: (exp / n).read_bytes() for n in on_disk}

    res = run_app(tmp_path, *common)  # again: verified, nothing rewritten
    assert res.returncode == 0 and "completed (already done)" in res.stdout, res.stderr
    # as if killed before the end: a shard and the manifest gone; the journal still lists the rest
    os.remove(exp / "manifest.json")
    os.remove(exp / on_disk[1])
    res = run_app(tmp_path, *common)
    assert res.returncode == 0, res.stderr
    assert f"resuming: keeping {len(on_disk) - 1} target file(s)" in res.stderr
    assert {n: (exp / n).read_bytes() for n in on_disk} == before

    res = run_app(tmp_path, "source=checkpoints", f"source.checkpoints={exp}", "target=strategy",
                  f"target.strategy={M1B / 'src_strategy_merged.ckpt'}", "output.dir=back", "lineage.enabled=false")
    assert res.returncode == 0, res.stderr
    for rank, rank_files in save.rank_files.items():  # the saved layout again, byte for byte
        got = sha256s(tmp_path / "back" / f"rank_{rank}" / f"checkpoint_{rank}.ckpt")
        assert got == source_tensors(golden, rank_files), rank


def test_mindformers_rank_names_with_several_saves_per_rank_folder(tmp_path, run_app):
    """MindFormers' legacy saves: rank_<r>/<prefix>_rank_<r>-<epoch>_<step>.ckpt, several steps kept.
    The older saves here are real checkpoints of another rank, so taking one shows in the output."""
    src = tmp_path / "checkpoint"
    for r in range(8):
        folder = src / f"rank_{r}"
        folder.mkdir(parents=True)
        own = S1 / "src_checkpoints" / f"rank_{r}" / f"checkpoint_{r}.ckpt"
        other = S1 / "src_checkpoints" / f"rank_{(r + 1) % 8}" / f"checkpoint_{(r + 1) % 8}.ckpt"
        shutil.copy(own, folder / f"llama_rank_{r}-10_5.ckpt")
        shutil.copy(other, folder / f"llama_rank_{r}-2_5.ckpt")  # lexicographically last: MindSpore's pick
        shutil.copy(other, folder / f"llama_rank_{r}-1_10.ckpt")
    common = ["source=checkpoints", f"source.checkpoints={src}", f"source.strategy={S1 / 'src_strategy.ckpt'}",
              "target=strategy", f"target.strategy={S1 / 'dst_strategy.ckpt'}", "lineage.enabled=false"]
    res = run_app(tmp_path, *common, "output.dir=latest")
    assert res.returncode == 0, res.stderr
    golden = json.loads((S1 / "manifest.json").read_text())
    for rank, params in golden["expected"].items():
        got = sha256s(tmp_path / "latest" / f"rank_{rank}" / f"checkpoint_{rank}.ckpt")
        assert got == {n: info["sha256"] for n, info in params.items()}, rank
    manifest = json.loads((tmp_path / "latest" / "manifest.json").read_text())
    assert {os.path.basename(f["path"]) for f in manifest["source"]["files"]} <= {
        f"llama_rank_{r}-10_5.ckpt" for r in range(8)}
    os.remove(src / "rank_3" / "llama_rank_3-10_5.ckpt")  # rank 3's newest save is missing
    res = run_app(tmp_path, *common, "output.dir=mixed")
    assert res.returncode == 2 and res.stderr.count("\n") == 1
    assert "rank 3 has at most llama_rank_3-2_5.ckpt while others have epoch 10 step 5" in res.stderr
    assert not (tmp_path / "mixed").exists()
