"""The built-in demo: the seed tutorial's MLP (784-512-512-10) saved by 8 ranks.

The layout is MindSpore's own: the strategy file shipped in ``demo_data/`` was compiled by
MindSpore 2.10 for the tutorial's network on 8 cards (``layer1`` MatMul sharded ``((2,1),(1,2))``,
the rest data parallel). Layouts do not depend on tensor sizes, so the same file describes the
full-size network. The weights are seeded random numbers, with AdamWeightDecay's ``adam_m``/``adam_v``
states, ``global_step`` and ``learning_rate``, as a training run would save them. The checkpoint
set is generated once under ``runs/demo/`` of the launch directory and reused.
"""

from __future__ import annotations

import os
from importlib import resources

import numpy as np

from reshard_job.formats.ckpt import CheckpointWriter
from reshard_job.formats.strategy import read_strategy
from reshard_job.core.layout import Layout
from reshard_job.core.topology import Topology
from reshard_job.storage.local_files import exclusive_lock, make_folder, publish_folder

DEMO_NAME = "mlp_784-512-512-10_8ranks"
SHAPES = {
    "layer1.weight": (784, 512),
    "layer1.bias": (512,),
    "layer2.weight": (512, 512),
    "layer2.bias": (512,),
    "layer3.weight": (512, 10),
    "layer3.bias": (10,),
}
SEED = 20261122


def strategy_path() -> str:
    return str(resources.files("reshard_job") / "demo_data" / "mlp_8ranks_strategy.ckpt")


def global_tensors() -> dict[str, np.ndarray]:
    """Every parameter of the demo checkpoint, whole, in file order."""
    rng = np.random.default_rng(SEED)
    out: dict[str, np.ndarray] = {}
    for name, shape in SHAPES.items():
        out[name] = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    out["global_step"] = np.array([1875], dtype=np.int32)
    out["learning_rate"] = np.array(0.01, dtype=np.float32)
    for prefix in ("adam_m.", "adam_v."):
        for name, shape in SHAPES.items():
            scale = 1e-3 if prefix == "adam_m." else 1e-6
            out[prefix + name] = np.abs(rng.standard_normal(shape) * scale).astype(np.float32)
    return out


def ensure_demo(root: str) -> tuple[str, str]:
    """Generate the demo checkpoints under `root` unless present; return (checkpoints dir, strategy).

    Several jobs of a sweep may start at once: one generates the set into a temporary folder and
    renames it into place under a lock, the others wait and then use it, so no job ever sees a
    demo file replaced under its feet.
    """
    ckpt_dir = os.path.join(root, DEMO_NAME)
    strategy = strategy_path()
    topo = Topology.from_strategy(read_strategy(strategy))
    files = [os.path.join(ckpt_dir, f"rank_{r}", f"checkpoint_{r}.ckpt") for r in range(topo.devices)]
    if all(os.path.exists(f) for f in files):
        return ckpt_dir, strategy
    make_folder(root)
    with exclusive_lock(os.path.join(root, ".demo.lock")):
        if all(os.path.exists(f) for f in files):
            return ckpt_dir, strategy
        # an incomplete set from an older version is replaced
        publish_folder(ckpt_dir, lambda staging: _write_demo(staging, topo))
    return ckpt_dir, strategy


def _write_demo(folder: str, topo: Topology) -> None:
    tensors = global_tensors()
    for rank in range(topo.devices):
        with CheckpointWriter(os.path.join(folder, f"rank_{rank}", f"checkpoint_{rank}.ckpt")) as w:
            for name, full in tensors.items():
                rec = topo.layout(name, 0)
                if rec is None:
                    w.add(name, full)
                    continue
                layout = Layout.from_recorded(rec, full.ndim, topo.stage_devices, name)
                box = layout.box(rank, full.shape)
                w.add(name, full[tuple(slice(a, b) for a, b in box)])
