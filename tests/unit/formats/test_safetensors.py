"""Safetensors reader and writer: agreement with the `safetensors` library, MindSpore's crc_num,
round trips of every dtype, validation of bad input, and reads that touch only what they need."""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from math import prod

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import safetensors
import safetensors.numpy as stnp
from reshard_job.errors import LayoutError, SafetensorsFormatError
import reshard_job.core.dtypes as dtypes
from reshard_job.formats.base import WrittenFile
from reshard_job.formats.crc32 import chain_crc, crc32_combine
from reshard_job.formats.rewrite import copy_safetensors
from reshard_job.formats.safetensors import SafetensorsReader, SafetensorsWriter, save_file

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# MindSpore dtype name -> (safetensors code, dtype name for safetensors.TensorSpec), in the library's
# order of increasing alignment (its Dtype enum), which is the reverse of file order
WRITABLE = {
    "Bool": ("BOOL", "bool"),
    "UInt8": ("U8", "uint8"),
    "Int8": ("I8", "int8"),
    "F8_E5M2": ("F8_E5M2", "float8_e5m2"),
    "F8_E4M3": ("F8_E4M3", "float8_e4m3fn"),
    "Int16": ("I16", "int16"),
    "UInt16": ("U16", "uint16"),
    "Float16": ("F16", "float16"),
    "BFloat16": ("BF16", "bfloat16"),
    "Int32": ("I32", "int32"),
    "UInt32": ("U32", "uint32"),
    "Float32": ("F32", "float32"),
    "Complex64": ("C64", "complex64"),
    "Float64": ("F64", "float64"),
    "Int64": ("I64", "int64"),
    "UInt64": ("U64", "uint64"),
}


def storage_of(dtype: str) -> np.dtype:
    if dtype in dtypes.BY_NAME:
        return dtypes.BY_NAME[dtype].storage
    return dtypes.from_safetensors(dtype).storage


def raw_array(dtype: str, shape, seed: int = 0) -> np.ndarray:
    """Arbitrary bytes viewed as the dtype's storage (NaNs, bool values other than 0/1: all fine)."""
    st_dt = storage_of(dtype)
    n = prod(shape) * st_dt.itemsize
    raw = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    return raw.view(st_dt).reshape(shape)


def library_bytes(tensors: dict[str, tuple[str, np.ndarray]], metadata=None) -> bytes:
    """What safetensors.serialize makes of raw arrays tagged with our dtype names (bf16, f8 included)."""
    keep = []
    specs = {}
    for name, (dtype, arr) in tensors.items():
        arr = np.array(arr, order="C")  # not ascontiguousarray, which turns 0-d into 1-d
        keep.append(arr)
        specs[name] = safetensors.TensorSpec(
            dtype=WRITABLE[dtype][1], shape=list(arr.shape), data_ptr=arr.ctypes.data, data_len=arr.nbytes
        )
    return bytes(safetensors.serialize(specs, metadata=metadata))


def write_ours(path, tensors: dict[str, tuple[str, np.ndarray]], **kw) -> WrittenFile:
    with SafetensorsWriter(path, **kw) as w:
        for name, (dtype, arr) in tensors.items():
            w.add(name, arr, dtype)
    return w.result


def stream_ours(path, tensors: dict[str, tuple[str, np.ndarray]], pieces: int = 3, **kw) -> WrittenFile:
    """Declare everything, then stream each tensor in data_order() in several pieces."""
    with SafetensorsWriter(path, **kw) as w:
        for name, (dtype, arr) in tensors.items():
            w.declare(name, dtype, arr.shape)
        for name in w.data_order():
            raw = np.ascontiguousarray(tensors[name][1]).reshape(-1).view(np.uint8)
            sink = w.begin(name)
            for chunk in np.array_split(raw, pieces):
                sink.write(chunk)
            sink.close()
    return w.result


