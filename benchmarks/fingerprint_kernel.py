"""CPU cost of the parameter fingerprint (`reshard_job.core.fingerprint`), in CPU-seconds per GB.

Budget (issue "parameter fingerprints"): <= 0.25 CPU-s/GB, one thread. Two kernels compute it
(`reshard_job.core.fingerprint_kernel`): the compiled extension, built at install time when a C
compiler is there (both lanes in one pass over the bytes), and numpy (one uint64 matmul pass a
lane); every case runs under each, in one process, on the same bytes. The machine may be shared
and loaded, so every run also times baselines on those bytes: ``hashlib.sha256``, ``numpy.sum``
(of the bytes as uint64: one memory-bound pass), numpy's floor (one uint64 matmul pass, ``X @
keys``, what one lane costs it at least) and the compiled kernel's bare pass (both lanes, rows of
32 KiB, no Python around it). Each case is timed with ``time.process_time`` (this process's user +
sys CPU), median of ``--runs`` runs, cases interleaved run by run so that drifting load hits them
alike. Two more rows show where numpy's time goes: its two bare matmul passes (little- and
big-endian reading of the words, no padding, keys or bookkeeping), and two little-endian passes,
the cost of the weaker design that reads words one way only (see the module docstring for why it
was rejected).

Cases, on ``--size-mib`` MiB (default 256) of float32 and of bfloat16 (raw uint16 words), each
under both kernels:

- ``whole``: one ``add_box`` of the whole (rows of 32 KiB);
- ``boxes``: an uneven 3 x 5 grid of boxes (dims 0 and 1 cut at uneven points), fed out of
  order from contiguous per-box arrays prepared before timing (as a reader hands them over);
- ``runs``: ``add_run`` of ~4 MiB runs cut at odd byte offsets (mid-element, mid-word: the padded
  path), in reverse order;
- ``1-D``: the same bytes as one 1-D tensor (one long row, the folded path);
- per-tensor overhead and narrow rows, for the record: 20 000 tensors of 1 KiB, and an
  (N, 3) float32 tensor of 48 MiB (12-byte rows).

Without the extension (or with ``RESHARD_JOB_FINGERPRINT_KERNEL=numpy``) only numpy's rows appear.

Usage::

    python benchmarks/fingerprint_kernel.py --size-mib 256 --runs 5
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import statistics
import sys
import time

import numpy as np

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from reshard_job.core import dtypes  # noqa: E402
from reshard_job.core import fingerprint_kernel as kernel  # noqa: E402
from reshard_job.core.fingerprint import ALGORITHM, Fingerprint, _column_table, _odd_keys, fingerprint_array  # noqa: E402

ROW_BYTES = 32 << 10


def _cpu(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def _kernels() -> list[str]:
    return ["compiled", "numpy"] if kernel.active() == "compiled" else ["numpy"]


def _under(which: str, fn):
    """`fn` run under kernel `which`."""
    def run():
        with kernel.forced(which):
            return fn()
    return run


def _bare_compiled_pass(words: np.ndarray):
    """The compiled kernel alone over rows of 32 KiB: both lanes, one pass, no Python around it."""
    from reshard_job.core import _fingerprint_c

    rows = words.view(np.uint8)
    columns = [_column_table(lane) for lane in (0, 1)]
    segments = [_odd_keys(0, 1, lane, "segment") for lane in (0, 1)]
    out = np.empty((2, rows.shape[0]), np.uint64)
    return lambda: _fingerprint_c.row_sums(rows, 0, 0, *columns, *segments, out[0], out[1])


def _uneven(n: int, parts: int) -> list[int]:
    """Cut points of [0, n) into `parts` uneven pieces (roughly 1 : 2 : 3 ...)."""
    weights = np.arange(1, parts + 1)
    return [0] + [int(n * w) for w in np.cumsum(weights)[:-1] / weights.sum()] + [n]


def _cases(name: str, array: np.ndarray) -> dict:
    """The timed callables of one dtype, each fingerprinting the same bytes a different way."""
    shape, raw = array.shape, array.reshape(-1).view(np.uint8)
    rows, cols = _uneven(shape[0], 3), _uneven(shape[1], 5)
    boxes = [((a, b), (c, d)) for a, b in zip(rows, rows[1:]) for c, d in zip(cols, cols[1:])][::-1]
    parts = [np.ascontiguousarray(array[a:b, c:d]) for (a, b), (c, d) in boxes]
    cuts = list(range(0, raw.size, (4 << 20) + 3)) + [raw.size]
    runs = list(zip(cuts, cuts[1:]))[::-1]

    def fed_boxes():
        fp = Fingerprint(name, shape)
        for box, part in zip(boxes, parts):
            fp.add_box(box, part)
        return fp.hexdigest()

    def fed_runs():
        fp = Fingerprint(name, shape)
        for a, b in runs:
            fp.add_run(a, raw[a:b])
        return fp.hexdigest()

    whole = fingerprint_array(name, array)
    for which in _kernels():
        with kernel.forced(which):
            assert fed_boxes() == fed_runs() == whole == fingerprint_array(name, array), f"{which}: fingerprints disagree"
    words = raw.view(np.uint64).reshape(-1, ROW_BYTES // 8)
    keys = _column_table(0)[:ROW_BYTES // 8]
    step = (1 << 20) // ROW_BYTES

    def two_passes(second: str):
        for a in range(0, words.shape[0], step):
            words[a:a + step] @ keys
            words[a:a + step].view(second) @ keys

    cases = {}
    for which in _kernels():
        cases.update({
            f"{which}: {name} whole": _under(which, lambda: fingerprint_array(name, array)),
            f"{which}: {name} boxes (3x5 uneven)": _under(which, fed_boxes),
            f"{which}: {name} runs (4 MiB, odd cuts)": _under(which, fed_runs),
            f"{which}: {name} 1-D": _under(which, lambda: fingerprint_array(name, array.reshape(-1))),
        })
    if kernel.active() == "compiled":
        cases[f"floor: compiled kernel alone, both lanes, one pass ({name} bytes)"] = _bare_compiled_pass(words)
    return {
        **cases,
        f"baseline sha256 ({name} bytes)": lambda: hashlib.sha256(raw).digest(),
        f"baseline numpy.sum ({name} bytes)": lambda: words.sum(),
        f"floor: one uint64 matmul pass ({name} bytes)": lambda: words @ keys,
        f"floor: two passes, LE + BE words, 1 MiB steps ({name} bytes)": lambda: two_passes(">u8"),
        f"two LE passes (LE-only design, rejected) ({name} bytes)": lambda: two_passes("<u8"),
    }


def _small_cases() -> dict:
    small = [np.full(256, i, dtype=np.float32) for i in range(20_000)]
    narrow = np.random.default_rng(1).standard_normal(((48 << 20) // 12, 3)).astype(np.float32)
    cases = {}
    for which in _kernels():
        cases[f"{which}: 20 000 tensors of 1 KiB (per tensor)"] = (
            _under(which, lambda: [fingerprint_array("Float32", a) for a in small]), 20_000)
        cases[f"{which}: narrow rows (N, 3) float32, 48 MiB"] = (
            _under(which, lambda: fingerprint_array("Float32", narrow)), narrow.nbytes)
    return cases


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=256, help="MiB of data per dtype (default 256)")
    ap.add_argument("--runs", type=int, default=3, help="runs per case; the median is reported (>= 3)")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    n = (args.size_mib << 20) // ROW_BYTES
    f32 = rng.standard_normal((n, ROW_BYTES // 4), dtype=np.float32)
    bf16 = dtypes.float32_to_bf16(rng.standard_normal((n, ROW_BYTES // 2), dtype=np.float32))
    cases = {**_cases("Float32", f32), **_cases("BFloat16", bf16)}
    small = _small_cases()
    load0 = os.getloadavg()
    times: dict[str, list[float]] = {k: [] for k in [*cases, *small]}
    for _ in range(max(3, args.runs)):
        for key, fn in cases.items():
            times[key].append(_cpu(fn))
        for key, (fn, _) in small.items():
            times[key].append(_cpu(fn))
    _report(args, cases, small, times, f32.nbytes, load0)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def _report(args, cases, small, times, nbytes, load0) -> None:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    runs = len(next(iter(times.values())))
    print(f"# fingerprint kernel ({ALGORITHM}): CPU-seconds per GB (10^9 bytes)\n")
    print(f"{cores} cores usable (os.cpu_count() = {os.cpu_count()}), one thread; {_cpu_model()}; "
          f"Python {platform.python_version()}, numpy {np.__version__}; kernel {kernel.describe()}; "
          f"{nbytes / 2**20:.0f} MiB per dtype; "
          f"median of {runs} runs (min, max); load average {load0[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end\n")
    print("| case | CPU-s/GB | min | max |\n|---|---:|---:|---:|")
    for key in cases:
        t = [x / nbytes * 1e9 for x in times[key]]
        print(f"| {key} | {statistics.median(t):.3f} | {min(t):.3f} | {max(t):.3f} |")
    print("\n| other | median | min | max |\n|---|---:|---:|---:|")
    for key, (_, scale) in small.items():
        if "per tensor" in key:
            t = [x / scale * 1e6 for x in times[key]]
            print(f"| {key} | {statistics.median(t):.1f} µs | {min(t):.1f} | {max(t):.1f} |")
        else:
            t = [x / scale * 1e9 for x in times[key]]
            print(f"| {key} | {statistics.median(t):.3f} CPU-s/GB | {min(t):.3f} | {max(t):.3f} |")


if __name__ == "__main__":
    main()
