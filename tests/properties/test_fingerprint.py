"""Parameter fingerprints (`reshard_job.core.fingerprint`): one value per global tensor whatever the
layout, the feeding order or the cut, and a different value after any one-bit change.

Random global tensors of every sliceable dtype (random bytes: NaN payloads, odd bool bytes and all)
are cut into random box partitions (1-3 split axes, uneven counts, nested cuts as optimizer shards
make, the unique boxes of real MindSpore layouts) or into byte runs cut at arbitrary offsets,
fed in random order, spread over several fingerprints and merged. A byte-by-byte reference written
from the module docstring pins the definition, with the segment and step sizes shrunk so that small
tensors cross segment and step boundaries.
"""

from __future__ import annotations

import hashlib
import pickle
from contextlib import contextmanager
from functools import lru_cache
from math import prod

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reshard_job.core.dtypes as dtypes
from reshard_job.core.fingerprint import ALGORITHM, Fingerprint, fingerprint_array
from reshard_job.core.layout import Layout

from .reference import layout_and_shape
from fingerprint_segments import small_segments  # tests/ is on sys.path through its conftest

DTYPES = sorted(name for name, d in dtypes.BY_NAME.items() if d.sliceable)
# No MindSpore dtype is opaque any more (Int4 was, until its stored shape was known to count bytes);
# the opaque path stays for one that is, and keeps its pinned digest under Int4's name.
OPAQUE = dtypes.DType("Int4", None, None)
SETTINGS = settings(deadline=None, max_examples=150, suppress_health_check=[HealthCheck.too_slow])
MASK = (1 << 64) - 1


# ================================================================================ helpers


def tensor(draw, max_elements: int = 400):
    """(dtype name, shape, raw bytes): 0-4 dims with some 1s and, now and then, a zero."""
    name = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.sampled_from([1, 1, 2, 3, 4, 5, 7, 8, 9, 13]), max_size=4)))
    while prod(shape) > max_elements:
        shape = shape[1:]
    if shape and draw(st.integers(0, 15)) == 0:
        shape = shape[:-1] + (0,)
    nbytes = prod(shape) * dtypes.lookup(name).itemsize
    raw = draw(st.binary(min_size=nbytes, max_size=nbytes))
    if name == "Bool":
        raw = bytes(b & 1 for b in raw)
    return name, shape, raw


def as_array(name, shape, raw) -> np.ndarray:
    return np.frombuffer(raw, dtype=dtypes.lookup(name).storage).reshape(shape)


def whole(name, shape, raw) -> str:
    return Fingerprint(name, shape).add_run(0, raw).hexdigest()


def cut(box, axis, points):
    lo, hi = box[axis]
    edges = [lo] + sorted({p for p in points if lo < p < hi}) + [hi]
    return [box[:axis] + ((a, b),) + box[axis + 1:] for a, b in zip(edges, edges[1:])]


@st.composite
def partitions(draw, shape):
    """Boxes that tile `shape`: 1-3 axes cut at random (uneven) points, then some boxes cut again."""
    boxes = [tuple((0, n) for n in shape)]
    axes = [d for d, n in enumerate(shape) if n > 1]
    for axis in draw(st.lists(st.sampled_from(axes), max_size=3, unique=True)) if axes else []:
        points = draw(st.lists(st.integers(1, shape[axis] - 1), max_size=3))
        boxes = [piece for box in boxes for piece in cut(box, axis, points)]
    for i in draw(st.lists(st.integers(0, len(boxes) - 1), max_size=3, unique=True)):
        axis = draw(st.integers(0, len(shape) - 1)) if shape else 0
        if shape and boxes[i][axis][1] - boxes[i][axis][0] > 1:
            inner = draw(st.integers(boxes[i][axis][0] + 1, boxes[i][axis][1] - 1))
            boxes[i:i + 1] = cut(boxes[i], axis, [inner])
    return draw(st.permutations(boxes))


