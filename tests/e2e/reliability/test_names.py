"""Parameter names MindSpore itself trips over must work end to end: '-' (merged pipeline strategies
prefix names with "<stage>-"), non-ASCII, and very long ones (20 000 characters need three-byte
length prefixes in every record). Converted there and back, every tensor comes out as it went in.
"""

from __future__ import annotations

import numpy as np
import pytest

from reliability_helpers import lineage_runs, snapshot

from reshard_job.formats.ckpt import CheckpointReader, CheckpointWriter
from reshard_job.formats.strategy import write_strategy
from reshard_job.core.strategy_model import ParamLayout, StrategyFile, StrategyItem

NAMES = {
    "dash": "encoder.layer-1.attention-out.weight",
    "unicode": "слой.权重.🙂.bias",
    "long": "model." + "very_long_name." * 1333 + "weight",
    "dashes_only": "-",
}


def _globals() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    return {
        NAMES["dash"]: rng.standard_normal((8, 12)).astype(np.float32),
        NAMES["unicode"]: rng.standard_normal((8,)).astype(np.float16),
        NAMES["long"]: rng.standard_normal((4, 8)).astype(np.float32),
        NAMES["dashes_only"]: rng.standard_normal((2, 2)).astype(np.float32),
    }


# how each tensor is split over 2 source ranks and 4 target ranks (None: replicated)
SRC_SPLIT = {NAMES["dash"]: 0, NAMES["unicode"]: None, NAMES["long"]: 1, NAMES["dashes_only"]: None}
DST_SPLIT = {NAMES["dash"]: 1, NAMES["unicode"]: 0, NAMES["long"]: 0, NAMES["dashes_only"]: None}


def _layout(devices: int, ndim: int, split: int | None) -> ParamLayout:
    # a one-axis device matrix: tensor_map entry 0 names it; -1 = not split
    return ParamLayout((devices,), tuple(0 if d == split else -1 for d in range(ndim)))


def _strategy(devices: int, splits: dict, shapes: dict, stage: int = 0) -> StrategyFile:
    return StrategyFile({n: _layout(devices, len(shapes[n]), s) for n, s in splits.items()},
                        [StrategyItem("MatMul-op0", stage, ())])


def _write_sources(root, tensors, devices=2):
    for r in range(devices):
        with CheckpointWriter(root / f"rank_{r}" / f"checkpoint_{r}.ckpt", mode=0o644) as w:
            for name, g in tensors.items():
                split = SRC_SPLIT[name]
                part = g if split is None else np.split(g, devices, axis=split)[r]
                w.add(name, np.ascontiguousarray(part))


def _read_all(path) -> dict[str, np.ndarray]:
    with CheckpointReader(path) as r:
        return {n: r.read(n) for n in r.names()}


@pytest.mark.parametrize("src_format", ["ckpt", "json"])
def test_odd_names_round_trip(tmp_path, app, src_format):
    tensors = _globals()
    shapes = {n: t.shape for n, t in tensors.items()}
    src_strategy = tmp_path / f"src_strategy.{src_format}"
    write_strategy(_strategy(2, SRC_SPLIT, shapes), src_strategy, mode=0o644)
    write_strategy(_strategy(4, DST_SPLIT, shapes), tmp_path / "dst_strategy.ckpt", mode=0o644)
    _write_sources(tmp_path / "ckpts", tensors)
    before = snapshot(tmp_path / "ckpts", src_strategy)

    res = app(tmp_path, f"source.checkpoints={tmp_path / 'ckpts'}", f"source.strategy={src_strategy}", "target=strategy",
              f"target.strategy={tmp_path / 'dst_strategy.ckpt'}", f"output.dir={tmp_path / 'four'}")
    assert res.returncode == 0, res.stderr
    for r in range(4):  # each target rank holds its slice
        got = _read_all(tmp_path / "four" / f"rank_{r}" / f"checkpoint_{r}.ckpt")
        assert set(got) == set(tensors)
        for name, g in tensors.items():
            split = DST_SPLIT[name]
            np.testing.assert_array_equal(got[name], g if split is None else np.split(g, 4, axis=split)[r])

    res = app(tmp_path, f"source.checkpoints={tmp_path / 'four'}", f"source.strategy={tmp_path / 'four' / 'strategy.ckpt'}",
              "target=single", f"output.dir={tmp_path / 'one'}")
    assert res.returncode == 0, res.stderr
    back = _read_all(tmp_path / "one" / "rank_0" / "checkpoint_0.ckpt")
    assert list(back) == list(_read_all(tmp_path / "ckpts" / "rank_1" / "checkpoint_1.ckpt"))
    for name, g in tensors.items():
        np.testing.assert_array_equal(back[name], g)
    assert snapshot(tmp_path / "ckpts", src_strategy) == before
    assert [r["status"] for r in lineage_runs(tmp_path / "runs" / "lineage.db")] == ["completed", "completed"]


def test_odd_names_through_a_pipeline_strategy_directory(tmp_path, app):
    """Two stages of per-stage strategy files: merged keys are "<stage>-<name>", split on the first '-'."""
    tensors = _globals()
    shapes = {n: t.shape for n, t in tensors.items()}
    stage_of = {NAMES["dash"]: 0, NAMES["dashes_only"]: 0, NAMES["unicode"]: 1, NAMES["long"]: 1}
    (tmp_path / "stages").mkdir()
    for stage in (0, 1):
        splits = {n: SRC_SPLIT[n] for n in tensors if stage_of[n] == stage}
        write_strategy(_strategy(2, splits, shapes, stage), tmp_path / "stages" / f"stage{stage}.ckpt", mode=0o644)
    for g_rank in range(4):  # global rank = stage * 2 + local rank
        stage, local = divmod(g_rank, 2)
        with CheckpointWriter(tmp_path / "ckpts" / f"rank_{g_rank}" / f"checkpoint_{g_rank}.ckpt", mode=0o644) as w:
            for name, g in tensors.items():
                if stage_of[name] == stage:
                    split = SRC_SPLIT[name]
                    w.add(name, np.ascontiguousarray(g if split is None else np.split(g, 2, axis=split)[local]))
    res = app(tmp_path, f"source.checkpoints={tmp_path / 'ckpts'}", f"source.strategy={tmp_path / 'stages'}",
              "target=single", f"output.dir={tmp_path / 'one'}")
    assert res.returncode == 0, res.stderr
    back = _read_all(tmp_path / "one" / "rank_0" / "checkpoint_0.ckpt")
    assert set(back) == set(tensors)
    for name, g in tensors.items():
        np.testing.assert_array_equal(back[name], g)
