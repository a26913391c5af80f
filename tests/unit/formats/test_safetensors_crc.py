"""MindSpore's safetensors ``crc_num`` for 0-d integer tensors, both ways.

MindSpore chains ``binascii.crc32`` over ``bytes(array)`` of every tensor (sorted names, each name
first). numpy lets a 0-d integer array stand for an index, so ``bytes()`` of one holding ``n`` is
``n`` zero bytes, not its stored bytes. The reference below applies exactly that rule with numpy,
on arrays read back by the ``safetensors`` library, independently of our code.
"""

from __future__ import annotations

import time
import zlib

import numpy as np
import pytest
import safetensors.numpy as stnp

from reshard_job.core.dtypes import from_numpy
from reshard_job.errors import LayoutError, SafetensorsFormatError
from reshard_job.formats.crc32 import crc32_of_zeros, scalar_crc_part
from reshard_job.formats.safetensors import SafetensorsReader, SafetensorsWriter


def mindspore_crc_num(arrays: dict[str, np.ndarray]) -> int:
    """MindSpore's rule (train/serialization.py, safetensors save and load): name, then bytes(array)."""
    crc = 0
    for name in sorted(arrays):
        crc = zlib.crc32(name.encode("utf-8"), crc)
        crc = zlib.crc32(bytes(arrays[name]), crc)
    return crc


def training_state() -> dict[str, np.ndarray]:
    """What ModelCheckpoint saves next to the weights: 0-d integer counters among ordinary tensors."""
    return {
        "w": np.arange(6, dtype=np.float32).reshape(2, 3),
        "epoch_num": np.array(3, np.int64),
        "step_num": np.array(30, np.int64),
        "loss_scale": np.array(1024.0, np.float32),  # 0-d float: its bytes, as for any array
        "flag": np.array(True),  # 0-d bool: numpy does not take it as an index either
        "small": np.array(7, np.uint8),
        "vec": np.array([5], np.int64),  # one element but 1-d: its bytes
    }


def library_file(path, arrays, crc_num: int) -> str:
    """A file as MindSpore's save path makes it: the safetensors library with its metadata."""
    stnp.save_file(arrays, str(path), metadata={"format": "ms", "crc_num": str(crc_num)})
    return str(path)


def test_the_rule_differs_from_the_stored_bytes():
    arrays = training_state()
    assert bytes(arrays["step_num"]) == bytes(30) and bytes(arrays["vec"]) == arrays["vec"].tobytes()
    as_stored = 0
    for name in sorted(arrays):
        as_stored = zlib.crc32(arrays[name].tobytes(), zlib.crc32(name.encode(), as_stored))
    assert as_stored != mindspore_crc_num(arrays)


def test_a_mindspore_file_with_counters_is_accepted(tmp_path):
    arrays = training_state()
    path = library_file(tmp_path / "ms.safetensors", arrays, mindspore_crc_num(arrays))
    with SafetensorsReader(path) as r:  # verifies on open
        assert r.compute_crc() == mindspore_crc_num(arrays)
        assert r.read("step_num").item() == 30


def test_a_wrong_counter_fails_the_check(tmp_path):
    arrays = training_state()
    crc = mindspore_crc_num(arrays)
    arrays["step_num"] = np.array(31, np.int64)
    path = library_file(tmp_path / "bad.safetensors", arrays, crc)
    with pytest.raises(SafetensorsFormatError, match="CRC32 mismatch"):
        SafetensorsReader(path)


@pytest.mark.parametrize("streamed", [False, True], ids=["in-memory", "streamed"])
def test_our_crc_num_is_what_mindspore_computes(tmp_path, streamed):
    arrays = training_state()
    path = tmp_path / "ours.safetensors"
    with SafetensorsWriter(path, crc=True) as w:
        if streamed:  # the header is written before the data, the CRC patched in at the end
            for name, a in arrays.items():
                w.declare(name, from_numpy(a.dtype).name, a.shape)
            for name in w.data_order():
                sink = w.begin(name)
                sink.write(np.ascontiguousarray(arrays[name]))
                sink.close()
        else:
            for name, a in arrays.items():
                w.add(name, a)
    back = stnp.load_file(str(path))  # as MindSpore's loader sees them
    meta = SafetensorsReader(path, verify_crc=False).metadata
    assert int(meta["crc_num"]) == mindspore_crc_num(back) == mindspore_crc_num(arrays)


def test_zero_bytes_crc_matches_zlib_and_never_allocates():
    for n in (0, 1, 2, 7, 8, 255, 4096, 100_003):
        for start in (0, 1, 0xDEADBEEF):
            assert crc32_of_zeros(n, start) == zlib.crc32(bytes(n), start)
    t = time.perf_counter()
    huge = crc32_of_zeros(2**62)
    assert time.perf_counter() - t < 0.5
    # 2**62 zero bytes are 2**61 zeros twice: the combination rule holds at that size too
    half = crc32_of_zeros(2**61)
    assert crc32_of_zeros(2**61, half) == huge
    assert scalar_crc_part("I64", (2**62).to_bytes(8, "little")) == (huge, 2**62)


def test_a_huge_counter_round_trips_without_allocating(tmp_path):
    arrays = {"step_num": np.array(2**62, np.int64), "w": np.ones(3, np.float32)}
    path = tmp_path / "huge.safetensors"
    t = time.perf_counter()
    with SafetensorsWriter(path, crc=True) as w:
        for name, a in arrays.items():
            w.add(name, a)
    with SafetensorsReader(path) as r:
        assert r.read("step_num").item() == 2**62
    assert time.perf_counter() - t < 2
    expected = zlib.crc32(b"w", crc32_of_zeros(2**62, zlib.crc32(b"step_num")))
    expected = zlib.crc32(arrays["w"].tobytes(), expected)
    assert int(r.metadata["crc_num"]) == expected


@pytest.mark.parametrize("value,dtype", [(-1, np.int64), (2**63, np.uint64), (-3, np.int8)])
def test_values_bytes_refuses_are_refused_both_ways(tmp_path, value, dtype):
    arrays = {"step_num": np.array(value, dtype)}
    with pytest.raises((ValueError, OverflowError)):
        bytes(arrays["step_num"])  # MindSpore could neither save nor check such a file
    with pytest.raises(LayoutError, match=r"parameter 'step_num': cannot write crc_num: .* write without crc"):
        with SafetensorsWriter(tmp_path / "w.safetensors", crc=True) as w:
            w.add("step_num", arrays["step_num"])
    assert not (tmp_path / "w.safetensors").exists()
    path = library_file(tmp_path / "r.safetensors", arrays, 0)
    with pytest.raises(SafetensorsFormatError, match=r"tensor 'step_num': crc_num cannot be checked") as ei:
        SafetensorsReader(path)
    assert str(ei.value).count("\n") == 0 and path in str(ei.value)
    with SafetensorsReader(path, verify_crc=False) as r:  # readable without the check
        assert r.read("step_num").item() == value