def put(path, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


def craft(header: dict, data: bytes, *, pad: bool = True) -> bytes:
    text = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data


# ------------------------------------------------------------------------ files the library wrote


def sample_numpy_tensors():
    rng = np.random.default_rng(1)
    return {
        "layer.0.weight": rng.standard_normal((6, 5)).astype(np.float32),
        "layer.0.bias": rng.standard_normal(5).astype(np.float16),
        "embedding": rng.standard_normal((4, 3, 7)),
        "step": np.array(17, dtype=np.int64),
        "mask": rng.integers(0, 2, (3, 4)).astype(bool),
        "ids": rng.integers(-100, 100, (9,)).astype(np.int32),
        "u8": rng.integers(0, 255, (2, 2)).astype(np.uint8),
        "cplx": (rng.standard_normal(3) + 1j * rng.standard_normal(3)).astype(np.complex64),
        "empty": np.zeros((0, 4), np.float32),
    }


@pytest.mark.parametrize("metadata", [None, {"format": "ms"}, {"format": "pt", "note": "x"}])
def test_reads_library_files(tmp_path, metadata):
    tensors = sample_numpy_tensors()
    path = tmp_path / "lib.safetensors"
    stnp.save_file(tensors, path, metadata=metadata)
    with SafetensorsReader(path) as r:
        assert r.metadata == (metadata or {})
        assert set(r.names()) == set(tensors)
        offsets = [e.extra["data_offsets"] for e in r.entries.values()]
        assert offsets == sorted(offsets)  # entries come in data order
        assert r["layer.0.weight"].dtype == "Float32"
        assert r["mask"].dtype == "Bool"
        assert r["cplx"].dtype == "Complex64"
        for name, arr in tensors.items():
            got = r.read(name)
            assert got.shape == arr.shape and got.dtype == arr.dtype
            assert np.array_equal(got, arr)
        w = tensors["embedding"]
        assert np.array_equal(r.read_box("embedding", ((1, 3), (0, 3), (2, 6))), w[1:3, :, 2:6])
        assert np.array_equal(r.read_box("layer.0.weight", ((2, 5), (1, 2))), tensors["layer.0.weight"][2:5, 1:2])


def test_reads_bf16_and_f8_written_by_the_library(tmp_path):
    bf = dtypes.float32_to_bf16(np.array([[1.5, -2.25, 3.0], [0.0, -0.0, 1e30]], np.float32))
    f8 = np.arange(10, dtype=np.uint8)
    data = library_bytes({"w": ("BFloat16", bf), "q": ("F8_E4M3", f8), "s": ("Float32", np.ones(2, np.float32))})
    with SafetensorsReader(put(tmp_path / "bf.safetensors", data)) as r:
        assert r["w"].dtype == "BFloat16" and r["w"].extra["safetensors_dtype"] == "BF16"
        got = r.read("w")
        assert got.dtype == np.uint16 and np.array_equal(got, bf)  # raw words, never widened
        assert r.read_raw("w")[:6] == bytes.fromhex("C03F10C04040")  # the spec's example bytes
        assert np.array_equal(r.read_box("w", ((1, 2), (1, 3))), bf[1:2, 1:3])
        assert r["q"].dtype == "F8_E4M3"
        assert np.array_equal(r.read_box("q", ((3, 7),)), f8[3:7])


# --------------------------------------------------------------------- our files, the library's view


def test_writer_output_loads_with_the_library(tmp_path):
    tensors = sample_numpy_tensors()
    res = save_file(tmp_path / "ours.safetensors", tensors, metadata={"remove_redundancy": "False"})
    loaded = stnp.load_file(res.path)
    assert set(loaded) == set(tensors)
    for name, arr in tensors.items():
        assert loaded[name].dtype == arr.dtype and np.array_equal(loaded[name], arr)
    with safetensors.safe_open(res.path, framework="np") as f:
        assert f.metadata() == {"format": "ms", "remove_redundancy": "False"}
    # the returned hashes are the file's and each tensor's
    assert res.sha256 == hashlib.sha256(open(res.path, "rb").read()).hexdigest()
    assert res.size == os.path.getsize(res.path)
    assert res.tensors["ids"] == hashlib.sha256(tensors["ids"].tobytes()).hexdigest()
    assert oct(os.stat(res.path).st_mode & 0o777) == oct(0o444)


@pytest.mark.parametrize("metadata", [None, {"format": "ms"}, {"crc": "x"}, {}])
def test_byte_identical_to_library_save_file(tmp_path, metadata):
    tensors = sample_numpy_tensors()
    stnp.save_file(tensors, tmp_path / "lib.safetensors", metadata=metadata)
    ours = save_file(tmp_path / "ours.safetensors", tensors, metadata=metadata, mindspore=False)
    assert open(ours.path, "rb").read() == (tmp_path / "lib.safetensors").read_bytes()
    streamed = stream_ours(
        tmp_path / "streamed.safetensors",
        {n: (dtypes.from_numpy(a.dtype).name, a) for n, a in tensors.items()},
        metadata=metadata,
        mindspore=False,
    )
    assert streamed.sha256 == ours.sha256


def test_byte_identical_for_every_writable_dtype(tmp_path):
    tensors = {f"t_{d}": (d, raw_array(d, (3, 2), seed=i)) for i, d in enumerate(WRITABLE)}
    tensors["scalar"] = ("Float32", raw_array("Float32", ()))
    tensors["nothing"] = ("BFloat16", raw_array("BFloat16", (2, 0, 3)))
    expected = library_bytes(tensors, {"format": "ms"})
    ours = write_ours(tmp_path / "all.safetensors", tensors)  # mindspore=True adds exactly format=ms
    assert open(ours.path, "rb").read() == expected


def test_empty_file_matches_library(tmp_path):
    assert open(save_file(tmp_path / "e.safetensors", {}).path, "rb").read() == stnp.save({})
    with SafetensorsReader(tmp_path / "e.safetensors") as r:
        assert len(r) == 0 and r.metadata == {}


names = st.text(min_size=0, max_size=6).filter(lambda s: s != "__metadata__")
shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)
tensor_sets = st.dictionaries(names, st.tuples(st.sampled_from(sorted(WRITABLE)), shapes), min_size=0, max_size=6)
one_metadata = st.one_of(
    st.none(), st.just({"format": "ms"}), st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=1)
)


