"""Comparing what several source ranks must hold identically, as ``job.mode=plan`` reads it: small
tensors compared as bytes a run at a time, large ones hashed, the first difference reported in the
order a name-by-name comparison would find it."""

from __future__ import annotations

import numpy as np
import pytest

from reshard_job.formats.ckpt import CheckpointReader, CheckpointWriter
from reshard_job.formats.safetensors import SafetensorsReader, save_file
from reshard_job.job.stages import replica_bytes
from reshard_job.job.stages.replica_bytes import first_mismatch


def _ranks(tmp_path, kind: str, changes: dict[int, list[str]], count: int = 50):
    """Four ranks holding the same `count` small tensors and one large one, but for `changes`
    (rank -> names whose first element it changes)."""
    names = [f"p{i:03d}" for i in range(count)] + ["big"]
    readers = {}
    for rank in range(4):
        tensors = {n: np.arange(3, dtype=np.float32) + i for i, n in enumerate(names[:-1])}
        tensors["big"] = np.arange(100_000, dtype=np.float32)
        for name in changes.get(rank, ()):
            tensors[name] = tensors[name].copy()
            tensors[name][0] += 1
        path = tmp_path / f"rank_{rank}.{kind}"
        if kind == "safetensors":
            save_file(str(path), tensors)
            readers[rank] = SafetensorsReader(str(path))
        else:
            with CheckpointWriter(path) as w:
                for name, array in tensors.items():
                    w.add(name, array)
            readers[rank] = CheckpointReader(str(path))
    return names, readers


def _name_by_name(identical, readers):
    from reshard_job.job.stages.extra_ranks import tensor_digest

    for name, groups in identical.items():
        for group in groups:
            if len({tensor_digest(readers[r], name) for r in group}) > 1:
                return name, group
    return None


@pytest.mark.parametrize("kind", ["safetensors", "ckpt"])
@pytest.mark.parametrize("changes,want", [
    ({}, None),
    ({3: ["p030"]}, ("p030", (2, 3))),
    ({1: ["p040"], 2: ["p010"]}, ("p010", (2, 3))),
    ({1: ["p010"], 3: ["p010"]}, ("p010", (0, 1))),  # both groups differ: the first group is named
    ({0: ["big"]}, ("big", (0, 1))),
    ({2: ["big"], 0: ["p049"]}, ("p049", (0, 1))),
])
def test_the_first_difference_is_the_one_a_name_by_name_comparison_finds(tmp_path, monkeypatch, kind,
                                                                         changes, want):
    monkeypatch.setattr(replica_bytes, "RUN", 7)  # several runs, a run boundary inside the groups
    names, readers = _ranks(tmp_path, kind, changes)
    identical = {name: ((0, 1), (2, 3)) for name in names}
    try:
        got = first_mismatch(identical, readers.__getitem__)
        assert got == want == _name_by_name(identical, readers)
    finally:
        for r in readers.values():
            r.close()


def test_small_tensors_are_read_through_the_window_not_a_read_each(tmp_path, monkeypatch):
    names, readers = _ranks(tmp_path, "safetensors", {}, count=400)
    reads = []
    for r in readers.values():
        real = r.pread_into
        monkeypatch.setattr(r, "pread_into", lambda offset, view, real=real: reads.append(1) or real(offset, view))
    assert first_mismatch({n: ((0, 1, 2, 3),) for n in names[:-1]}, readers.__getitem__) is None
    assert 0 < len(reads) <= 4 * 4  # a few windows per rank, not one read per tensor and rank
    for r in readers.values():
        r.close()
