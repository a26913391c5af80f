"""The built-in demo: the seed tutorial's MLP (784-512-512-10) saved by 8 ranks.

The layout is MindSpore's own: the strategy file shipped in ``demo_data/`` was compiled by
MindSpore 2.10 for the tutorial's network on 8 cards (``layer1`` MatMul sharded ``((2,1),(1,2))``,
the rest data parallel). Layouts do not depend on tensor sizes, so the same file describes the
full-size network. The weights are seeded random numbers, with AdamWeightDecay's ``adam_m``/``adam_v``
states, ``global_step`` and ``learning_rate``, as a training run would save them. The checkpoint
set is generated once per user, under ``demo/`` of the cache folder the source digests use
(``$RESHARD_JOB_CACHE_DIR``, else ``~/.cache/reshard_job``), and reused by every later demo run
wherever it is launched, as long as it is intact: every file there with the size it was written
with (a list beside the set, ``<set>.files.json``, names them); otherwise it is written again.
"""

from __future__ import annotations

import json
import os
from importlib import resources

import numpy as np

from reshard_job.formats.ckpt import CheckpointWriter
from reshard_job.formats.strategy import read_strategy
from reshard_job.core.layout import Layout
from reshard_job.core.topology import Topology
from reshard_job.sources.file_digests import default_cache_folder
from reshard_job.storage import LOCAL
from reshard_job.storage.local_files import exclusive_lock, make_folder, publish_folder, replace_file

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


def demo_folder() -> str:
    """Where the demo set lives: once per user, in the cache folder (not under each launch folder)."""
    return os.path.join(default_cache_folder(), "demo")


def ensure_demo(root: str) -> tuple[str, str]:
    """Generate the demo checkpoints under `root` unless an intact set is there; return
    (checkpoints dir, strategy).

    Several jobs of a sweep (or of one user's shells) may start at once: one generates the set into
    a temporary folder and renames it into place under a lock, then lists its files; the others wait
    and then use it, so no job ever sees a demo file replaced under its feet.
    """
    ckpt_dir = os.path.join(root, DEMO_NAME)
    listing = ckpt_dir + ".files.json"
    strategy = strategy_path()
    if _intact(ckpt_dir, listing):
        return ckpt_dir, strategy
    make_folder(root)
    with exclusive_lock(os.path.join(root, ".demo.lock")):
        if _intact(ckpt_dir, listing):
            return ckpt_dir, strategy
        topo = Topology.from_strategy(read_strategy(strategy))
        LOCAL.remove(listing)  # the set it lists is about to be replaced
        # an incomplete, altered or older set is replaced
        publish_folder(ckpt_dir, lambda staging: _write_demo(staging, topo))
        sizes = dict(sorted((os.path.relpath(os.path.join(d, f), ckpt_dir), os.path.getsize(os.path.join(d, f)))
                            for d, _, names in os.walk(ckpt_dir) for f in names))
        replace_file(listing, json.dumps({"name": DEMO_NAME, "seed": SEED, "sizes": sizes}, indent=1).encode())
    return ckpt_dir, strategy


def _intact(ckpt_dir: str, listing: str) -> bool:
    """Every file the listing names is there with its size. Sizes, not digests: this runs on every
    demo start, and the job itself hashes (and records) what it reads."""
    try:
        with open(listing, encoding="utf-8") as f:
            recorded = json.load(f)
        sizes = recorded["sizes"]
        if recorded.get("name") != DEMO_NAME or recorded.get("seed") != SEED or not sizes:
            return False
        return all(os.path.getsize(os.path.join(ckpt_dir, rel)) == size for rel, size in sizes.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


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
