"""Fuzzing the `.ckpt` reader: random bytes and mutated real files either read, or fail with a
``ReshardError`` naming the file; never another exception, a hang or an outsized allocation.

Everything a converter does with a source is exercised: indexing (with the CRC check), reading
every entry as MindSpore's loader would (tensors, strings, map tensors), streaming raw content,
reading boxes of every tensor, and copying the file record for record.
"""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import example, given
from hypothesis import strategies as st

from fuzz_helpers import (ckpt_hot_ranges, ckpt_seed_files, fuzz, mutations, read_expecting_clean_errors, scratch_dir,
                          replace_varint)

import reshard_job.core.dtypes as dtypes
from reshard_job.formats.ckpt import KIND_TENSOR, CheckpointReader
from reshard_job.formats.rewrite import copy_checkpoint

SCRATCH = scratch_dir("fuzz_ckpt_")
SEED_FILES = ckpt_seed_files(SCRATCH / "seeds")
SEEDS = [p.read_bytes() for p in SEED_FILES]
HOT = [ckpt_hot_ranges(p) for p in SEED_FILES]


def boxes(shape: tuple[int, ...]):
    """A few boxes of a tensor: whole, each half along every dimension, one element, an empty one."""
    yield tuple((0, n) for n in shape)
    for d, n in enumerate(shape):
        if n > 1:
            yield tuple((0, m) if i != d else (n // 2, n) for i, m in enumerate(shape))
    if shape and all(shape):
        yield tuple((n // 2, n // 2 + 1) for n in shape)
        yield tuple((0, 0) if i == 0 else (0, n) for i, n in enumerate(shape))


def read_everything(path: Path) -> None:
    with CheckpointReader(path) as r:
        for name in r.names():
            entry = r.entries[name]
            r.value(name)
            for _ in r.iter_content(name, 64):
                pass
            dt = dtypes.BY_NAME.get(entry.dtype)
            if entry.kind == KIND_TENSOR and dt is not None and dt.storage is not None:
                for box in boxes(entry.shape):
                    r.read_box(name, box)
        copy = SCRATCH / f"{os.getpid()}_copy.ckpt"
        try:
            copy_checkpoint(r, copy, crc=r.has_crc)
            with CheckpointReader(copy) as c:  # what was accepted copies to something that reads the same
                assert c.names() == r.names()
                for name in r.names():
                    assert c.read_raw(name) == r.read_raw(name)
        finally:
            if copy.exists():
                os.chmod(copy, 0o644)
                copy.unlink()


def check(target: str, data: bytes) -> None:
    read_expecting_clean_errors(target, SCRATCH / f"{os.getpid()}_{target}.ckpt", data, read_everything)


def test_seeds_read_without_error():
    for p in SEED_FILES:
        read_everything(p)


@fuzz(200)
@given(data=st.binary(max_size=512) | st.binary(max_size=64).map(lambda b: b"\x0a" + b))
@example(data=b"\x0a")
@example(data=b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01")
@example(data=b"\x0a\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80")
@example(data=b"crc_num" + bytes(10))
def test_random_bytes(data):
    check("ckpt: random bytes", data)


@fuzz(200)
@given(data=mutations(SEEDS, HOT))
def test_mutated_files(data):
    check("ckpt: mutated files", data)


@fuzz(150)
@given(seed=st.integers(0, len(SEEDS) - 1), record=st.integers(0, 10**6), field_offset=st.integers(0, 40),
       value=st.sampled_from([None, 2**31, 2**40, 2**62, 2**63, 2**64 - 1]) | st.integers(0, 2**64 - 1))
def test_huge_declared_lengths_allocate_nothing(seed, record, field_offset, value):
    """A varint inside a record header (a length, a dim, a key) replaced by a huge or overlong one."""
    start, stop = HOT[seed][record % len(HOT[seed])]
    pos = min(stop - 1, start + field_offset)
    check("ckpt: huge declared lengths", replace_varint(SEEDS[seed], pos, value))
