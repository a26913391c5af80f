"""Every conversion proves itself: ``manifest.json`` holds each parameter's fingerprint in the
sources and in the outputs, equal, and equal to what MindSpore's own output of the same scenario
holds; the same model in three layouts and formats has one set of fingerprints; an output whose
bytes differ from the sources fails the check, naming the parameter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from reshard_job.core.fingerprint import ALGORITHM
from reshard_job.errors import ProofError
from reshard_job.formats.ckpt import CheckpointReader
from reshard_job.job.config.spec import (JobContext, JobSpec, LineageSpec, OutputSpec, RunSpec, SourceSpec,
                                         TargetSpec)
from reshard_job.job.stages.prepare import prepare
from reshard_job.job.stages.proof import checkpoint_fingerprints, prove

GOLDEN = Path(__file__).parents[2] / "golden"


def _run(cwd: Path, *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "RESHARD_JOB_FULL_ERROR")}
    res = subprocess.run([sys.executable, "-m", "reshard_job", *args, "lineage.enabled=false", "job.workers=2"],
                         cwd=cwd, env=env, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr
    out = next(a.split("=", 1)[1] for a in args if a.startswith("output.dir="))
    return json.loads((cwd / out / "manifest.json").read_text())


@pytest.mark.parametrize("scenario,src", [
    ("S1_mlp_tutorial_8to4", "src_strategy.ckpt"),
    ("S2_block_mp4dp2opt_to_mp4", "src_strategy.ckpt"),
    ("S3_pipeline2x4opt_to_4", "src_strategy_dir"),
])
def test_a_conversion_records_equal_fingerprints_for_sources_and_outputs(tmp_path, scenario, src):
    d = GOLDEN / scenario
    manifest = _run(tmp_path, f"source.checkpoints={d / 'src_checkpoints'}", f"source.strategy={d / src}",
                    "target=strategy", f"target.strategy={d / 'dst_strategy.ckpt'}", "output.dir=out")
    fps = manifest["fingerprints"]
    assert fps["algorithm"] == ALGORITHM and "target_unchecked" not in fps
    assert fps["target"] and set(fps["target"]) <= set(fps["source"])
    assert {n: fps["source"][n] for n in fps["target"]} == fps["target"]
    written = {n for r in manifest["tensors"].values() for n in r}
    assert set(fps["target"]) == {n for n in written if n in fps["source"]}
    assert any("same fingerprint" in c for c in manifest["checks"])
    # MindSpore's own output of the scenario holds the same parameters (its quirks aside)
    expected = checkpoint_fingerprints(SourceSpec(str(d / "expected"), str(d / "dst_strategy.ckpt"))).digests
    golden = json.loads((d / "manifest.json").read_text())
    cats = golden["verification"]["transform_checkpoints"]["categories"]
    quirks = {n for r in cats.values() for n, c in r.items() if c.startswith("quirk")}
    both = (set(expected) & set(fps["target"])) - quirks
    assert both and {n: expected[n] for n in both} == {n: fps["target"][n] for n in both}


def test_one_model_in_three_layouts_and_formats_has_one_set_of_fingerprints(tmp_path):
    d = GOLDEN / "S2_block_mp4dp2opt_to_mp4"
    src = [f"source.checkpoints={d / 'src_checkpoints'}", f"source.strategy={d / 'src_strategy.ckpt'}"]
    four = _run(tmp_path, *src, "target=strategy", f"target.strategy={d / 'dst_strategy.ckpt'}", "output.dir=a")
    safetensors = _run(tmp_path, *src, "target=strategy", f"target.strategy={d / 'dst_strategy.ckpt'}",
                       "target.format=safetensors", "output.dir=b")
    whole = _run(tmp_path, *src, "target.devices=1", "target.format=safetensors", "output.dir=c")
    sets = [m["fingerprints"]["target"] for m in (four, safetensors, whole)]
    assert sets[0] and sets[0] == sets[1] == sets[2]


def _spec(tmp_path: Path, out: Path) -> JobSpec:
    return JobSpec(SourceSpec(None), TargetSpec(), OutputSpec(str(out)), LineageSpec(False, ""), RunSpec(progress=False),
                   JobContext(str(tmp_path), str(tmp_path / "run"), ()), config={})


def test_an_output_that_differs_from_its_sources_fails_the_check_naming_the_parameter(tmp_path):
    d = GOLDEN / "S2_block_mp4dp2opt_to_mp4"
    _run(tmp_path, f"source.checkpoints={d / 'src_checkpoints'}", f"source.strategy={d / 'src_strategy.ckpt'}",
         "target=strategy", f"target.strategy={d / 'dst_strategy.ckpt'}", "output.dir=out")
    out = tmp_path / "out"
    victim = out / "rank_2" / "checkpoint_2.ckpt"
    with CheckpointReader(victim) as r:
        name = next(n for n in r.names() if r[n].nbytes > 64)
        offset = r[name].pieces[0][0] + 33
    os.chmod(victim, 0o644)
    data = bytearray(victim.read_bytes())
    data[offset] ^= 0x01
    victim.write_bytes(bytes(data))
    prepared = prepare(SourceSpec(str(d / "src_checkpoints"), str(d / "src_strategy.ckpt")),
                       TargetSpec(strategy=str(d / "dst_strategy.ckpt")))
    with prepared, pytest.raises(ProofError) as caught:
        prove(_spec(tmp_path, out), prepared, str(out), str(out / "strategy.ckpt"))
    assert f"'{name}'" in str(caught.value) and "and " not in str(caught.value).split("does not hold")[0]