def box_data(array, box, kind):
    part = array[tuple(slice(a, b) for a, b in box)]
    return {"array": part, "bytes": np.ascontiguousarray(part).tobytes(),
            "memoryview": memoryview(np.ascontiguousarray(part).tobytes())}[kind]


@lru_cache(maxsize=None)
def _seed(lane: int, purpose: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{ALGORITHM}/{lane}/{purpose}".encode()).digest()[:8], "little")


def _key(index: int, lane: int, purpose: str) -> int:
    z = (index * 0x9E3779B97F4A7C15 + _seed(lane, purpose)) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return (z ^ (z >> 31)) | 1


def reference_hexdigest(name, shape, raw, segment=1 << 13) -> str:
    """The docstring's definition, byte by byte, in plain Python integers."""
    size = dtypes.lookup(name).itemsize
    kept = list(shape)
    while kept and kept[-1] == 1:
        kept.pop()
    lanes = [0, 0]
    for p, b in enumerate(raw):
        element, byte = divmod(p, size)
        index = [int(i) for i in np.unravel_index(element, kept)] if kept else []
        lead, j = index[:-1], (index[-1] * size if index else 0) + byte
        c, place = divmod(j, 8)
        for lane in (0, 1):
            k = _key(c % segment, lane, "col") * _key(c // segment, lane, "segment")
            for d, i in enumerate(lead):
                k *= _key(int(i), lane, f"dim{d}")
            shift = 8 * place if lane == 0 else 8 * (7 - place)
            lanes[lane] = (lanes[lane] + (b << shift) * k) & MASK
    header = f"{ALGORITHM}|{name}|{','.join(map(str, shape))}"
    mask = int.from_bytes(hashlib.sha256(header.encode()).digest()[:16], "little")
    return ((lanes[0] | lanes[1] << 64) ^ mask).to_bytes(16, "little").hex()


# ================================================================================ definition


@settings(deadline=None, max_examples=80)
@given(data=st.data())
def test_matches_the_bytewise_definition(data):
    name, shape, raw = tensor(data.draw, max_elements=40)
    assert whole(name, shape, raw) == reference_hexdigest(name, shape, raw)
    with small_segments():
        assert fingerprint_array(name, as_array(name, shape, raw)) == reference_hexdigest(name, shape, raw, 4)


@pytest.mark.parametrize("name, shape", [("Float64", (37,)), ("Float16", (3, 21)), ("UInt8", (2, 1, 3, 45)),
                                         ("Complex128", (5, 1)), ("Int32", ())])
@pytest.mark.parametrize("chunk", [24, 1 << 20])
def test_matches_the_definition_across_segments(name, shape, chunk):
    """Rows over many (shrunk) column segments: the folded long-row path and the segment loop."""
    raw = bytes(np.random.default_rng(5).integers(0, 256, prod(shape) * dtypes.lookup(name).itemsize, dtype=np.uint8))
    with small_segments(chunk=chunk):
        want = reference_hexdigest(name, shape, raw, 4)
        assert whole(name, shape, raw) == want
        got = Fingerprint(name, shape)
        for a in range(0, len(raw), 13):
            got.add_run(a, raw[a:a + 13])
        assert got.hexdigest() == want


def test_golden_digests_pin_the_algorithm():
    """Any change of these values is a new algorithm: bump the version in ALGORITHM."""
    assert ALGORITHM == "poslin64x2-v1"
    long = (np.arange(65552) % 251).astype(np.uint8)  # crosses a 2^13-word column segment
    got = [fingerprint_array("Float32", np.arange(12, dtype=np.float32).reshape(3, 4)),
           fingerprint_array("BFloat16", dtypes.float32_to_bf16(np.linspace(-1, 1, 10, dtype=np.float32))),
           fingerprint_array("Int8", np.zeros((2, 3, 1), dtype=np.int8)),
           fingerprint_array("UInt8", long),
           Fingerprint(OPAQUE, (6,), nbytes=3).add_run(0, b"\x12\x34\x56").hexdigest()]
    assert got[:4] == [reference_hexdigest("Float32", (3, 4), np.arange(12, dtype=np.float32).tobytes()),
                       reference_hexdigest("BFloat16", (10,), dtypes.float32_to_bf16(
                           np.linspace(-1, 1, 10, dtype=np.float32)).tobytes()),
                       reference_hexdigest("Int8", (2, 3, 1), bytes(6)),
                       reference_hexdigest("UInt8", long.shape, long.tobytes())]
    assert got == ["87bf9acc599b92bdac09cef8ae3c8711", "50506228c80f6d0f415da7fc6784947d",
                   "2ee060b360f568ae431083b995f6b2c1", "ee3aff56658b29633b9da7e3bc9b2ef4",
                   "a64036c8c988876aa284072903589784"]


# ================================================================================ layout independence


@SETTINGS
@given(data=st.data())
def test_any_box_partition_in_any_order_equals_the_whole(data):
    name, shape, raw = tensor(data.draw)
    array, want = as_array(name, shape, raw), whole(name, shape, raw)
    boxes = data.draw(partitions(shape))
    kind = data.draw(st.sampled_from(["array", "bytes", "memoryview"]))
    got = Fingerprint(name, shape)
    for box in boxes:
        got.add_box(box, box_data(array, box, kind))
    assert got.complete and got.hexdigest() == want
    with small_segments():
        got, want = Fingerprint(name, shape), whole(name, shape, raw)
        for box in reversed(boxes):
            got.add_box(box, box_data(array, box, kind))
        assert got.hexdigest() == want


@SETTINGS
@given(data=st.data())
def test_byte_runs_cut_anywhere_in_any_order_equal_the_whole(data):
    """Runs start and stop mid-element and mid-word and cross rows, as a reader's buffers do."""
    name, shape, raw = tensor(data.draw)
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(raw)), max_size=8))) | {0, len(raw)})
    runs = data.draw(st.permutations(list(zip(cuts, cuts[1:]))))
    for shrink in (False, True):
        with small_segments() if shrink else _nothing():
            want, got = whole(name, shape, raw), Fingerprint(name, shape)
            for a, b in runs:
                got.add_run(a, memoryview(raw)[a:b] if (a + b) % 2 else np.frombuffer(raw[a:b], np.uint8))
            assert got.hexdigest() == want