@FAST
@given(spec=tensor_sets, metadata=one_metadata, seed=st.integers(0, 2**16))
def test_hypothesis_byte_identical_to_library(tmp_path, spec, metadata, seed):
    # names with quotes, backslashes, control and non-ASCII characters exercise the JSON escaping
    tensors = {n: (d, raw_array(d, s, seed)) for n, (d, s) in spec.items()}
    if not tensors and metadata == {}:
        return  # the library writes broken JSON for no tensors with empty metadata
    ours = write_ours(tmp_path / "h.safetensors", tensors, metadata=metadata, mindspore=False)
    assert open(ours.path, "rb").read() == library_bytes(tensors, metadata)


def test_several_metadata_keys_are_written_sorted(tmp_path):
    # the library's order is its hash map's (varies per run); ours is sorted, same content
    meta = {"z": "1", "a": "2", "m": "3"}
    res = save_file(tmp_path / "m.safetensors", {"x": np.zeros(3, np.float32)}, metadata=meta)
    raw = open(res.path, "rb").read()
    header = raw[8 : 8 + int.from_bytes(raw[:8], "little")].decode()
    assert header.startswith('{"__metadata__":{"a":"2","format":"ms","m":"3","z":"1"},')
    with safetensors.safe_open(res.path, framework="np") as f:
        assert f.metadata() == {**meta, "format": "ms"}


def test_plain_safetensors_has_no_format_key(tmp_path):
    res = save_file(tmp_path / "p.safetensors", {"x": np.zeros(2, np.int8)}, mindspore=False)
    with SafetensorsReader(res.path) as r:
        assert not r.has_metadata and r.metadata == {} and not r.is_mindspore
    res = save_file(tmp_path / "q.safetensors", {"x": np.zeros(2, np.int8)})
    with SafetensorsReader(res.path) as r:
        assert r.metadata == {"format": "ms"} and r.is_mindspore


# ---------------------------------------------------------------------------------- round trips


