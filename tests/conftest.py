"""Shared test fixtures: the golden MindSpore scenarios, and synthetic sharded checkpoint sets.

Helpers are handed out as session-scoped fixtures so that hypothesis tests can use them too
(hypothesis refuses function-scoped fixtures, which it would not reset between examples).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

GOLDEN_DIR = Path(__file__).parent / "golden"


# ============================================================================ golden scenarios


@dataclass(frozen=True)
class GoldenScenario:
    """One scenario produced by MindSpore 2.10 (see tests/golden/INDEX.md)."""

    dir: Path

    @property
    def name(self) -> str:
        return self.dir.name

    @cached_property
    def manifest(self) -> dict:
        return json.loads((self.dir / "manifest.json").read_text())

    @property
    def src_checkpoints(self) -> Path:
        return self.dir / "src_checkpoints"

    @property
    def src_strategy(self) -> str | None:
        """The source strategy as MindSpore's user gives it: a file, a per-stage directory, or None."""
        src = self.manifest["src"]
        rel = src.get("strategy_file") or src.get("strategy_dir")
        return str(self.dir / rel) if rel else None

    @property
    def src_strategy_merged(self) -> str | None:
        """MindSpore's merged pipeline strategy (pipeline sources only)."""
        rel = self.manifest["src"].get("merged_strategy_file")
        return str(self.dir / rel) if rel else None

    @property
    def src_strategy_variants(self) -> list[str | None]:
        """Every way to hand the source strategy over: the directory and the merged file for pipelines."""
        out = [self.src_strategy]
        if self.src_strategy_merged:
            out.append(self.src_strategy_merged)
        return out

    @property
    def dst_strategy(self) -> str | None:
        rel = self.manifest["dst"].get("strategy_file")
        return str(self.dir / rel) if rel else None

    @property
    def dst_ranks(self) -> list[int]:
        return sorted(int(r) for r in self.manifest["expected"])

    @property
    def src_ranks(self) -> list[int]:
        return sorted(int(r) for r in self.manifest["src_checkpoints"])

    def src_file(self, rank: int) -> Path:
        return self.src_checkpoints / f"rank_{rank}" / f"checkpoint_{rank}.ckpt"

    def expected_file(self, rank: int) -> Path:
        return self.dir / "expected" / f"rank_{rank}" / f"checkpoint_{rank}.ckpt"

    def expected(self, rank: int) -> dict:
        """name -> {shape, dtype, sha256, records} of MindSpore's output for a destination rank."""
        return self.manifest["expected"][str(rank)]

    def rank_list(self, rank: int) -> list[int]:
        """MindSpore's rank_list_for_transform for a destination rank."""
        return self.manifest["rank_list_for_transform"][str(rank)]

    def category(self, rank: int, name: str, api: str = "transform_checkpoints") -> str:
        return self.manifest["verification"][api]["categories"][str(rank)][name]

    def is_quirk(self, rank: int, name: str, api: str = "transform_checkpoints") -> bool:
        """MindSpore output that is a MindSpore bug, not a reshard (skipped in comparisons)."""
        return self.category(rank, name, api).startswith("quirk")

    def checked(self, rank: int, api: str = "transform_checkpoints") -> dict[str, str]:
        """name -> expected sha256, in MindSpore's order, quirks left out."""
        return {n: e["sha256"] for n, e in self.expected(rank).items() if not self.is_quirk(rank, n, api)}


def golden_scenarios() -> list[GoldenScenario]:
    """The scenarios with MindSpore rank folders (``src_checkpoints/``); those whose source is a
    MindFormers save (``src_mindformers/``) have tests of their own."""
    return [GoldenScenario(p) for p in sorted(GOLDEN_DIR.iterdir())
            if (p / "manifest.json").is_file() and (p / "src_checkpoints").is_dir()]


def pytest_generate_tests(metafunc):
    """Any test taking a `golden_scenario` argument runs once per scenario."""
    if "golden_scenario" in metafunc.fixturenames:
        scenarios = golden_scenarios()
        metafunc.parametrize("golden_scenario", scenarios, ids=[s.name for s in scenarios])


# ============================================================================ file helpers


def tensor_sha256s(path) -> dict[str, str]:
    """name -> sha256 of the stored bytes of every entry of a `.ckpt` file, in file order."""
    from reshard_job.formats.ckpt import CheckpointReader

    out = {}
    with CheckpointReader(path) as r:
        for name in r.entries:
            h = hashlib.sha256()
            for block in r.iter_content(name):
                h.update(block)
            out[name] = h.hexdigest()
    return out


def file_sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def cut(array: np.ndarray, box) -> np.ndarray:
    """The part of `array` inside `box` ((start, stop) per dimension)."""
    return array[tuple(slice(a, b) for a, b in box)]


def write_sharded(root, tensors: dict, strategy=None, *, prefix: str = "checkpoint_",
                  extra: dict | None = None) -> dict[int, str]:
    """Write `root/rank_<g>/<prefix><g>.ckpt` for every rank of `strategy`, cut from global tensors.

    `tensors`: name -> global array, or (array, MindSpore dtype name) e.g. (uint16 words, "BFloat16").
    `strategy`: a StrategyFile or a path to one (plain or merged pipeline), or None for one
    unsharded rank. A parameter the strategy lays out goes to the ranks of the stages it lives in,
    cut by ``Layout.box``; any other parameter goes whole to every rank. `extra` entries
    (name -> array or str) are appended to every rank, as `append_dict` entries are.
    Returns {global rank: path}.
    """
    from reshard_job.formats.ckpt import CheckpointWriter
    from reshard_job.formats.strategy import read_strategy
    from reshard_job.layout import Layout
    from reshard_job.topology import Topology

    if isinstance(strategy, (str, os.PathLike)):
        strategy = read_strategy(strategy)
    topo = Topology.unsharded() if strategy is None else Topology.from_strategy(strategy)
    items = {n: (t if isinstance(t, tuple) else (np.asarray(t), None)) for n, t in tensors.items()}
    paths = {}
    for g in range(topo.devices):
        stage, local = topo.stage_of_rank(g), topo.local_rank(g)
        path = Path(root) / f"rank_{g}" / f"{prefix}{g}.ckpt"
        with CheckpointWriter(path) as w:
            for name, (array, dtype) in items.items():
                if name in topo:
                    rec = topo.layout(name, stage)
                    if rec is None:
                        continue  # lives in another pipeline stage
                    layout = Layout.from_recorded(rec, array.ndim, topo.stage_devices, name)
                    part = cut(array, layout.box(local, array.shape))
                else:
                    part = array
                w.add(name, np.array(part, order="C"), dtype)  # (ascontiguousarray turns 0-d into 1-d)
            for name, value in (extra or {}).items():
                if isinstance(value, str):
                    w.add_str(name, value)
                else:
                    w.add(name, np.asarray(value))
        paths[g] = str(path)
    return paths


@pytest.fixture(scope="session")
def helpers() -> SimpleNamespace:
    """The module's helpers (write_sharded, tensor_sha256s, file_sha256, cut) for tests to use."""
    return SimpleNamespace(write_sharded=write_sharded, tensor_sha256s=tensor_sha256s,
                           file_sha256=file_sha256, cut=cut, golden_scenarios=golden_scenarios)


@pytest.fixture(scope="session")
def all_golden_scenarios() -> list[GoldenScenario]:
    return golden_scenarios()
