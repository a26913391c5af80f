"""The compiled fingerprint kernel and numpy's give the same bits (`reshard_job.core.fingerprint_kernel`).

Both kernels run in this process (``forced``): the row sums of every kind of row (any phase, any
width, rows at a stride, reversed, rows crossing column segments) against a plain-integer reference
of the definition, and whole digests of random tensors fed whole, as boxes and as runs cut anywhere,
compared kernel against kernel. Where the extension is not built, the numpy half still runs and the
compiled half is skipped, saying why.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from math import prod
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reshard_job.core.dtypes as dtypes
import reshard_job.core.fingerprint as fp
from reshard_job.core import fingerprint_kernel as kernel
from reshard_job.core.fingerprint import Fingerprint, fingerprint_array
from reshard_job.core.fingerprint_batch import WholeTensorBatch
from fingerprint_segments import small_segments  # tests/ is on sys.path through its conftest

NOT_BUILT = "the compiled fingerprint kernel is not built (no C compiler at install time): numpy half only"
needs_compiled = pytest.mark.skipif(not kernel.available(), reason=NOT_BUILT)
KERNELS = ["numpy", pytest.param("compiled", marks=needs_compiled)]
DTYPES = sorted(name for name, d in dtypes.BY_NAME.items() if d.sliceable)
SETTINGS = settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
MASK = (1 << 64) - 1
S = fp.SEGMENT
REPO = Path(__file__).parents[3]


# ================================================================================ helpers


def on_both(compute):
    """`compute()` under each kernel: (numpy's result, the compiled kernel's)."""
    with kernel.forced("numpy"):
        want = compute()
    with kernel.forced("compiled"):
        return want, compute()


def assert_kernels_agree(compute) -> None:
    """Both kernels give the same `compute()`, at the real segment size and at a shrunk one."""
    want, got = on_both(compute)
    assert got == want
    with small_segments():
        want, got = on_both(compute)
        assert got == want


def reference_row_sums(rows: np.ndarray, start: int) -> list[list[int]]:
    """Each lane's ``sum_t word(i, t) * A[(c0+t) mod S] * G((c0+t) div S)`` in Python integers, the
    words zero-padded at the row's phase; lane 2 reads each word big-endian."""
    segment, phase, c0 = fp.SEGMENT, start % 8, start // 8
    sums = [[], []]
    for lane in (0, 1):
        table, segments = [int(k) for k in fp._column_table(lane)], {}
        for row in rows:
            data = bytes(phase) + row.tobytes()
            data += bytes(-len(data) % 8)
            y = 0
            for t in range(len(data) // 8):
                c = c0 + t
                word = int.from_bytes(data[8 * t:8 * t + 8], "little" if lane == 0 else "big")
                g = c // segment
                if g not in segments:
                    segments[g] = int(fp._odd_keys(g, g + 1, lane, "segment")[0])
                y += word * table[c % segment] * segments[g]
            sums[lane].append(y & MASK)
    return sums


@st.composite
def byte_rows(draw, max_width=40):
    """(rows, start): a 2-D uint8 view, rows at a stride, bytes contiguous; start anywhere, often
    just before a column segment's end so that the rows cross into the next segment."""
    count, width = draw(st.integers(0, 4)), draw(st.integers(0, max_width))
    gap, offset = draw(st.integers(0, 9)), draw(st.integers(0, 7))
    pool = np.frombuffer(draw(st.binary(min_size=(count + 1) * (width + gap) + 8, max_size=(count + 1) * (width + gap) + 8)),
                         np.uint8)
    rows = np.lib.stride_tricks.as_strided(pool[offset:], (count, width), (width + gap, 1))
    if draw(st.booleans()):
        rows = rows[::-1]  # a negative stride
    near_end = 8 * fp.SEGMENT - draw(st.integers(0, 48))
    start = draw(st.one_of(st.integers(0, 64), st.integers(0, 3 * 8 * fp.SEGMENT), st.just(max(0, near_end))))
    return rows, start


@st.composite
def tensor(draw, max_elements=300):
    """(dtype, shape, raw bytes): 0-4 dims with some 1s, sometimes a zero extent."""
    name = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.sampled_from([1, 2, 3, 5, 7, 8, 9, 13, 17]), max_size=4)))
    while prod(shape) > max_elements:
        shape = shape[1:]
    if shape and draw(st.integers(0, 15)) == 0:
        shape = shape[:-1] + (0,)
    nbytes = prod(shape) * dtypes.lookup(name).itemsize
    return name, shape, draw(st.binary(min_size=nbytes, max_size=nbytes))