@FAST
@given(spec=tensor_sets, data=st.data(), pieces=st.integers(1, 4), crc=st.booleans())
def test_hypothesis_round_trip_with_boxes(tmp_path, spec, data, pieces, crc):
    tensors = {n: (d, raw_array(d, s, i)) for i, (n, (d, s)) in enumerate(spec.items())}
    if crc and not _crc_hashable(tensors):  # MindSpore's crc_num has no value for these (test_safetensors_crc)
        with pytest.raises(LayoutError, match="cannot write crc_num"):
            stream_ours(tmp_path / "rt.safetensors", tensors, pieces=pieces, crc=crc)
        return
    res = stream_ours(tmp_path / "rt.safetensors", tensors, pieces=pieces, crc=crc)
    with SafetensorsReader(res.path) as r:
        assert r.has_crc == (crc and bool(tensors))
        assert list(r.names()) == sorted(tensors, key=lambda n: (-_align(tensors[n][0]), n))
        for name, (dtype, arr) in tensors.items():
            e = r[name]
            assert (e.dtype, e.shape) == (dtype, arr.shape)
            assert r.read_raw(name) == arr.tobytes()
            assert res.tensors[name] == hashlib.sha256(arr.tobytes()).hexdigest()
            box = tuple(data.draw(_range(n), label=f"box {name!r}") for n in arr.shape)
            got = r.read_box(name, box)
            want = arr[tuple(slice(a, b) for a, b in box) + (Ellipsis,)]  # an array even when 0-d
            assert got.shape == want.shape and got.tobytes() == want.tobytes()


def _crc_hashable(tensors) -> bool:
    """False when a 0-d integer holds a value numpy's bytes() refuses (negative, or past 2**63-1)."""
    return all(arr.shape != () or not dtype.startswith(("Int", "UInt")) or 0 <= int(arr) < 2**63
               for dtype, arr in tensors.values())


def _align(dtype: str) -> int:
    return list(WRITABLE).index(dtype)


def _range(n: int):
    return st.integers(0, n).flatmap(lambda a: st.integers(a, n).map(lambda b: (a, b)))


def test_int4_is_marked_bytes_one_per_stored_element(tmp_path):
    packed = np.arange(12, dtype=np.int8).reshape(3, 4)
    with SafetensorsWriter(tmp_path / "q.safetensors", crc=True) as w:
        w.add("w_q", packed, "Int4")
        w.add("b", np.ones(2, np.float32))
    with SafetensorsReader(w.result.path) as r:
        assert r.metadata["w_q"] == "Int4"
        assert r["w_q"].dtype == "Int4" and r["w_q"].shape == (3, 4)
        assert r["w_q"].extra["safetensors_dtype"] == "I8"
        assert r.read_raw("w_q") == packed.tobytes()
        # each stored element is one byte (two 4-bit values): boxes of the stored shape are whole bytes
        assert r.read_box("w_q", ((1, 3), (2, 4))).tobytes() == packed[1:3, 2:4].tobytes()
    with safetensors.safe_open(w.result.path, framework="np") as f:  # the library sees an int8 tensor
        assert np.array_equal(f.get_tensor("w_q"), packed)


def test_copy_reproduces_the_file(tmp_path):
    tensors = {"a": ("Int8", raw_array("Int8", (5,))), "b": ("BFloat16", raw_array("BFloat16", (2, 3)))}
    src = write_ours(tmp_path / "src.safetensors", tensors, crc=True, metadata={"remove_redundancy": "False"})
    with SafetensorsReader(src.path) as r:
        dst = copy_safetensors(r, tmp_path / "dst.safetensors")
    assert dst.sha256 == src.sha256 and dst.tensors == src.tensors


# ----------------------------------------------------------------------------------------- CRC


def test_crc_num_as_mindspore_computes_it(tmp_path):
    # data order is F32 "b" before I8 "a"; the CRC chains in sorted-name order: a, then b
    a = np.array([1, -2, 3], np.int8)
    b = np.array([0.5, 2.0], np.float32)
    expected = 0
    for name, arr in (("a", a), ("b", b)):
        expected = zlib.crc32(name.encode("utf-8"), expected)
        expected = zlib.crc32(arr.tobytes(), expected)
    res = save_file(tmp_path / "c.safetensors", {"b": b, "a": a}, crc=True)
    with SafetensorsReader(res.path) as r:
        assert r.names() == ["b", "a"]
        assert r.metadata == {"crc_num": str(expected), "format": "ms"}
        assert r.compute_crc() == expected
    # what MindSpore's save_file call produces, up to the order of the two metadata keys (the
    # library's varies from run to run; ours is sorted)
    ours = open(res.path, "rb").read()
    lib = stnp.save({"a": a, "b": b}, metadata={"format": "ms", "crc_num": str(expected)})
    n = int.from_bytes(lib[:8], "little")
    assert ours[:8] == lib[:8] and ours[8 + n :] == lib[8 + n :]
    assert json.loads(ours[8 : 8 + n]) == json.loads(lib[8 : 8 + n])
    assert ours[8:].startswith(b'{"__metadata__":{"crc_num":"%d","format":"ms"},' % expected)