@contextmanager
def _nothing():
    yield


@SETTINGS
@given(data=st.data())
def test_boxes_read_in_byte_ranges_equal_the_whole(data):
    """A rank's shard read in ranged pieces (cut mid-element), pieces of all shards interleaved."""
    name, shape, raw = tensor(data.draw)
    array, want = as_array(name, shape, raw), whole(name, shape, raw)
    pieces = []
    for box in data.draw(partitions(shape)):
        blob = box_data(array, box, "bytes")
        cuts = sorted(set(data.draw(st.lists(st.integers(0, len(blob)), max_size=3))) | {0, len(blob)})
        pieces += [(box, a, blob[a:b]) for a, b in zip(cuts, cuts[1:])]
    got = Fingerprint(name, shape)
    for box, offset, piece in data.draw(st.permutations(pieces)):
        got.add_box_run(box, offset, piece)
    assert got.complete and got.hexdigest() == want


@SETTINGS
@given(data=st.data())
def test_parts_on_several_ranks_merge_to_the_whole(data):
    """Each rank (or pipeline stage, or worker process) fingerprints its disjoint part, as boxes or
    as runs of its bytes; the parts travel pickled and merge in any order."""
    name, shape, raw = tensor(data.draw)
    array, want = as_array(name, shape, raw), whole(name, shape, raw)
    boxes = data.draw(partitions(shape))
    ranks = data.draw(st.integers(1, 4))
    parts = [Fingerprint(name, shape) for _ in range(ranks)]
    for i, box in enumerate(boxes):
        rank = data.draw(st.integers(0, ranks - 1), label=f"rank of box {i}")
        parts[rank].add_box(box, box_data(array, box, "array"))
    parts = [pickle.loads(pickle.dumps(p)) for p in data.draw(st.permutations(parts))]
    first = (parts[0].fed, parts[0].hexdigest(partial=True))
    merged = parts[0].copy()
    for part in parts[1:]:
        merged.merge(part)
    assert merged.complete and merged.hexdigest() == want
    assert (parts[0].fed, parts[0].hexdigest(partial=True)) == first  # the copy was merged, not the part