@st.composite
def partition(draw, shape):
    """Boxes tiling `shape`, each axis cut at random points, in a random order."""
    edges = [sorted({0, n} | set(draw(st.lists(st.integers(0, n), max_size=3)))) for n in shape]
    boxes = [()]
    for axis_edges in edges:
        boxes = [b + ((lo, hi),) for b in boxes for lo, hi in zip(axis_edges, axis_edges[1:])]
    return draw(st.permutations(boxes))


def as_array(name, shape, raw):
    return np.frombuffer(raw, dtype=dtypes.lookup(name).storage).reshape(shape)


# ================================================================================ row sums


@pytest.mark.parametrize("which", KERNELS)
@SETTINGS
@given(case=byte_rows())
def test_row_sums_follow_the_definition(which, case):
    rows, start = case
    with kernel.forced(which):
        got = fp._row_sums(rows, start)
    assert [y.tolist() for y in got] == reference_row_sums(rows, start)


@pytest.mark.parametrize("which", KERNELS)
@settings(deadline=None, max_examples=40)
@given(case=byte_rows(max_width=90))
def test_row_sums_over_many_small_segments(which, case):
    """Segments of 4 words: a row of 90 bytes crosses up to 4 of them, at every phase."""
    with small_segments():
        rows, start = case
        with kernel.forced(which):
            got = fp._row_sums(rows, start)
        assert [y.tolist() for y in got] == reference_row_sums(rows, start)


@pytest.mark.parametrize("which", KERNELS)
@pytest.mark.parametrize("start", [0, 5, 8 * (S - 1) + 3, 8 * S - 8, 8 * (2 * S) + 1])
def test_long_rows_cross_real_segments(which, start):
    """Rows of more than two 8192-word segments (numpy folds such a lone row into one matmul)."""
    rng = np.random.default_rng(start)
    for rows in (rng.integers(0, 256, (1, 2 * 8 * S + 77), dtype=np.uint8),
                 rng.integers(0, 256, (3, 8 * S + 13), dtype=np.uint8)[:, 1:]):  # a row stride of its own
        with kernel.forced(which):
            got = fp._row_sums(rows, start)
        assert [y.tolist() for y in got] == reference_row_sums(rows, start)


@needs_compiled
def test_every_instruction_set_gives_the_same_bits():
    """The loops are compiled for AVX-512, AVX2 and the baseline; each one this CPU runs must give
    the definition's sums (the best is used; the others serve other CPUs)."""
    from reshard_job.core import _fingerprint_c

    rng = np.random.default_rng(8)
    cases = [(rng.integers(0, 256, (3, 8 * S + 45), dtype=np.uint8)[:, 2:], 8 * (S - 20) + 5),  # long, phased
             (rng.integers(0, 256, (50, 12), dtype=np.uint8), 0), (rng.integers(0, 256, (4, 200), dtype=np.uint8), 3)]
    want = [reference_row_sums(rows, start) for rows, start in cases]
    keys = fp._odd_keys(0, 1000, 1, "dim0").tolist()
    best = _fingerprint_c.variant()
    assert best == _fingerprint_c.variants()[0] and "baseline" in _fingerprint_c.variants()
    try:
        for name in _fingerprint_c.variants():
            _fingerprint_c.use_variant(name)
            with kernel.forced("compiled"):
                assert [[y.tolist() for y in fp._row_sums(rows, start)] for rows, start in cases] == want, name
                assert fp._odd_keys(0, 1000, 1, "dim0").tolist() == keys, name
    finally:
        _fingerprint_c.use_variant(best)


@needs_compiled
def test_rows_with_scattered_bytes_are_packed_first():
    """Bytes apart within a row (a column of a wider array): the kernel reads them packed."""
    wide = np.random.default_rng(2).integers(0, 256, (5, 24), dtype=np.uint8)
    rows = wide[:, ::3]
    want, got = on_both(lambda: [y.tolist() for y in fp._row_sums(rows, 3)])
    assert got == want == reference_row_sums(np.ascontiguousarray(rows), 3)


