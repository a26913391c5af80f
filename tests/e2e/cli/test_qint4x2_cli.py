"""qint4x2 (MindSpore's ``Int4``) through the CLI, from a `.ckpt` source.

MindSpore stores a qint4x2 tensor as one byte (two 4-bit values, packed along the last dimension)
per element of its stored shape: ``.ckpt`` dims and strategy slice shapes count those bytes, and its
converters slice the tensor's int8 host array. So the same bytes typed ``Int4`` must come out of a
resharding exactly as they do typed ``Int8`` (a golden-tested path), keeping the ``Int4`` type.

The source is golden S5b's full checkpoint (MindSpore 2.10, split 1 -> 8 by the target strategy)
with two weights retyped ``Int4`` and their Adam first moments, laid out like them, given the
same bytes as ``Int8``: one run shows both side by side.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import safetensors

from reshard_job.formats.ckpt import CheckpointReader, CheckpointWriter

S5B = Path(__file__).parents[2] / "golden" / "S5b_split_1to8"
PACKED = ("head.weight", "layers.0.ffn.w1.weight")  # split by the target strategy
WHOLE = "quant.offset"  # in no strategy: copied whole


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> tuple[Path, dict[str, tuple]]:
    root = tmp_path_factory.mktemp("int4_source")
    rng = np.random.default_rng(4)
    shapes = {}
    with CheckpointReader(S5B / "src_checkpoints" / "rank_0" / "checkpoint_0.ckpt") as r, \
            CheckpointWriter(root / "rank_0" / "checkpoint_0.ckpt", mode=0o644) as w:
        packed = {name: rng.integers(-128, 128, r.entries[name].shape, dtype=np.int8) for name in PACKED}
        for name in r.names():
            base = name.removeprefix("adam_m.")
            if base in packed:
                w.add(name, packed[base], "Int4" if name == base else "Int8")
                shapes[name] = r.entries[name].shape
            else:
                w.add(name, r.read(name), r.entries[name].dtype)
        w.add(WHOLE, np.arange(-3, 3, dtype=np.int8), "Int4")
    return root, shapes


def _convert(app, tmp_path: Path, src: Path, fmt: str) -> Path:
    """The job (as its own process, forked by the e2e `app` launcher) on `src`, to `fmt`."""
    out = tmp_path / f"out_{fmt}"
    res = app(tmp_path, f"source.checkpoints={src}", "target=strategy", f"target.strategy={S5B / 'dst_strategy.ckpt'}",
              f"target.format={fmt}", f"output.dir={out}", timeout=180)
    assert res.returncode == 0, res.stderr
    return out


def test_int4_splits_exactly_as_its_bytes_typed_int8(tmp_path, source, app):
    src, shapes = source
    out = _convert(app, tmp_path, src, "ckpt")
    for rank in range(8):
        with CheckpointReader(out / f"rank_{rank}" / f"checkpoint_{rank}.ckpt") as r:
            for name in PACKED:
                q, twin = r.entries[name], r.entries[f"adam_m.{name}"]
                assert (q.dtype, twin.dtype) == ("Int4", "Int8")
                assert q.shape == twin.shape != shapes[name]  # really split
                assert r.read_raw(name) == r.read_raw(twin.name), (rank, name)
            assert r.entries[WHOLE].dtype == "Int4"
            assert r.read_raw(WHOLE) == np.arange(-3, 3, dtype=np.int8).tobytes()


def test_int4_to_safetensors_keeps_mindspores_marker(tmp_path, source, app):
    out = _convert(app, tmp_path, source[0], "safetensors")
    with safetensors.safe_open(str(out / "rank_3" / "checkpoint_3.safetensors"), framework="np") as f:
        meta = f.metadata()
        for name in (*PACKED, WHOLE):
            assert meta[name] == "Int4"  # what MindSpore's loader turns back into qint4x2
            assert f.get_tensor(name).dtype == np.int8
        assert f"adam_m.{PACKED[0]}" not in meta
        for name in PACKED:
            assert f.get_tensor(name).tobytes() == f.get_tensor(f"adam_m.{name}").tobytes()
