"""The integrity stage on its own (``job.stages.integrity.hash_sources``): every source file the
plan needs is named by its sha256 and checked in the same read — its CRC32 trailer, and the
tensors the source strategy says several ranks hold identically.

Real files: the golden scenario S1 (MindSpore's own 8-rank MLP checkpoints), copied into tmp_path
so that single files can be altered.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import zlib
from pathlib import Path

import pytest

from reshard_job.errors import FormatError, PlanError
from reshard_job.formats.ckpt import CRC_MAGIC, CheckpointReader
from reshard_job.job.config.spec import SourceSpec, TargetSpec
from reshard_job.job.stages.integrity import hash_sources
from reshard_job.job.stages.prepare import IDENTICAL_CHECKED, prepare
from reshard_job.storage import SourceChangedError

S1 = Path(__file__).parents[3] / "golden" / "S1_mlp_tutorial_8to4"


def _copy_sources(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    shutil.copytree(S1 / "src_checkpoints", src)
    return src


def _checkpoint(src: Path, rank: int) -> Path:
    return src / f"rank_{rank}" / f"checkpoint_{rank}.ckpt"


def _prepare(src: Path):
    return prepare(SourceSpec(str(src), str(S1 / "src_strategy.ckpt")),
                   TargetSpec(strategy=str(S1 / "dst_strategy.ckpt")))


def _hash(prepared):
    return hash_sources(prepared, use_cache=False, progress=False)


def _append_crc_trailer(path: Path, crc: int | None = None) -> None:
    """A CRC32 trailer as MindSpore writes it (``crc_num`` + 10 big-endian bytes); `crc` overrides
    the right value."""
    data = path.read_bytes()
    path.write_bytes(data + CRC_MAGIC + (zlib.crc32(data) if crc is None else crc).to_bytes(10, "big"))


def test_each_needed_source_is_named_by_its_sha256(tmp_path):
    src = _copy_sources(tmp_path)
    with _prepare(src) as prepared:
        digests = _hash(prepared)
        needed = sorted(prepared.plan.source_ranks)
        assert [f["rank"] for f in digests.files] == needed == [0, 1, 2, 3]  # 8 -> 4 reads half the ranks
        for entry in digests.files:
            data = Path(entry["path"]).read_bytes()
            assert entry["path"] == prepared.source_paths[entry["rank"]]
            assert entry["size"] == len(data)
            assert entry["sha256"] == hashlib.sha256(data).hexdigest()
        (strategy,) = digests.strategies
        assert strategy.sha256 == hashlib.sha256((S1 / "src_strategy.ckpt").read_bytes()).hexdigest()
        assert sorted(digests.identities) == needed
        assert IDENTICAL_CHECKED in prepared.checks  # the replicas were compared while hashing


def test_a_right_crc_trailer_passes_and_a_wrong_one_is_refused_naming_the_file(tmp_path):
    src = _copy_sources(tmp_path)
    for rank in range(8):
        _append_crc_trailer(_checkpoint(src, rank))
    with _prepare(src) as prepared:
        digests = _hash(prepared)
    assert digests.files[2]["sha256"] == hashlib.sha256(_checkpoint(src, 2).read_bytes()).hexdigest()

    damaged = _checkpoint(src, 2)
    damaged.write_bytes(damaged.read_bytes()[:-10] + (12345).to_bytes(10, "big"))
    with _prepare(src) as prepared:  # indexing does not check CRCs: hashing does, in the same read
        with pytest.raises(FormatError) as refused:
            _hash(prepared)
    assert refused.value.path == str(damaged)
    assert "CRC32 mismatch" in str(refused.value) and "12345" in str(refused.value)


def test_replicas_that_differ_are_refused_naming_the_tensor(tmp_path):
    src = _copy_sources(tmp_path)
    altered = _checkpoint(src, 2)
    with CheckpointReader(str(altered)) as reader:
        offset, length = reader.entries["layer1.bias"].pieces[0]  # replicated on ranks 0-3
    assert length > 0
    with open(altered, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    with _prepare(src) as prepared:
        assert (0, 1, 2, 3) in prepared.plan.identical["layer1.bias"]
        with pytest.raises(PlanError, match=r"layer1\.bias.*differs between source ranks 0"):
            _hash(prepared)
        assert IDENTICAL_CHECKED not in prepared.checks


def test_a_source_replaced_after_it_was_indexed_is_refused(tmp_path):
    src = _copy_sources(tmp_path)
    replaced = _checkpoint(src, 1)
    with _prepare(src) as prepared:
        data = replaced.read_bytes()
        replaced.unlink()  # a new file (another inode) with the same name and bytes
        replaced.write_bytes(data)
        os.utime(replaced, ns=(1, 1))
        with pytest.raises(SourceChangedError, match=str(replaced)):
            _hash(prepared)


def _with_extra_params(path: Path, values: dict[str, float]) -> None:
    """Rewrite a .ckpt with its entries, then one small tensor per item of `values` (names the
    source strategy does not lay out: every rank holds them whole, so they must be identical)."""
    import numpy as np

    from reshard_job.formats.ckpt import CheckpointWriter

    with CheckpointReader(str(path)) as r:
        items = [(n, r.read(n), r.entries[n].dtype) for n in r.names()]
    path.unlink()
    with CheckpointWriter(str(path), mode=0o644) as w:
        for name, array, dtype in items:
            w.add(name, array, dtype)
        for name, value in values.items():
            w.add(name, np.full(3, value, np.float32))


def _prepare_whole(src: Path):
    return prepare(SourceSpec(str(src), str(S1 / "src_strategy.ckpt")),
                   TargetSpec(strategy=str(S1 / "dst_strategy.ckpt"), unmapped="full"))


@pytest.mark.parametrize("shuffled", [False, True], ids=["same order", "rank 2 in another order"])
def test_many_small_whole_tensors_are_compared_across_every_rank(tmp_path, shuffled):
    src = _copy_sources(tmp_path)
    values = {f"extra.p{i}": float(i) for i in range(200)}
    for rank in range(8):
        _with_extra_params(_checkpoint(src, rank), dict(reversed(values.items())) if shuffled and rank == 2 else values)
    with _prepare_whole(src) as prepared:
        _hash(prepared)
        assert IDENTICAL_CHECKED in prepared.checks

    _with_extra_params(_checkpoint(src, 3), {**values, "extra.p117": -1.0})
    with _prepare_whole(src) as prepared:
        # (8 -> 4 reads ranks 0-3)
        with pytest.raises(PlanError, match=r"'extra\.p117' differs between source ranks 0-3"):
            _hash(prepared)
