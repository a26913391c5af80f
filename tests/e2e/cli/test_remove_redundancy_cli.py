"""``target.remove_redundancy=true`` end to end: a golden MindSpore checkpoint converted with the CLI
so that each target rank writes only the slices it owns (MindSpore's rule), then read back as a
source: converting that to one device gives the very bytes the original gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reshard_job import transform_checkpoints
from reshard_job.core.layout import Layout
from reshard_job.core.topology import Topology
from reshard_job.formats.registry import open_reader
from reshard_job.formats.safetensors import SafetensorsReader
from reshard_job.formats.strategy import read_strategy

GOLDEN = Path(__file__).parents[2] / "golden"


@pytest.fixture
def run_app(app):
    """``python -m reshard_job`` as its own process (forked by the e2e `app` launcher)."""
    return lambda cwd, *args: app(cwd, *args, timeout=180)


def _contents(path: Path) -> dict[str, bytes]:
    with open_reader(str(path)) as r:
        return {n: b"".join(bytes(b) for b in r.iter_content(n)) for n in r.names()}


def _one_device(src: Path, strategy: Path, dst: Path) -> bytes:
    transform_checkpoints(src, dst, "full_", str(strategy), None, output_format="safetensors")
    return (dst / "rank_0" / "full_0.safetensors").read_bytes()


def _check_each_block_written_once(out: Path, strategy: Path, files: dict[int, dict[str, bytes]]) -> None:
    topo = Topology.from_strategy(read_strategy(strategy))
    T = topo.stage_devices
    for name in {n for held in files.values() for n in held}:
        writers = [r for r, held in files.items() if name in held]
        per = topo.layouts.get(name)
        if per is None:  # not laid out by the target: every rank writes it, as MindSpore does
            assert writers == sorted(files), name
            continue
        for stage, recorded in per.items():
            layout = Layout.from_recorded(recorded, len(recorded.tensor_map), T, name)
            blocks = [layout.block(r % T) for r in writers if r // T == stage]
            assert sorted(blocks) == sorted({layout.block(q) for q in range(T)}), f"{name}: each block once"


@pytest.mark.parametrize("scenario,strategy,fmt", [
    ("S3_pipeline2x4opt_to_4", "src_strategy_merged.ckpt", "safetensors"),
    pytest.param("S2_block_mp4dp2opt_to_mp4", "src_strategy.ckpt", "ckpt", marks=pytest.mark.slow),
])
def test_written_without_redundancy_and_read_back_exactly(tmp_path, scenario, strategy, fmt, run_app):
    g = GOLDEN / scenario
    out = tmp_path / "dedup"
    res = run_app(tmp_path, f"source.checkpoints={g / 'src_checkpoints'}", f"source.strategy={g / strategy}",
                  "target=strategy", f"target.strategy={g / 'dst_strategy.ckpt'}", f"target.format={fmt}",
                  "target.remove_redundancy=true", f"output.dir={out}", "lineage.enabled=false")
    assert res.returncode == 0, res.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["target"]["remove_redundancy"] is True
    assert manifest["fingerprints"]["target"] == manifest["fingerprints"]["source"]  # the proof read them back
    paths = {f["rank"]: Path(f["path"]) for f in manifest["target"]["files"]}
    files = {r: _contents(p) for r, p in paths.items()}
    if fmt == "safetensors":
        for p in paths.values():
            with SafetensorsReader(str(p)) as r:
                assert r.metadata == {"format": "ms", "remove_redundancy": "True"}
    _check_each_block_written_once(out, g / "dst_strategy.ckpt", files)

    # the same conversion with every replica: a superset of each rank's tensors, same bytes, more of them
    full = tmp_path / "full"
    transform_checkpoints(g / "src_checkpoints", full, "checkpoint_", str(g / strategy), str(g / "dst_strategy.ckpt"),
                          output_format=fmt)
    for r, held in files.items():
        everything = _contents(full / f"rank_{r}" / f"checkpoint_{r}.{fmt}")
        assert {n: everything[n] for n in held} == held
    assert sum(p.stat().st_size for p in paths.values()) < sum(p.stat().st_size for p in full.glob("rank_*/*"))

    # read back as a source: one device from it is byte for byte one device from the full conversion
    assert _one_device(out, out / "strategy.ckpt", tmp_path / "one_dedup") == \
        _one_device(full, g / "dst_strategy.ckpt", tmp_path / "one_full")


def test_one_full_model_has_no_redundancy_to_remove(tmp_path, run_app):
    g = GOLDEN / "S2_block_mp4dp2opt_to_mp4"
    res = run_app(tmp_path, f"source.checkpoints={g / 'src_checkpoints'}", f"source.strategy={g / 'src_strategy.ckpt'}",
                  "target=hf_export", "target.remove_redundancy=true", "lineage.enabled=false")
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "Traceback" not in res.stderr
    assert "target.remove_redundancy=true cannot apply to target.format=safetensors_index" in res.stderr
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").rglob("*.safetensors"))