@settings(deadline=None, max_examples=60)
@given(case=layout_and_shape(), name=st.sampled_from(["Float32", "BFloat16", "Int8", "Complex128"]),
       seed=st.integers(0, 2**32 - 1))
def test_unique_boxes_of_a_mindspore_layout_give_the_whole(case, name, seed):
    """The caller's side: every rank's box of a real layout, replicas dropped, fed as ranks list them."""
    pl, shape = case
    layout = Layout.from_recorded(pl, len(shape))
    array = np.random.default_rng(seed).integers(0, 256, prod(shape) * dtypes.lookup(name).itemsize, dtype=np.uint8)
    array = array.view(dtypes.lookup(name).storage).reshape(shape)
    got, seen = Fingerprint(name, shape), set()
    for q in range(layout.devices):
        box = layout.box(q, shape)
        if box not in seen:
            seen.add(box)
            got.add_box(box, array[tuple(slice(a, b) for a, b in box)])
    assert got.complete and got.hexdigest() == fingerprint_array(name, array)


def test_long_rows_cross_segments_and_steps():
    """A 1-D tensor over many 64 KiB column segments and 1 MiB steps, cut at odd offsets; and a
    2-D one whose rows are longer than a step, cut into boxes along its last axis."""
    rng = np.random.default_rng(7)
    flat = rng.integers(0, 256, (3 << 19) + 5, dtype=np.uint8)
    want = fingerprint_array("UInt8", flat)
    got = Fingerprint("UInt8", flat.shape)
    cuts = [0, 3, 524_291, 524_292, 1_048_583, flat.size]
    for a, b in reversed(list(zip(cuts, cuts[1:]))):
        got.add_run(a, flat[a:b])
    assert got.hexdigest() == want
    rows = rng.standard_normal((3, (1 << 18) + 3)).astype(np.float32)
    got = Fingerprint("Float32", rows.shape)
    for box in [((0, 3), (0, 1001)), ((0, 2), (1001, rows.shape[1])), ((2, 3), (1001, rows.shape[1]))]:
        got.add_box(box, rows[box[0][0]:box[0][1], box[1][0]:box[1][1]])
    assert got.hexdigest() == fingerprint_array("Float32", rows) == whole("Float32", rows.shape, rows.tobytes())


# ================================================================================ sensitivity


