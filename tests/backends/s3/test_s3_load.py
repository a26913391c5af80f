"""``load_rank`` from the object store: the same tensors as from disk, and no more bytes fetched
than the rank needs plus the files' headers (counted by a relaying proxy on loopback)."""

from __future__ import annotations

import os

import pytest

import reshard_job
from reshard_job.api import build_plan
from reshard_job.formats.ckpt import CheckpointReader

from s3_job_helpers import Bucket, ThrottlingProxy, make_big_source


@pytest.fixture
def bucket(s3_store, s3_prefix) -> Bucket:
    name, prefix = s3_prefix[len("s3://"):].split("/", 1)
    return Bucket(s3_store, name, prefix)


def _headers(files) -> int:
    """Bytes of the files that are not tensor data (record heads, names, the CRC trailer)."""
    total = 0
    for path in files:
        with CheckpointReader(path) as r:
            total += os.path.getsize(path) - sum(r[n].nbytes for n in r.names())
    return total


def test_a_rank_loads_from_the_bucket_what_it_loads_from_disk_fetching_only_its_bytes(bucket, s3_server, tmp_path):
    source = make_big_source(tmp_path / "src")
    base = bucket.put_tree(source.root, bucket.url("src"))
    local = reshard_job.load_rank(0, source.checkpoints, source.root / "src_strategy.ckpt",
                                  source.root / "dst_strategy.ckpt")
    plan, prepared = build_plan(str(source.checkpoints), str(source.root / "src_strategy.ckpt"),
                                                str(source.root / "dst_strategy.ckpt"), target_ranks=[0])
    needed = plan.rank(0).bytes_read
    prepared.close()
    with ThrottlingProxy(s3_server.endpoint, lambda method, path: False) as proxy:
        remote = reshard_job.load_rank(0, f"{base}/ckpts", f"{base}/src_strategy.ckpt",
                                       source.root / "dst_strategy.ckpt",
                                       storage_options={"endpoint_url": proxy.endpoint, "options": s3_server.options()})
        served = proxy.served
    assert list(remote) == list(local) and all(remote[n].tobytes() == local[n].tobytes() for n in local)
    files = sorted(source.checkpoints.rglob("*.ckpt"))
    overhead = _headers(files) + os.path.getsize(source.root / "src_strategy.ckpt")
    assert needed > 0 and served <= 1.05 * needed + overhead, (served, needed, overhead)
    assert served < sum(os.path.getsize(f) for f in files)  # not the whole files


def test_a_single_file_in_the_bucket_is_one_whole_model(bucket, s3_storage_options):
    """A whole model stored as one object splits as the same file on disk does; a missing one is
    refused in one line naming it."""
    from pathlib import Path

    from reshard_job.errors import ConfigError

    s5b = Path(__file__).resolve().parents[2] / "golden" / "S5b_split_1to8"
    whole, dst = s5b / "src_checkpoints" / "rank_0" / "checkpoint_0.ckpt", s5b / "dst_strategy.ckpt"
    url = bucket.url("whole", "model.ckpt")
    bucket.put(url, whole.read_bytes())
    for rank in (0, 6):
        remote = reshard_job.load_rank(rank, url, None, dst, storage_options=s3_storage_options)
        local = reshard_job.load_rank(rank, whole, None, dst)
        assert [(n, a.tobytes()) for n, a in remote.items()] == [(n, a.tobytes()) for n, a in local.items()]
    missing = bucket.url("whole", "absent.safetensors")
    with pytest.raises(ConfigError, match=f"^source checkpoint file not found: {missing}$"):
        reshard_job.load_rank(0, missing, None, dst, storage_options=s3_storage_options)