@needs_compiled
@settings(deadline=None, max_examples=40)
@given(lo=st.one_of(st.integers(0, 1 << 20), st.integers(0, (1 << 64) - 5000)), n=st.integers(0, 3000),
       lane=st.sampled_from([0, 1]), purpose=st.sampled_from(["col", "segment", "dim0", "dim3"]))
def test_keys_of_long_ranges_alike(lo, n, lane, purpose):
    """A tall tensor's row keys come from the C loop: the same odd keys as numpy's mixer."""
    want, got = on_both(lambda: fp._odd_keys(lo, lo + n, lane, purpose).tolist())
    assert got == want and all(k & 1 for k in got)


# ================================================================================ digests


@needs_compiled
@SETTINGS
@given(case=tensor())
def test_whole_tensors_digest_alike(case):
    name, shape, raw = case
    array = as_array(name, shape, raw)
    want, got = on_both(lambda: (fingerprint_array(name, array), Fingerprint(name, shape).add_run(0, raw).hexdigest()))
    assert got == want and want[0] == want[1]


@needs_compiled
@SETTINGS
@given(data=st.data())
def test_boxes_in_any_order_digest_alike(data):
    name, shape, raw = data.draw(tensor())
    array, boxes = as_array(name, shape, raw), data.draw(partition(shape))

    def fed():
        got = Fingerprint(name, shape)
        for box in boxes:
            got.add_box(box, array[tuple(slice(a, b) for a, b in box)])
        return got.hexdigest()

    assert_kernels_agree(fed)


@needs_compiled
@SETTINGS
@given(data=st.data())
def test_runs_cut_anywhere_digest_alike(data):
    """Runs and ranged reads of boxes that start and stop mid-element and mid-word (every phase)."""
    name, shape, raw = data.draw(tensor())
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(raw)), max_size=8))) | {0, len(raw)})
    runs = data.draw(st.permutations(list(zip(cuts, cuts[1:]))))
    box = tuple((0, n) for n in shape)

    def fed():
        got, ranged = Fingerprint(name, shape), Fingerprint(name, shape)
        for a, b in runs:
            got.add_run(a, memoryview(raw)[a:b])
            if shape and 0 not in shape:
                ranged.add_box_run(box, a, np.frombuffer(raw[a:b], np.uint8))
        return got.hexdigest(), ranged.hexdigest(partial=True)

    assert_kernels_agree(fed)


@needs_compiled
@settings(deadline=None, max_examples=25)
@given(data=st.data())
def test_boxes_across_real_segments_digest_alike(data):
    """Float64 rows of 8192 + a few words, boxes cut along them near the segment boundary."""
    columns = S + data.draw(st.integers(1, 40))
    array = np.random.default_rng(data.draw(st.integers(0, 99))).standard_normal((3, columns))
    points = data.draw(st.lists(st.integers(S - 40, columns - 1), min_size=1, max_size=3))
    edges = sorted({0, columns, *points})
    row_cut = data.draw(st.integers(1, 2))

    def fed():
        got = Fingerprint("Float64", array.shape)
        for rows in ((0, row_cut), (row_cut, 3)):
            for lo, hi in zip(edges, edges[1:]):
                got.add_box((rows, (lo, hi)), array[rows[0]:rows[1], lo:hi])
        return got.hexdigest()

    want, got = on_both(fed)
    assert got == want == fingerprint_array("Float64", array)


@needs_compiled
def test_long_steps_and_narrow_rows_digest_alike():
    """Boxes of more than one step (cut into pieces along rows and along a long row) and rows of a
    few bytes (many rows, each a partial word)."""
    rng = np.random.default_rng(4)
    cases = [("Float32", rng.standard_normal((40, 70_000)).astype(np.float32)),
             ("Int8", rng.integers(-128, 127, (3, (1 << 22) + 9), dtype=np.int8)),
             ("Float16", rng.standard_normal((200_001, 3)).astype(np.float16)),
             ("UInt8", rng.integers(0, 255, (5 << 20) + 3, dtype=np.uint8))]
    for name, array in cases:
        want, got = on_both(lambda: fingerprint_array(name, array))
        assert got == want, name


@needs_compiled
def test_empty_inputs_digest_alike():
    for shape in [(0,), (4, 0), (0, 3, 2), ()]:
        array = np.zeros(shape, np.float32)
        want, got = on_both(lambda: fingerprint_array("Float32", array))
        assert got == want, shape
    for rows in (np.zeros((0, 16), np.uint8), np.zeros((3, 0), np.uint8)):
        with kernel.forced("compiled"):
            assert [y.tolist() for y in fp._row_sums(rows, 11)] == [[0] * rows.shape[0]] * 2