def test_crc32_combine_matches_zlib():
    rng = np.random.default_rng(5)
    for n1, n2 in [(0, 0), (0, 7), (13, 0), (1, 1), (100, 3000), (4097, 65536)]:
        x, y = rng.bytes(n1), rng.bytes(n2)
        assert crc32_combine(zlib.crc32(x), zlib.crc32(y), n2) == zlib.crc32(x + y)
    assert chain_crc({"b": (zlib.crc32(b"yy"), 2), "a": (zlib.crc32(b"x"), 1)}) == zlib.crc32(b"axbyy")


@pytest.mark.parametrize("digits_case", range(6))
def test_streamed_crc_reads_back_and_usually_matches_in_memory_bytes(tmp_path, digits_case):
    # streaming writes the header before the CRC is known, reserving room for 10 digits
    tensors = {f"t{i}": ("Float32", raw_array("Float32", (i + 1,), seed=digits_case)) for i in range(digits_case + 1)}
    streamed = stream_ours(tmp_path / "s.safetensors", tensors, crc=True)
    in_memory = write_ours(tmp_path / "m.safetensors", tensors, crc=True)
    with SafetensorsReader(streamed.path) as rs, SafetensorsReader(in_memory.path) as rm:
        assert rs.metadata == rm.metadata
        assert rs.header_len >= rm.header_len
        if rs.header_len == rm.header_len:
            assert streamed.sha256 == in_memory.sha256
    assert streamed.sha256 == hashlib.sha256(open(streamed.path, "rb").read()).hexdigest()
    assert stnp.load_file(streamed.path).keys() == tensors.keys()


def test_given_crc_is_checked(tmp_path):
    tensors = {"a": ("Int8", np.arange(4, dtype=np.int8))}
    good = write_ours(tmp_path / "g.safetensors", tensors, crc=True)
    crc = int(SafetensorsReader(good.path).metadata["crc_num"])
    assert stream_ours(tmp_path / "g2.safetensors", tensors, crc=crc).sha256 == good.sha256
    with pytest.raises(ValueError, match="crc"):
        stream_ours(tmp_path / "bad.safetensors", tensors, crc=crc ^ 1)
    assert sorted(os.listdir(tmp_path)) == ["g.safetensors", "g2.safetensors"]  # nothing half-written


def test_flipped_data_byte_fails_crc_verification(tmp_path):
    res = save_file(tmp_path / "c.safetensors", {"w": np.arange(64, dtype=np.float32)}, crc=True)
    raw = bytearray(open(res.path, "rb").read())
    raw[-10] ^= 0x01
    bad = put(tmp_path / "flipped.safetensors", bytes(raw))
    with pytest.raises(SafetensorsFormatError, match="CRC32 mismatch") as ei:
        SafetensorsReader(bad)
    assert bad in str(ei.value)
    with SafetensorsReader(bad, verify_crc=False) as r:  # the caller may still choose to read it
        assert r.has_crc and r.read("w")[-3] != 61


# ------------------------------------------------------------------------------------ writer misuse


def test_streaming_out_of_order_is_refused(tmp_path):
    w = SafetensorsWriter(tmp_path / "o.safetensors")
    w.declare("small", "Int8", (4,))
    w.declare("big", "Float64", (2,))
    assert w.data_order() == ["big", "small"]  # descending alignment first
    with pytest.raises(RuntimeError, match="'big' comes before it"):
        w.begin("small")
    with pytest.raises(RuntimeError, match="declare"):
        w.declare("late", "Int8", (1,))
    sink = w.begin("big")
    sink.write(np.zeros(1, np.float64))
    with pytest.raises(ValueError, match="got 8 of 16 bytes"):
        sink.close()
    with pytest.raises(ValueError, match="more bytes"):
        sink.write(np.zeros(2, np.float64))
    sink.write(np.zeros(1, np.float64))
    sink.close()
    with pytest.raises(RuntimeError, match="closed"):
        sink.write(b"x")  # would land in the next tensor's place
    w.abort()
    assert os.listdir(tmp_path) == []


