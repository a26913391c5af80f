"""Seeds, mutations and checks shared by the fuzz tests.

Every target is fed bytes (random, or a valid file mutated: bit flips, byte overwrites, truncation,
splices of two files, inserted/deleted bytes, and varints replaced by huge or overlong ones) and
must either accept them or raise one of the package's own errors (``ReshardError``), without
hanging and without allocating more than a small multiple of the input's size.

Run length: ``RESHARD_FUZZ_EXAMPLES=N`` sets every fuzz test's example count (default: a few
hundred, a few seconds each); a long session is e.g.
``RESHARD_FUZZ_EXAMPLES=20000 python -m pytest tests/fuzz -p no:cacheprovider`` (about 15 minutes).
The number of inputs each target saw is printed at the end of the run.
"""

from __future__ import annotations

import atexit
import collections
import os
import shutil
import tempfile
import tracemalloc
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from reshard_job.errors import FormatError, ReshardError
from reshard_job.formats import wire

TESTS = Path(__file__).parents[1]
GOLDEN = TESTS / "golden"

# inputs tried per target, reported by conftest.pytest_terminal_summary
TRIED: collections.Counter = collections.Counter()


def scratch_dir(prefix: str) -> Path:
    """A module's scratch folder (hypothesis runs many examples in one test, so not tmp_path),
    removed when the test process exits."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, True)
    return path


def examples(default: int) -> int:
    return int(os.environ.get("RESHARD_FUZZ_EXAMPLES", default))


def fuzz(default_examples: int):
    """Hypothesis settings for a fuzz test, and a pytest-timeout that grows with the example count
    (a hang fails the test instead of stalling the run)."""
    n = examples(default_examples)
    hyp = settings(max_examples=n, deadline=timedelta(seconds=5), database=None, print_blob=True,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                          HealthCheck.filter_too_much])
    timeout = pytest.mark.timeout(120 + n // 4)

    def apply(test):
        return timeout(hyp(test))

    return apply


# ================================================================================== memory


# Bound on the memory a reader may take for an input of n bytes: it holds at most a few copies of
# what the file holds, plus fixed buffers (the CRC check reads in 8 MiB blocks).
def memory_bound(n: int) -> int:
    return 8 * n + 24 * 1024 * 1024


@contextmanager
def bounded_memory(n: int):
    """Fail when the peak of Python and numpy allocations inside the block exceeds memory_bound(n)."""
    tracemalloc.start()
    try:
        yield
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak <= memory_bound(n), f"peak allocation {peak} bytes for a {n}-byte input"


def read_expecting_clean_errors(target: str, path: Path, data: bytes, read) -> None:
    """Write `data` to `path` and `read` it: within bounded memory, and failing only with the
    package's error naming that file. Counts the input under `target`."""
    TRIED[target] += 1
    path.write_bytes(data)
    try:
        with bounded_memory(len(data)):
            read(path)
    except FormatError as e:
        assert e.path == str(path), e
    except ReshardError as e:
        assert str(path) in str(e), e
    finally:
        path.unlink()


# ================================================================================== mutations


def replace_varint(data: bytes, pos: int, value: int | None) -> bytes:
    """Replace the varint starting at `pos` (or, if none decodes there, insert) by `value`'s encoding;
    None gives an overlong varint (eleven continuation bytes)."""
    new = b"\xff" * 11 if value is None else wire.encode_varint(value)
    try:
        _, end = wire.decode_varint(data, pos, len(data))
    except wire.WireError:
        end = pos
    return data[:pos] + new + data[end:]


HUGE_VALUES = [None, 0, 1, 127, 128, 2**14, 2**21, 2**28, 2**31 - 1, 2**31, 2**32, 2**40, 2**53, 2**62, 2**63 - 1,
               2**63, 2**64 - 1]


def mutations(seeds: list[bytes], hot: list[list[tuple[int, int]]]) -> st.SearchStrategy[bytes]:
    """Mutated versions of the seeds. `hot[i]` lists byte ranges of seed i worth aiming at (record
    headers: keys, lengths, dims, dtypes), where a mutation does more than change a tensor value."""

    def position(i: int) -> st.SearchStrategy[int]:
        n = len(seeds[i])
        anywhere = st.integers(0, max(0, n - 1))
        if not hot[i]:
            return anywhere
        in_header = st.sampled_from(hot[i]).flatmap(lambda r: st.integers(r[0], max(r[0], r[1] - 1)))
        return st.one_of(in_header, in_header, anywhere)

    seed = st.integers(0, len(seeds) - 1)

    def flips(i):
        return st.lists(st.tuples(position(i), st.integers(0, 7)), min_size=1, max_size=8).map(
            lambda fs: _flip(seeds[i], fs))

    def overwrite(i):
        return st.lists(st.tuples(position(i), st.integers(0, 255)), min_size=1, max_size=6).map(
            lambda ws: _overwrite(seeds[i], ws))

    def truncate(i):
        return st.integers(0, len(seeds[i])).map(lambda n: seeds[i][:n])

    def varint(i):
        return st.tuples(position(i), st.sampled_from(HUGE_VALUES) | st.integers(0, 2**64 - 1)).map(
            lambda t: replace_varint(seeds[i], *t))

    def insert_delete(i):
        return st.tuples(position(i), st.integers(-16, 16), st.binary(max_size=16)).map(
            lambda t: _indel(seeds[i], *t))

    def splice(i):
        return st.tuples(seed, st.integers(0, len(seeds[i])), st.data()).map(
            lambda t: seeds[i][:t[1]] + seeds[t[0]][t[2].draw(st.integers(0, len(seeds[t[0]])), label="cut")
                                                    :])

    one = seed.flatmap(lambda i: st.one_of(flips(i), overwrite(i), truncate(i), varint(i), insert_delete(i), splice(i)))
    # a second mutation on top of the first now and then (e.g. a huge length in a truncated file)
    return st.one_of(one, st.tuples(one, st.integers(0, 2**32), st.sampled_from(HUGE_VALUES)).map(
        lambda t: replace_varint(t[0], t[1] % max(1, len(t[0])), t[2])))


