"""Finished rank files wait sealed and are published together (one device flush for the batch):
each lands only once durable and renamed; one that cannot be published is removed and reported
after the others landed."""

from __future__ import annotations

import hashlib
import os
import pickle

import pytest

from reshard_job.errors import OutputError
from reshard_job.job.run.local import _finished, _publish, _Sealed
from reshard_job.storage.atomic import TMP_SUFFIX, AtomicFile
from reshard_job.execute.tasks import RankResult


def _sealed(path, data: bytes, portable: bool = False):
    f = AtomicFile(path, direct=True)
    f.write(data)
    size, digest = f.seal()
    assert not os.path.exists(path)  # sealed: complete, not visible yet
    # portable: the picklable handle a worker process hands to the job process
    return _Sealed(RankResult(0, str(path), size, digest, {}), pickle.loads(pickle.dumps(f.sealed())) if portable else f)


def _temp_files(root):
    return [n for _, _, names in os.walk(root) for n in names if n.endswith(TMP_SUFFIX)]


def test_a_batch_lands_in_order_once_published(tmp_path):
    batch = [_sealed(tmp_path / f"rank_{i}" / "c.ckpt", bytes([i]) * (5000 + i)) for i in range(3)]
    landed = []

    def on_done(r):
        assert os.path.exists(r.path)  # visible before it is journaled
        landed.append(r.path)

    _publish(batch, on_done)
    assert batch == []
    assert landed == [str(tmp_path / f"rank_{i}" / "c.ckpt") for i in range(3)]
    for i in range(3):
        data = (tmp_path / f"rank_{i}" / "c.ckpt").read_bytes()
        assert data == bytes([i]) * (5000 + i)
    assert _temp_files(tmp_path) == []


def test_one_that_cannot_be_published_is_removed_and_raised_after_the_others_landed(tmp_path):
    batch = [_sealed(tmp_path / f"rank_{i}" / "c.ckpt", b"x" * 100, portable=True) for i in range(3)]
    os.makedirs(tmp_path / "rank_1" / "c.ckpt")  # a directory in the way of rank 1
    landed = []
    with pytest.raises(OutputError) as err:
        _publish(batch, lambda r: landed.append(r.path))
    assert str(tmp_path / "rank_1" / "c.ckpt") in str(err.value)
    assert landed == [str(tmp_path / "rank_0" / "c.ckpt"), str(tmp_path / "rank_2" / "c.ckpt")]
    assert batch == []
    assert _temp_files(tmp_path) == []


def test_sealed_digest_is_the_published_files(tmp_path):
    data = os.urandom(9 << 20)  # more than one staging block
    entry = _sealed(tmp_path / "c.ckpt", data)
    result = entry.result
    entry.handle.publish()
    assert result.sha256 == hashlib.sha256((tmp_path / "c.ckpt").read_bytes()).hexdigest()
    assert result.size == len(data)


def test_a_file_published_already_lands_at_once_and_a_sealed_one_waits(tmp_path):
    batch, landed = [], []
    uploaded = RankResult(1, "s3://bucket/out/rank_1/c.ckpt", 10, "0" * 64, {})
    assert _finished(batch, uploaded, None, landed.append) == 0
    assert landed == [uploaded] and batch == []
    sealed = _sealed(tmp_path / "rank_0" / "c.ckpt", b"y" * 4096)
    assert _finished(batch, sealed.result, sealed.handle, landed.append) == 4096
    assert landed == [uploaded] and [e.result for e in batch] == [sealed.result]
    _publish(batch, landed.append)
    assert landed == [uploaded, sealed.result]


def test_publishing_retried_after_an_interruption_publishes_nothing_twice(tmp_path):
    batch = [_sealed(tmp_path / f"rank_{i}" / "c.ckpt", b"z" * 100) for i in range(3)]
    landed = []

    def interrupted_after_the_first(r):
        landed.append(r.path)
        if len(landed) == 1:
            raise KeyboardInterrupt  # a Ctrl-C while journaling the first
    with pytest.raises(KeyboardInterrupt):
        _publish(batch, interrupted_after_the_first)
    assert all(e.published for e in batch[1:])
    _publish(batch, lambda r: landed.append(r.path))  # the retry while unwinding: publishes none again
    assert landed[-2:] == [str(tmp_path / f"rank_{i}" / "c.ckpt") for i in (1, 2)]
    assert all((tmp_path / f"rank_{i}" / "c.ckpt").read_bytes() == b"z" * 100 for i in range(3))
    assert _temp_files(tmp_path) == []