def test_added_tensors_are_written_when_their_turn_comes(tmp_path):
    with SafetensorsWriter(tmp_path / "mix.safetensors") as w:
        w.add("a_small", np.arange(3, dtype=np.int8))  # buffered
        w.declare("b_big", "Float32", (2,))
        w.add("c", np.ones(1, np.float64))  # buffered, first in file order
        sink = w.begin("b_big")  # writes "c" first
        sink.write(np.array([1, 2], np.float32))
        sink.close()
    with SafetensorsReader(w.result.path) as r:
        assert r.names() == ["c", "b_big", "a_small"]
        assert r.read("a_small").tolist() == [0, 1, 2]


def test_unwritten_tensor_aborts_in_context(tmp_path):
    with pytest.raises(RuntimeError, match="not written"):
        with SafetensorsWriter(tmp_path / "x.safetensors") as w:
            w.declare("a", "Int8", (1,))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "dtype, problem",
    [("str", "str entries cannot be stored"), ("Complex128", "no code the safetensors format knows"),
     ("Quaternion", "unknown dtype")],
)
def test_unstorable_dtypes(tmp_path, dtype, problem):
    with SafetensorsWriter(tmp_path / "x.safetensors") as w:
        with pytest.raises(LayoutError, match=problem):
            w.declare("p", dtype, (1,))


def test_writer_rejects_bad_names_and_metadata(tmp_path):
    with pytest.raises(ValueError, match="crc_num"):
        SafetensorsWriter(tmp_path / "x.safetensors", metadata={"crc_num": "12"})
    with pytest.raises(ValueError, match="str to str"):
        SafetensorsWriter(tmp_path / "x.safetensors", metadata={"a": 1})
    with SafetensorsWriter(tmp_path / "x.safetensors") as w:
        with pytest.raises(ValueError, match="reserved"):
            w.declare("__metadata__", "Int8", (1,))
        with pytest.raises(ValueError, match="UTF-8"):
            w.declare("\ud800", "Int8", (1,))
        with pytest.raises(ValueError, match="declared twice"):
            w.declare("a", "Int8", (1,))
            w.declare("a", "Int8", (2,))
        w.add("a", np.zeros(1, np.int8))


# ------------------------------------------------------------------------------------- bad input


def _valid_header():
    return {"__metadata__": {"format": "ms"}, "w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
            "b": {"dtype": "I8", "shape": [2], "data_offsets": [16, 18]}}


