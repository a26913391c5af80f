"""The safetensors reader under the same mutations as the `.ckpt` reader (its own header fuzzing
lives in tests/formats/test_safetensors.py): only ``ReshardError``, bounded memory, no hang."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from hypothesis import given

from fuzz_helpers import scratch_dir, fuzz, mutations, read_expecting_clean_errors

import reshard_job.core.dtypes as dtypes
from reshard_job.formats.safetensors import SafetensorsReader, save_file

SCRATCH = scratch_dir("fuzz_safetensors_")


def _seeds() -> list[bytes]:
    rng = np.random.default_rng(2)
    out = []
    for i, (crc, mindspore) in enumerate([(False, True), (True, True), (False, False)]):
        path = SCRATCH / f"seed{i}.safetensors"
        save_file(path, {"w-1.weight": rng.standard_normal((3, 4)).astype(np.float32),
                         "编码.bias": rng.standard_normal(5).astype(np.float16),
                         "bf": rng.integers(0, 2**16, (2, 3), dtype=np.uint16),
                         "empty": np.zeros((0, 2), np.int32)},
                  crc=crc, mindspore=mindspore, dtype_overrides={"bf": "BFloat16"}, mode=0o644)
        out.append(path.read_bytes())
    return out


SEEDS = _seeds()
# the 8-byte header length and the JSON header are where a mutation changes more than a value
HOT = [[(0, 8 + int.from_bytes(s[:8], "little"))] for s in SEEDS]


def read_everything(path: Path) -> None:
    with SafetensorsReader(path) as r:
        for name, e in r.entries.items():
            dt = dtypes.BY_NAME.get(e.dtype)
            if dt is None or dt.storage is None:
                r.read_raw(name)
            else:
                r.read(name)
                if e.shape and all(e.shape):
                    r.read_box(name, tuple((n // 2, n) for n in e.shape))


@fuzz(300)
@given(data=mutations(SEEDS, HOT))
def test_mutated_files(data):
    read_expecting_clean_errors("safetensors: mutated files", SCRATCH / f"{os.getpid()}_fuzz.safetensors", data,
                                read_everything)