@needs_compiled
@settings(deadline=None, max_examples=30)
@given(cases=st.lists(tensor(max_elements=60), min_size=1, max_size=6))
def test_whole_tensor_batches_digest_alike(cases):
    def batched():
        digests = {}
        batch = WholeTensorBatch(digests)
        for i, (name, shape, raw) in enumerate(cases):
            batch.add(f"p{i}", name, shape, raw)
            batch.add(f"q{i}", name, shape, raw[::-1])  # a second tensor of the same shape and dtype
        batch.flush()
        return digests

    want, got = on_both(batched)
    assert got == want
    assert [got[f"p{i}"] for i in range(len(cases))] == [
        Fingerprint(name, shape).add_run(0, raw).hexdigest() for name, shape, raw in cases]


@needs_compiled
def test_threads_hash_alike():
    """The job fingerprints in threads (the kernel runs without the GIL): same digests as alone."""
    rng = np.random.default_rng(6)
    arrays = [rng.standard_normal((64, 4096 + i)).astype(np.float32) for i in range(8)]
    with kernel.forced("compiled"):
        alone = [fingerprint_array("Float32", a) for a in arrays]
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(lambda a: fingerprint_array("Float32", a), arrays)) == alone
    with kernel.forced("numpy"):
        assert [fingerprint_array("Float32", a) for a in arrays] == alone


# ================================================================================ choice and misuse


def test_the_environment_forces_numpy():
    script = "from reshard_job.core import fingerprint_kernel as k; print(k.active(), k.available())"
    env = {**os.environ, "PYTHONPATH": str(REPO), kernel.ENV: "numpy"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["numpy", str(kernel.available())]
    env.pop(kernel.ENV)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split()[0] == ("compiled" if kernel.available() else "numpy")


def test_forcing_an_unknown_or_missing_kernel_is_refused():
    with pytest.raises(ValueError, match="unknown fingerprint kernel"):
        with kernel.forced("fortran"):
            pass
    if not kernel.available():
        with pytest.raises(RuntimeError, match="not built"):
            with kernel.forced("compiled"):
                pass


@needs_compiled
def test_the_compiled_call_refuses_bad_buffers():
    from reshard_job.core import _fingerprint_c as c

    cols = [fp._column_table(lane) for lane in (0, 1)]
    keys = [fp._odd_keys(0, 1, lane, "segment") for lane in (0, 1)]
    out = np.zeros((2, 2), np.uint64)
    rows = np.zeros((2, 8), np.uint8)
    with pytest.raises(ValueError, match="2-D byte buffer"):
        c.row_sums(np.zeros(16, np.uint8), 0, 0, *cols, *keys, out[0], out[1])
    with pytest.raises(ValueError, match="phase"):
        c.row_sums(rows, 8, 0, *cols, *keys, out[0], out[1])
    with pytest.raises(ValueError, match="segment keys"):
        c.row_sums(np.zeros((2, 16), np.uint8), 0, S - 1, *cols, *keys, out[0], out[1])  # into a segment with no key
    with pytest.raises(ValueError, match="outputs"):
        c.row_sums(rows, 0, 0, *cols, *keys, out[0, :1], out[1])
    with pytest.raises(ValueError, match="aligned"):
        c.row_sums(rows, 0, 0, bytes(12), cols[1], *keys, out[0], out[1])
    with pytest.raises(BufferError):
        c.row_sums(rows, 0, 0, *cols, *keys, bytes(16), out[1])  # read-only output
    with pytest.raises(ValueError, match="not compiled in"):
        c.use_variant("sse9")


def test_a_numpy_scalar_is_fingerprinted_as_its_0d_array():
    """An ``ml_dtypes.bfloat16`` scalar exports no buffer ("NumPy scalar 1.5 can only exported as a
    buffer without format"): it is taken as the 0-d array it stands for, as a float32 scalar was."""
    import ml_dtypes

    for dtype, scalar in (("BFloat16", ml_dtypes.bfloat16(1.5)), ("Float32", np.float32(1.5))):
        assert fingerprint_array(dtype, scalar) == fingerprint_array(dtype, np.asarray(scalar))
    one, two = (fingerprint_array("BFloat16", ml_dtypes.bfloat16(v)) for v in (1.5, 2))
    assert one != two