@settings(deadline=None, max_examples=150)
@given(data=st.data())
def test_flipping_any_one_bit_changes_it(data):
    name, shape, raw = tensor(data.draw)
    if not raw:
        return
    bit = data.draw(st.integers(0, 8 * len(raw) - 1))
    flipped = bytearray(raw)
    flipped[bit // 8] ^= 1 << (bit % 8)
    assert whole(name, shape, bytes(flipped)) != whole(name, shape, raw)


def test_every_single_bit_of_a_word_grid_is_seen():
    """Exhaustively, for a tensor with padded rows and both ends of its words: every bit, one at a time."""
    raw = bytes(np.random.default_rng(3).integers(0, 256, 3 * 5 * 2, dtype=np.uint8))
    base = whole("Float16", (3, 5), raw)
    seen = set()
    for bit in range(8 * len(raw)):
        flipped = bytearray(raw)
        flipped[bit // 8] ^= 1 << (bit % 8)
        seen.add(whole("Float16", (3, 5), bytes(flipped)))
    assert base not in seen and len(seen) == 8 * len(raw)


@settings(deadline=None, max_examples=60)
@given(data=st.data())
def test_dtype_or_shape_change_changes_it(data):
    name, shape, raw = tensor(data.draw)
    size = dtypes.lookup(name).itemsize
    others = [n for n in DTYPES if n != name and dtypes.lookup(n).itemsize == size]
    base = whole(name, shape, raw)
    for other in others:
        assert whole(other, shape, raw) != base
    for reshaped in {(prod(shape),), shape + (1,), tuple(reversed(shape)), (1,) + shape} - {shape}:
        assert whole(name, reshaped, raw) != base


@pytest.mark.parametrize("case", ["swap blocks", "swap x and -x", "two sign bits", "zero a run", "shift a row"])
def test_structured_errors_are_seen(case):
    """Errors a Z/2^64 hash of little-endian words alone would miss (sign bits in the words' top
    bit), and resharding mistakes: blocks in each other's place, zeroed or shifted data."""
    rng = np.random.default_rng(11)
    good = rng.standard_normal((8, 16)).astype(np.float64)
    bad = good.copy()
    if case == "swap blocks":
        bad[:4, :8], bad[4:, 8:] = good[4:, 8:], good[:4, :8]
    elif case == "swap x and -x":  # the two words differ only in their top bit
        good[5, 7] = -good[1, 2]
        bad[1, 2], bad[5, 7] = good[5, 7], good[1, 2]
    elif case == "two sign bits":
        bad[0, 0], bad[3, 9] = -good[0, 0], -good[3, 9]
    elif case == "zero a run":
        bad.reshape(-1)[13:40] = 0
    else:
        bad[2] = np.roll(good[2], 1)
    assert fingerprint_array("Float64", bad) != fingerprint_array("Float64", good)


# ================================================================================ API


def test_formats_and_byte_orders_agree():
    words = dtypes.float32_to_bf16(np.linspace(-3, 3, 24, dtype=np.float32)).reshape(4, 6)
    want = fingerprint_array("BFloat16", words)
    assert fingerprint_array("BF16", words) == want
    assert fingerprint_array(dtypes.lookup("BFloat16"), words.astype(">u2")) == want
    assert Fingerprint("BFloat16", (4, 6)).add_run(0, words.tobytes()).hexdigest() == want
    assert fingerprint_array("Float32", np.zeros((2, 1, 1), np.float32)) == fingerprint_array(
        "Float32", np.zeros((2, 1, 1), np.float32).reshape(2, 1, 1))


def test_misuse_is_refused():
    f = Fingerprint("Float32", (4, 4))
    with pytest.raises(ValueError):
        f.add_box(((0, 5), (0, 4)), bytes(80))
    with pytest.raises(ValueError):
        f.add_box(((0, 2), (0, 4)), bytes(31))
    with pytest.raises(ValueError):
        f.add_box(((0, 2), (0, 4)), np.zeros((2, 4), np.float64))
    with pytest.raises(ValueError):
        f.add_run(60, bytes(8))
    with pytest.raises(ValueError):
        f.add_box_run(((0, 2), (0, 2)), 14, bytes(3))
    f.add_run(0, bytes(32))
    with pytest.raises(ValueError, match="fed 32 of 64"):
        f.hexdigest()
    assert len(f.hexdigest(partial=True)) == 32 and not f.complete
    with pytest.raises(ValueError):
        f.merge(Fingerprint("Float32", (16,)))
    with pytest.raises(ValueError):
        Fingerprint(OPAQUE, (8,))
    with pytest.raises(ValueError):
        Fingerprint(OPAQUE, (8,), nbytes=4).add_box(((0, 8),), bytes(4))
    with pytest.raises(ValueError):
        Fingerprint("Float99", (2,))