BAD = {
    "empty": (b"", "empty file"),
    "short": (b"\x05\x00\x00", "too short"),
    "header past end": ((1000).to_bytes(8, "little") + b"{}", "runs past the end"),
    "huge header": ((2**40).to_bytes(8, "little") + b"{}" * 8, "exceeds"),
    "not utf8": ((4).to_bytes(8, "little") + b"\xff\xfe{}", "UTF-8"),
    "not json": ((8).to_bytes(8, "little") + b"{nope!!}", "not valid JSON"),
    "json list": ((8).to_bytes(8, "little") + b"[1, 2]  ", "expected an object"),
    "unknown dtype": (craft({"x": {"dtype": "F7", "shape": [1], "data_offsets": [0, 1]}}, b"\0"), "unknown dtype 'F7'"),
    "negative dim": (craft({"x": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 0]}}, b""), "non-negative"),
    "float dim": (craft({"x": {"dtype": "U8", "shape": [1.0], "data_offsets": [0, 1]}}, b"\0"), "non-negative"),
    "bool dim": (craft({"x": {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}}, b"\0"), "non-negative"),
    "offsets out of range": (craft({"x": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}, b"\0\0"), "run past"),
    "offsets reversed": (craft({"x": {"dtype": "U8", "shape": [0], "data_offsets": [2, 1]}}, b"\0\0"), "end before"),
    "overlap": (craft({"x": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
                       "y": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]}}, b"\0" * 3), "overlap"),
    "gap": (craft({"x": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}, b"\0\0"), "gap"),
    "trailing bytes": (craft({"x": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, b"\0\0"), "after the last"),
    "wrong byte count": (craft({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4), "needs 8"),
    "missing field": (craft({"x": {"dtype": "U8", "shape": [1]}}, b"\0"), "lacks data_offsets"),
    "metadata not str": (craft({"__metadata__": {"a": 1}}, b""), "expected a string"),
    "duplicate key": ((64).to_bytes(8, "little")
                      + b'{"x":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},"x":1}'.ljust(64), "twice"),
    "lone surrogate": (craft({"\ud800": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}}, b""), "Unicode"),
    "bad crc_num": (craft({"__metadata__": {"crc_num": "x1"}, "x": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}},
                          b"\0"), "not a CRC32"),
    "deep nesting": ((4000).to_bytes(8, "little") + b"[" * 4000, "JSON"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_names_the_file(tmp_path, case):
    data, problem = BAD[case]
    path = put(tmp_path / f"{case.replace(' ', '_')}.safetensors", data)
    with pytest.raises(SafetensorsFormatError, match=problem) as ei:
        SafetensorsReader(path)
    assert str(ei.value).startswith(path + ": ")


def test_truncated_valid_file(tmp_path):
    full = craft(_valid_header(), b"\1" * 18)
    for cut in (1, 7, 9, 20, len(full) - 18, len(full) - 1):
        path = put(tmp_path / f"cut{cut}.safetensors", full[:cut])
        with pytest.raises(SafetensorsFormatError) as ei:
            SafetensorsReader(path)
        assert path in str(ei.value)
    with pytest.raises(SafetensorsFormatError, match="tensor 'b'"):
        SafetensorsReader(put(tmp_path / "cut.safetensors", full[:-1]))


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(SafetensorsFormatError, match="not found"):
        SafetensorsReader(tmp_path / "absent.safetensors")
    with pytest.raises(SafetensorsFormatError, match="directory"):
        SafetensorsReader(tmp_path)


def _open_and_read_all(path):
    """Open and read everything; the only acceptable failure is SafetensorsFormatError."""
    with SafetensorsReader(path) as r:
        for name, e in r.entries.items():
            if e.dtype == "Int4":
                r.read_raw(name)
            else:
                r.read(name)


def _valid_file_bytes() -> bytes:
    tensors = {"w": ("Float32", raw_array("Float32", (3, 2))), "b": ("BFloat16", raw_array("BFloat16", (2,))),
               "q": ("Int8", raw_array("Int8", (4,))), "e": ("Int32", raw_array("Int32", (0,)))}
    return library_bytes(tensors, {"format": "ms", "crc_num": "1234"})


VALID = _valid_file_bytes()


@settings(max_examples=300, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.one_of(
        st.binary(max_size=200),
        st.tuples(st.integers(0, 300), st.binary(max_size=200)).map(lambda t: t[0].to_bytes(8, "little") + t[1]),
        st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), min_size=1, max_size=4).map(
            lambda muts: _mutate(VALID, muts)),
        st.integers(0, len(VALID)).map(lambda n: VALID[:n]),
    )
)
def test_fuzz_only_format_errors(tmp_path, data):
    path = put(tmp_path / "fuzz.safetensors", data)
    try:
        _open_and_read_all(path)
    except SafetensorsFormatError as e:
        assert path in str(e)


def _mutate(base: bytes, muts) -> bytes:
    b = bytearray(base)
    for pos, val in muts:
        b[pos] = val
    return bytes(b)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 40) | st.floats(allow_nan=True) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
tensor_infos = st.fixed_dictionaries(
    {"dtype": st.sampled_from(["F32", "I8", "BF16", "U64", "BOOL", "F8_E5M2", "Q9", 3]),
     "shape": st.lists(st.integers(-1, 4), max_size=3) | json_values,
     "data_offsets": st.lists(st.integers(-1, 40), min_size=0, max_size=3) | json_values},
)


@settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    header=st.dictionaries(st.sampled_from(["a", "b", "c", "__metadata__"]), tensor_infos | json_values, max_size=4),
    data_len=st.integers(0, 48),
)
def test_fuzz_structured_headers(tmp_path, header, data_len):
    path = put(tmp_path / "hdr.safetensors", craft(header, bytes(range(data_len))))
    try:
        _open_and_read_all(path)
    except SafetensorsFormatError as e:
        assert path in str(e)


