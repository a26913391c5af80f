"""Fingerprint shares (``core.fingerprint_shares``): a batch of slices gives each slice's share as one
``Fingerprint`` of it would; shares of boxes tiling a tensor add up to the whole tensor's
fingerprint in any order, replicas once; gaps, overlaps and disagreeing replicas are reported."""

from __future__ import annotations

import itertools
import random

import ml_dtypes
import numpy as np
import pytest

from reshard_job.core.fingerprint import Fingerprint, fingerprint_array
from reshard_job.core.fingerprint_shares import ShareBatch, Share, merge_shares

DTYPES = [("Float16", np.float16), ("BFloat16", ml_dtypes.bfloat16), ("Float32", np.float32), ("Int8", np.int8),
          ("Float64", np.float64), ("Bool", np.bool_)]
SHAPES = [(8, 12), (6, 5, 3), (16,), (4, 1), (3, 2, 1, 7), (), (0, 4)]


def _cuts(n: int, parts: int) -> list[tuple[int, int]]:
    step = max(1, n // parts)
    edges = sorted({0, n, *range(step, n, step)})
    return list(zip(edges, edges[1:])) or [(0, n)]


def _tiles(shape, parts=(2, 3, 1, 2)):
    return list(itertools.product(*[_cuts(n, p) for n, p in zip(shape, parts)])) if shape else [()]


@pytest.mark.parametrize("dtype,np_type", DTYPES)
def test_batched_shares_equal_single_ones_and_add_up_to_the_whole(dtype, np_type):
    rng = np.random.default_rng(7)
    for shape in SHAPES:
        whole = np.asarray(rng.standard_normal(shape) * 10).astype(np_type)
        batch, shares = ShareBatch(), []
        tiles = _tiles(shape)
        for i, box in enumerate(tiles):
            part = np.ascontiguousarray(whole[tuple(slice(lo, hi) for lo, hi in box) + (Ellipsis,)])
            batch.add(f"t{i}", dtype, shape, box, part)
        digests = batch.flush()
        for i, box in enumerate(tiles):
            part = np.ascontiguousarray(whole[tuple(slice(lo, hi) for lo, hi in box) + (Ellipsis,)])
            assert digests[f"t{i}"] == Fingerprint(dtype, shape).add_box(box, part).hexdigest(partial=True)
            shares.append(Share("w", dtype, shape, box, digests[f"t{i}"], rank=i))
        shares += shares[:2]  # replicas: the same box, the same bytes, counted once
        random.Random(len(shares)).shuffle(shares)
        merged = merge_shares(shares)
        assert merged.complete and merged.fingerprints == {"w": fingerprint_array(dtype, whole)}, shape


def test_a_large_slice_is_fingerprinted_on_its_own_and_agrees():
    whole = np.arange(2 * 40_000, dtype=np.float32).reshape(2, 40_000)
    batch = ShareBatch()
    batch.add("top", "Float32", whole.shape, ((0, 1), (0, 40_000)), whole[:1])
    batch.add("bottom", "Float32", whole.shape, ((1, 2), (0, 40_000)), whole[1:])
    digests = batch.flush()
    shares = [Share("w", "Float32", whole.shape, ((i, i + 1), (0, 40_000)), digests[n]) for i, n in
              enumerate(["top", "bottom"])]
    assert merge_shares(shares).fingerprints == {"w": fingerprint_array("Float32", whole)}


def test_gaps_overlaps_and_disagreeing_replicas_are_reported_not_merged():
    whole = np.arange(24, dtype=np.float32).reshape(4, 6)

    def share(name, box, rank, data=whole):
        part = np.ascontiguousarray(data[tuple(slice(lo, hi) for lo, hi in box)])
        return Share(name, "Float32", (4, 6), box, Fingerprint("Float32", (4, 6)).add_box(box, part)
                     .hexdigest(partial=True), rank=rank)

    other = whole.copy()
    other[0, 0] = -1
    merged = merge_shares([
        share("gap", ((0, 2), (0, 6)), 0),
        share("overlap", ((0, 3), (0, 6)), 0), share("overlap", ((2, 4), (0, 6)), 1),
        share("replicas", ((0, 4), (0, 6)), 0), share("replicas", ((0, 4), (0, 6)), 3, other),
        Share("shapes", "Float32", (4, 6), ((0, 4), (0, 6)), "0" * 32, rank=0),
        Share("shapes", "Float32", (6, 4), ((0, 6), (0, 4)), "0" * 32, rank=1),
    ])
    assert merged.incomplete == {"gap": "12 of its 24 elements loaded (by ranks [0])"}
    assert merged.conflicts == {
        "overlap": "boxes [0:3, 0:6] and [2:4, 0:6] overlap",
        "replicas": "ranks 0 and 3 loaded different bytes for its box [0:4, 0:6]",
        "shapes": "loaded as Float32[6, 4] by rank 1 and as Float32[4, 6] by rank 0"}
    assert not merged.fingerprints and not merged.complete
    with pytest.raises(ValueError, match="not grouped by name"):
        merge_shares([share("a", ((0, 4), (0, 6)), 0), share("b", ((0, 4), (0, 6)), 0),
                      share("a", ((0, 4), (0, 6)), 1)])
