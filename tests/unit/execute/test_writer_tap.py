"""``execute.writer_tap``: partial fingerprints of boxes, fed as a writer feeds them, add up to the
whole tensor's fingerprint; small tensors (computed in batches) and large ones (fed in pieces cut
anywhere) alike; what crosses processes pickles compactly; a tensor short of bytes has no digest,
and one box counted twice gives a digest unlike the tensor's."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import numpy as np
import pytest

from reshard_job.core.fingerprint import fingerprint_array
from reshard_job.execute.writer_tap import SMALL, TargetSums, WriterTap


def _facts(**shapes):
    """The parameters to give, as the plan's tensors describe them: name -> (dtype, global shape)."""
    return [SimpleNamespace(name=n, dtype=d, global_shape=tuple(s)) for n, (d, s) in shapes.items()]


def _boxes(shape, cuts):
    """The boxes of `shape` cut into cuts[d] equal parts along each dim d."""
    if not shape:
        return [()]
    step = shape[0] // cuts[0]
    return [((i * step, (i + 1) * step),) + rest for i in range(cuts[0]) for rest in _boxes(shape[1:], cuts[1:])]


def _feed(tap, name, dtype, array, box, piece):
    part = np.ascontiguousarray(array[tuple(slice(lo, hi) for lo, hi in box)])
    tap.expect(name, dtype, "tensor", array.shape, part.shape, tuple(lo for lo, _ in box))
    feed = tap.feed(name)
    raw = part.reshape(-1).view(np.uint8)
    for off in range(0, max(raw.size, 1), piece):  # cut anywhere, mid-element too
        feed.update(raw[off:off + piece])


@pytest.mark.parametrize("dtype,np_dtype,shape,cuts,piece", [
    ("Float16", np.uint16, (64, 24), (4, 2), 1 << 20),  # small: batched
    ("BFloat16", np.uint16, (512, 256), (2, 4), 12_345),  # large, odd pieces
    ("Float32", np.uint32, (300, 7, 33), (3, 1, 1), 1 << 20),
    ("Int8", np.int8, (40, 3, 1), (2, 3, 1), 5),
    ("Float64", np.uint64, (), (), 8),
])
def test_the_partials_of_a_tiling_add_up_to_the_whole_tensors_fingerprint(dtype, np_dtype, shape, cuts, piece):
    rng = np.random.default_rng(7)
    array = rng.integers(0, 100, size=shape).astype(np_dtype)
    sums = TargetSums()
    for rank, box in enumerate(_boxes(shape, cuts)):
        tap = WriterTap()
        _feed(tap, "w", dtype, array, box, piece)
        tap.expect("unfed", dtype, "tensor", shape, shape, (0,) * len(shape))  # never started by the writer
        tap.feed("unfed")
        partials = tap.result()
        assert partials is None  # a tensor started but never fed: the file is read back instead
        tap = WriterTap()
        _feed(tap, "w", dtype, array, box, piece)
        sums.add(pickle.loads(pickle.dumps(tap.result())))
    digests, uncovered = sums.digests(_facts(w=(dtype, shape)))
    assert not uncovered and digests == {"w": fingerprint_array(dtype, array)}


def test_small_and_large_tensors_of_one_rank_are_each_right():
    rng = np.random.default_rng(1)
    tensors = {f"t{i}": rng.integers(0, 1 << 15, size=(8 * (i + 1), 16)).astype(np.uint16) for i in range(40)}
    tensors["big"] = rng.integers(0, 1 << 15, size=(SMALL, 2)).astype(np.uint16)
    tap = WriterTap()
    for name, a in tensors.items():
        _feed(tap, name, "Float16", a, ((0, a.shape[0]), (0, a.shape[1])), 1 << 20)
    sums = TargetSums()
    sums.add(tap.result())
    digests, _ = sums.digests(_facts(**{n: ("Float16", a.shape) for n, a in tensors.items()}))
    assert digests == {n: fingerprint_array("Float16", a) for n, a in tensors.items()}


def test_a_box_counted_twice_or_not_at_all_does_not_give_the_tensors_fingerprint():
    a = np.arange(32, dtype=np.uint16).reshape(4, 8)
    half = WriterTap()
    _feed(half, "w", "Float16", a, ((0, 2), (0, 8)), 64)
    partials = half.result()
    once, twice = TargetSums(), TargetSums()
    once.add(partials)
    twice.add(partials)
    twice.add(partials)  # the bytes of the whole tensor in count, the wrong ones
    digests, uncovered = once.digests(_facts(w=("Float16", (4, 8)), elsewhere=("Float16", (4, 8))))
    assert digests == {} and uncovered == ["w"]  # half its bytes: named, no digest
    digests, uncovered = twice.digests(_facts(w=("Float16", (4, 8))))
    assert not uncovered and digests["w"] != fingerprint_array("Float16", a)  # the comparison names it


def test_strings_and_unexpected_tensors_get_no_feed():
    tap = WriterTap()
    tap.expect("s", "String", "str", (0,), (0,), (0,))
    assert tap.feed("s") is None and tap.feed("never_expected") is None
    assert len(tap.result()) == 0