# ---------------------------------------------------------------------- reading only what is needed


def test_box_of_a_large_tensor_reads_only_the_box(tmp_path, monkeypatch):
    # a 1 GiB tensor in a sparse file: only the header and the box's rows are ever requested
    rows, cols = 16384, 16384
    nbytes = rows * cols * 4
    header = json.dumps({"big": {"dtype": "F32", "shape": [rows, cols], "data_offsets": [0, nbytes]}},
                        separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    path = tmp_path / "big.safetensors"
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        start = f.tell()
        f.seek(start + 100 * cols * 4)
        f.write(np.arange(2 * cols, dtype=np.float32).tobytes())  # rows 100 and 101
        f.truncate(start + nbytes)

    requested = []
    real_preadv = os.preadv

    def counting_preadv(fd, buffers, offset, *args):
        requested.append(sum(memoryview(b).nbytes for b in buffers))
        return real_preadv(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", counting_preadv)
    with SafetensorsReader(path) as r:
        opened = sum(requested)
        got = r.read_box("big", ((100, 102), (0, cols)))
        assert np.array_equal(got.reshape(-1), np.arange(2 * cols, dtype=np.float32))
        part = r.read_box("big", ((101, 102), (cols - 8192, cols)))
        assert np.array_equal(part[0], np.arange(cols + cols - 8192, 2 * cols, dtype=np.float32))
    assert opened <= 8 + len(header)
    assert sum(requested) - opened == 2 * cols * 4 + 8192 * 4


def test_replica_files_compare_by_whole_columns(tmp_path):
    """The planner compares the names and entries of every source rank: a safetensors reader
    answers for its whole columns (its names as a dict view, set operations in C) and tells a file
    of other names, order, dtype or shape apart from a replica (its data may differ)."""
    from reshard_job.formats.index import IndexView

    def saved(name, tensors):
        save_file(str(tmp_path / name), tensors)
        return SafetensorsReader(str(tmp_path / name))

    a = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(4, np.float16)}
    base = saved("base.safetensors", a)
    replica = saved("replica.safetensors", {"w": np.ones((2, 3), np.float32), "b": np.ones(4, np.float16)})
    others = [saved("shape.safetensors", {"w": np.zeros((3, 2), np.float32), "b": a["b"]}),
              saved("dtype.safetensors", {"w": a["w"], "b": np.zeros(2, np.float32)}),
              saved("name.safetensors", {"w": a["w"], "c": a["b"]}),
              saved("fewer.safetensors", {"w": a["w"]})]
    assert type(base.name_keys()) is type({}.keys()) and base.name_keys() == {"w", "b"}
    assert IndexView(base).keys() == IndexView(replica).keys()
    assert base.same_entries(replica) and replica.same_entries(base)
    assert IndexView(base).same_entries(IndexView(replica))
    for other in others:
        assert not base.same_entries(other) and not other.same_entries(base), other.path


def test_record_ranges_are_the_whole_spans_as_a_table(tmp_path):
    """The hash pass takes each tensor's data range from the columns at once: the same ranges
    ``whole_span`` gives, and None where a name is absent or a tensor is not plain data."""
    tensors = {f"t{i}": np.full((i % 3 + 1, 2), i, np.float32 if i % 2 else np.float16) for i in range(12)}
    tensors["empty"] = np.zeros((0, 4), np.float32)
    save_file(str(tmp_path / "a.safetensors"), tensors)
    with SafetensorsReader(str(tmp_path / "a.safetensors")) as r:
        names = ["t5", "empty", "t0", "t11", "t5"]
        got = r.record_ranges(names)
        assert got.dtype == np.int64 and got.shape == (5, 2)
        assert got.tolist() == [[r.whole_span(n)[2], r.whole_span(n)[3]] for n in names]
        assert r.record_ranges(["t1", "absent"]) is None and r.record_ranges([]).shape == (0, 2)
    with SafetensorsWriter(tmp_path / "b.safetensors") as w:
        w.add("w", np.zeros(4, np.int8), "Int4")
    with SafetensorsReader(w.result.path) as r:
        assert r.whole_span("w") is None and r.record_ranges(["w"]) is None