def _flip(data: bytes, flips) -> bytes:
    b = bytearray(data)
    for pos, bit in flips:
        if pos < len(b):
            b[pos] ^= 1 << bit
    return bytes(b)


def _overwrite(data: bytes, writes) -> bytes:
    b = bytearray(data)
    for pos, val in writes:
        if pos < len(b):
            b[pos] = val
    return bytes(b)


def _indel(data: bytes, pos: int, delete: int, insert: bytes) -> bytes:
    if delete >= 0:
        return data[:pos] + data[pos + delete:]
    return data[:pos] + insert + data[pos:]


# ================================================================================== .ckpt seeds


def ckpt_seed_files(tmp: Path) -> list[Path]:
    """Real MindSpore files, plus synthetic ones with every record kind the reader knows."""
    from reshard_job.formats.ckpt import CheckpointWriter

    files = [GOLDEN / "S5a_merge_8to1" / "src_checkpoints" / "rank_0" / "checkpoint_0.ckpt",
             GOLDEN / "S3_pipeline2x4opt_to_4" / "src_checkpoints" / "rank_4" / "checkpoint_4.ckpt"]
    rng = np.random.default_rng(1)
    tmp.mkdir(parents=True, exist_ok=True)
    for crc in (False, True):
        path = tmp / f"synthetic_crc{int(crc)}.ckpt"
        with CheckpointWriter(path, crc=crc, chunk_bytes=24, mode=0o644) as w:
            w.add("w-1.weight", rng.standard_normal((3, 4)).astype(np.float32))  # split over two records
            w.add("编码.bias", rng.standard_normal(5).astype(np.float16))
            w.add("bf", rng.integers(0, 2**16, (2, 3), dtype=np.uint16), "BFloat16")
            w.add("step", np.array([7], np.int32))
            w.add_bytes("scalar", "Float32", (0,), np.float32(1.5).tobytes(), [4])  # MindSpore's scalar: dims [0]
            w.add("empty", np.zeros((0, 3), np.float32))
            w.add_str("note", "epoch=3 ✓")
            if not crc:  # MindSpore leaves map records out of the CRC yet checks the whole file (spec §5)
                w.add_map("table", [[((2,), "int64", np.arange(2, dtype=np.int64).tobytes()),
                                     ((2, 2), "float32", np.ones(4, np.float32).tobytes()),
                                     ((2,), "int32", np.zeros(2, np.int32).tobytes())]])
        files.append(path)
    return files


def ckpt_hot_ranges(path: Path) -> list[tuple[int, int]]:
    """Byte ranges of a valid `.ckpt` outside tensor contents: record keys, lengths, names, dims, dtypes."""
    from reshard_job.formats.ckpt import CheckpointReader

    ranges = []
    with CheckpointReader(path) as r:
        for entry in r.groups:
            if entry.kind == "map":
                recs = [(parts[0].offset, parts[0].length, [(p.content_offset, p.content_len) for p in parts])
                        for parts in r.map_parts_of(entry)]
            else:
                recs = [(p.offset, p.length, [(p.content_offset, p.content_len)]) for p in r.records_of(entry)]
            for offset, length, contents in recs:
                pos = offset
                for c_off, c_len in sorted(contents):
                    if c_off > pos:
                        ranges.append((pos, c_off))
                    pos = c_off + c_len
                if offset + length > pos:
                    ranges.append((pos, offset + length))
        if r.has_crc:
            ranges.append((r.size - 17, r.size))
    return ranges


# ================================================================================== strategy seeds


def strategy_seed_files() -> list[Path]:
    return [GOLDEN / "S1_mlp_tutorial_8to4" / "src_strategy.ckpt",
            GOLDEN / "S2_block_mp4dp2opt_to_mp4" / "dst_strategy.ckpt",
            GOLDEN / "S3_pipeline2x4opt_to_4" / "src_strategy_dir" / "stage1.ckpt",
            GOLDEN / "S3_pipeline2x4opt_to_4" / "src_strategy_merged.ckpt"]
