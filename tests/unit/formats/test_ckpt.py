"""The `.ckpt` reader and writer (spec/checkpoint-format.md): byte compatibility with MindSpore's
files and with protobuf's own serializer, both chunking schemes, boxes, strings, the CRC trailer,
and clean errors on bad input."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import zlib
from math import prod
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from reshard_job.errors import CheckpointFormatError, ReshardError
from reshard_job.formats import tensorfile
import reshard_job.core.dtypes as dtypes
import reshard_job.formats.proto_schema as schema
from reshard_job.formats.ckpt import CRC_MAGIC, CRC_TRAILER_LEN, CheckpointReader, CheckpointWriter, record_header
from reshard_job.formats.rewrite import copy_checkpoint
from reshard_job.formats.ckpt.records import MAX_RECORDS_PER_TENSOR

GOLDEN = Path(__file__).resolve().parents[2] / "golden"
GOLDEN_CKPTS = sorted(GOLDEN.glob("*/*/rank_*/*.ckpt"))

SLICEABLE = sorted(n for n, d in dtypes.BY_NAME.items() if d.storage is not None)
FAST = settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])


def proto_record(name: str, dims, dtype: str, content: bytes) -> bytes:
    """One record exactly as MindSpore writes it: a Checkpoint holding one Value, serialized by protobuf."""
    msg = schema.Checkpoint()
    v = msg.value.add()
    v.tag = name
    v.tensor.dims.extend(dims)
    v.tensor.tensor_type = dtype
    v.tensor.tensor_content = content
    return msg.SerializeToString()


def write_file(path, data: bytes) -> str:
    Path(path).write_bytes(data)
    return str(path)


@st.composite
def arrays(draw, dtype_names=SLICEABLE, max_dims=3, max_side=6):
    """(MindSpore dtype name, array of its storage dtype with arbitrary bytes: NaNs, bf16 words...)."""
    name = draw(st.sampled_from(dtype_names))
    storage = dtypes.BY_NAME[name].storage
    shape = tuple(draw(st.lists(st.integers(0, max_side), max_size=max_dims)))
    n = prod(shape)
    if name == "Bool":  # MindSpore's bools are bytes 0/1
        raw = bytes(draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)))
    else:
        raw = draw(st.binary(min_size=n * storage.itemsize, max_size=n * storage.itemsize))
    return name, np.frombuffer(raw, dtype=storage).reshape(shape)


# ================================================================================ golden files


@functools.lru_cache(maxsize=None)
def golden_manifest(scenario: Path) -> dict:
    return json.loads((scenario / "manifest.json").read_text())


def golden_manifest_entry(path: Path) -> dict:
    """The manifest's record (name -> shape, dtype, sha256, records) for a golden checkpoint file."""
    scenario = path.parents[2]
    kind = path.parents[1].name  # src_checkpoints | expected
    rank = path.parent.name.removeprefix("rank_")
    manifest = golden_manifest(scenario)
    return manifest["src_checkpoints" if kind == "src_checkpoints" else "expected"][rank]


def test_golden_files_are_present():
    assert len(GOLDEN_CKPTS) >= 50


@pytest.mark.parametrize("path", GOLDEN_CKPTS, ids=lambda p: str(p.relative_to(GOLDEN)))
def test_golden_checkpoint_reads_and_rewrites_byte_identical(path, tmp_path):
    want = golden_manifest_entry(path)
    with CheckpointReader(path) as r:
        assert list(r.entries) == list(want)
        for name, e in want.items():
            entry = r.entries[name]
            assert entry.dtype == e["dtype"]
            assert list(entry.shape) == e["shape"]
            assert len(r.records_of(entry)) == e["records"]
            assert hashlib.sha256(r.read_raw(name)).hexdigest() == e["sha256"], name
        written = copy_checkpoint(r, tmp_path / "copy.ckpt")
    original = path.read_bytes()
    assert written.sha256 == hashlib.sha256(original).hexdigest()
    assert (tmp_path / "copy.ckpt").read_bytes() == original
    assert written.tensors == {n: e["sha256"] for n, e in want.items()}


# ================================================================================ encoding


names = st.one_of(
    st.text(max_size=40),
    st.text(alphabet="ab-._/0123456789", min_size=1, max_size=20),
    st.text(min_size=130, max_size=400),  # length prefixes of two bytes
    st.sampled_from(["", "-", "0-layer1.weight", "layers.0.ffn-w1", "héllo", "名字", "emoji\U0001F600", "a" * 20000]),
)
dims_lists = st.lists(st.one_of(st.integers(0, 8), st.integers(0, 2**62), st.integers(-(2**63), 2**63 - 1)),
                      max_size=6)
dtype_names = st.sampled_from(sorted(dtypes.BY_NAME) + [dtypes.STR_TYPE])


@FAST
@given(name=names, dims=dims_lists, dtype=dtype_names, content=st.binary(max_size=300))
@example(name="a", dims=[3, 700], dtype="Float32", content=b"")  # spec §1's worked bytes, header part
@example(name="scalar", dims=[], dtype="Int64", content=b"\x01" * 8)
@example(name="s", dims=[0], dtype="str", content="héllo".encode("utf-32-le"))
def test_record_header_equals_protobuf_serialization(name, dims, dtype, content):
    ours = record_header(name, dims, dtype, len(content)) + content
    assert ours == proto_record(name, dims, dtype, content)


def test_record_header_matches_spec_bytes():
    # spec §1: first record of a [3,700] Float32 tensor "a" written with 1 KiB slices
    want = bytes.fromhex("0a9708" "0a0161" "129108" "0803" "08bc05" "1207") + b"Float32" + bytes.fromhex("1a8008")
    assert record_header("a", [3, 700], "Float32", 1024) == want


# ================================================================================ round trips


@FAST
@given(arr=arrays(), crc=st.booleans())
def test_tensor_round_trip_every_dtype(tmp_path_factory, arr, crc):
    name, a = arr
    path = tmp_path_factory.mktemp("rt") / "t.ckpt"
    with CheckpointWriter(path, crc=crc) as w:
        digest = w.add("p", a, name)
    assert digest == hashlib.sha256(a.tobytes()).hexdigest()
    with CheckpointReader(path) as r:
        e = r.entries["p"]
        assert e.dtype == name
        assert e.shape == a.shape
        got = r.read("p")
        assert got.dtype == dtypes.BY_NAME[name].storage  # BFloat16 stays uint16 words, never upcast
        assert got.tobytes() == a.tobytes()  # bit-exact, NaN payloads included
        assert r.has_crc == crc


def test_bfloat16_words_are_kept_exactly(tmp_path):
    values = np.array([1.5, -2.25, 3.0], dtype=np.float32)
    words = dtypes.float32_to_bf16(values)
    assert words.tobytes() == bytes.fromhex("C03F10C04040")  # spec §4
    odd = np.array([0x7FC1, 0xFFFF, 0x0001, 0x8000], dtype=np.uint16)  # NaN payload, -NaN, subnormal, -0
    with CheckpointWriter(tmp_path / "b.ckpt") as w:
        w.add("w", words, "BFloat16")
        w.add("odd", odd, "BFloat16")
    with CheckpointReader(tmp_path / "b.ckpt") as r:
        assert r.entries["w"].dtype == "BFloat16"
        assert r.read("w").dtype == np.uint16
        assert np.array_equal(dtypes.bf16_to_float32(r.read("w")), values)
        assert r.read("odd").tobytes() == odd.tobytes()


def test_writer_never_guesses_bfloat16(tmp_path):
    with CheckpointWriter(tmp_path / "u.ckpt") as w:
        w.add("u", np.arange(4, dtype=np.uint16))
    with CheckpointReader(tmp_path / "u.ckpt") as r:
        assert r.entries["u"].dtype == "UInt16"


@FAST
@given(arr=arrays(max_side=12), chunk=st.sampled_from([1, 3, 8, 64, 1024]))
def test_raw_byte_chunking_round_trip(tmp_path_factory, arr, chunk):
    """§3.1: consecutive pieces of exactly `chunk` bytes, the last the remainder, each with full dims."""
    name, a = arr
    chunk = max(chunk, -(-a.nbytes // MAX_RECORDS_PER_TENSOR))  # more records than that are refused as hostile
    path = tmp_path_factory.mktemp("chunk") / "c.ckpt"
    with CheckpointWriter(path, chunk_bytes=chunk) as w:
        w.add("p", a, name)
    nbytes = a.nbytes
    want = [chunk] * (nbytes // chunk) + ([nbytes % chunk] if nbytes % chunk else [])
    want = want or [0]
    expected = b"".join(proto_record("p", a.shape, name, a.tobytes()[o: o + n])
                        for o, n in zip(np.cumsum([0] + want[:-1]), want))
    assert path.read_bytes() == expected
    with CheckpointReader(path) as r:
        recs = r.records_of(r.entries["p"])
        assert [x.content_len for x in recs] == want
        assert all(x.dims == tuple(a.shape) for x in recs)
        assert r.read("p").tobytes() == a.tobytes()


def test_spec_chunking_example(tmp_path):
    """§3.1 verified example: 3x700 Float32 with 1 KiB slices -> 8 records of 1024 B and one of 208 B."""
    a = np.arange(2100, dtype=np.float32).reshape(3, 700)
    with CheckpointWriter(tmp_path / "c.ckpt", chunk_bytes=1024) as w:
        w.add("a", a)
    with CheckpointReader(tmp_path / "c.ckpt") as r:
        assert [x.content_len for x in r.records_of(r.entries["a"])] == [1024] * 8 + [208]
        assert np.array_equal(r.read("a"), a)


def array_split_pieces(a: np.ndarray, count: int) -> list[bytes]:
    return [np.ascontiguousarray(p).tobytes() for p in np.array_split(a, count)]


@FAST
@given(arr=arrays(max_dims=3, max_side=5).filter(lambda t: t[1].ndim >= 1), count=st.integers(1, 9))
def test_array_split_chunking_is_read(tmp_path_factory, arr, count):
    """§3.2: numpy array_split along axis 0, possibly with empty pieces, each a record with full dims."""
    name, a = arr
    pieces = array_split_pieces(a, count)
    d = tmp_path_factory.mktemp("split")
    by_hand = write_file(d / "hand.ckpt", b"".join(proto_record("p", a.shape, name, p) for p in pieces))
    with CheckpointWriter(d / "ours.ckpt") as w:
        sink = w.begin("p", name, a.shape, chunk_sizes=[len(p) for p in pieces])
        sink.write(a.tobytes())
        sink.close()
    assert (d / "ours.ckpt").read_bytes() == Path(by_hand).read_bytes()
    with CheckpointReader(by_hand) as r:
        assert len(r.records_of(r.entries["p"])) == count
        assert r.read("p").tobytes() == a.tobytes()
        copy_checkpoint(r, d / "copy.ckpt")
    assert (d / "copy.ckpt").read_bytes() == Path(by_hand).read_bytes()


def test_spec_array_split_example(tmp_path):
    """§3.2 verified example: 3x700 Float32 split 9 ways -> 3 records of 2800 B and 6 empty ones."""
    a = np.arange(2100, dtype=np.float32).reshape(3, 700)
    pieces = array_split_pieces(a, 9)
    assert [len(p) for p in pieces] == [2800] * 3 + [0] * 6
    path = write_file(tmp_path / "s.ckpt", b"".join(proto_record("a", [3, 700], "Float32", p) for p in pieces))
    with CheckpointReader(path) as r:
        assert np.array_equal(r.read("a"), a)
        assert np.array_equal(r.read_box("a", ((1, 3), (100, 107))), a[1:3, 100:107])


@st.composite
def array_and_box(draw):
    name, a = draw(arrays(max_dims=4, max_side=7))
    box = []
    for n in a.shape:
        lo = draw(st.integers(0, n))
        hi = draw(st.integers(lo, n))
        box.append((lo, hi))
    return name, a, tuple(box)


@FAST
@given(t=array_and_box(), chunk=st.sampled_from([1, 5, 16, 1 << 20]), min_run=st.sampled_from([0, 4, 8 * 1024]),
       span=st.sampled_from([8, 16 * 1024 * 1024]), into=st.booleans())
def test_read_box_equals_numpy_slicing(tmp_path_factory, t, chunk, min_run, span, into):
    """Across record boundaries and through both read paths (direct runs and in-memory spans)."""
    name, a, box = t
    path = tmp_path_factory.mktemp("box") / "b.ckpt"
    chunk = max(chunk, -(-a.nbytes // MAX_RECORDS_PER_TENSOR))  # a reader refuses more records than that
    with CheckpointWriter(path, chunk_bytes=chunk) as w:
        w.add("p", a, name)
    want = a[tuple(slice(lo, hi) for lo, hi in box)]
    with mock.patch.object(tensorfile, "MIN_DIRECT_RUN", min_run), mock.patch.object(tensorfile, "SPAN_BUFFER", span):
        with CheckpointReader(path) as r:
            if into:
                out = np.full(want.shape, 0, dtype=a.dtype)
                got = r.read_box("p", box, out=out)
                assert got is out
            else:
                got = r.read_box("p", box)
    assert got.shape == want.shape
    assert got.tobytes() == want.tobytes()


def test_read_box_outside_the_tensor_is_refused(tmp_path):
    with CheckpointWriter(tmp_path / "b.ckpt") as w:
        w.add("p", np.zeros((2, 3), np.float32))
    with CheckpointReader(tmp_path / "b.ckpt") as r:
        with pytest.raises(ReshardError, match="outside parameter 'p'"):
            r.read_box("p", ((0, 3), (0, 3)))
        with pytest.raises(ReshardError):
            r.read_box("p", ((0, 2),))


def test_multiple_tensors_keep_file_order_and_later_group_wins(tmp_path):
    recs = [proto_record("b", [2], "Int8", b"\x01\x02"), proto_record("a", [], "Float32", b"\0\0\x80?"),
            proto_record("b", [1], "Int8", b"\x07")]
    path = write_file(tmp_path / "o.ckpt", b"".join(recs))
    with CheckpointReader(path) as r:
        # MindSpore's loader: a tag seen again later starts a new group that replaces the earlier one
        assert list(r.entries) == ["a", "b"]
        assert r.read("b").tolist() == [7]
        assert [g.name for g in r.groups] == ["b", "a", "b"]
        copy_checkpoint(r, tmp_path / "copy.ckpt")
    assert (tmp_path / "copy.ckpt").read_bytes() == Path(path).read_bytes()


def test_dims_zero_with_one_element_is_a_scalar(tmp_path):
    """§3.3: dims [0] reads as a scalar (MindSpore's loader turns [0] into [])."""
    path = write_file(tmp_path / "z.ckpt", proto_record("x", [0], "Int32", b"\x05\0\0\0"))
    with CheckpointReader(path) as r:
        assert r.entries["x"].shape == ()
        assert r.read("x").tolist() == 5


# ================================================================================ strings


@FAST
@given(text=st.text(max_size=60), name=names)
def test_str_entries(tmp_path_factory, text, name):
    path = tmp_path_factory.mktemp("str") / "s.ckpt"
    with CheckpointWriter(path) as w:
        w.add("before", np.arange(3, dtype=np.int32))
        w.add_str(name, text)
    content = text.encode("utf-32-le")
    assert path.read_bytes().endswith(proto_record(name, [0], "str", content))
    with CheckpointReader(path) as r:
        assert r.kind(name) == "str"
        assert r.entries[name].dtype == "str"
        assert r.read_str(name) == text
        assert r.value(name) == text
        assert r.records_of(r.entries[name])[-1].dims == (0,)
        copy_checkpoint(r, path.with_name("copy.ckpt"))
    assert path.with_name("copy.ckpt").read_bytes() == path.read_bytes()


def test_str_spec_example(tmp_path):
    path = write_file(tmp_path / "s.ckpt", proto_record("k", [0], "str", "héllo".encode("utf-32-le")))
    assert len("héllo".encode("utf-32-le")) == 20
    with CheckpointReader(path) as r:
        assert r.value("k") == "héllo"


def test_str_with_bad_length_is_a_format_error(tmp_path):
    path = write_file(tmp_path / "s.ckpt", proto_record("k", [0], "str", b"abc"))
    with pytest.raises(CheckpointFormatError, match="s.ckpt"):
        CheckpointReader(path)


# ================================================================================ CRC trailer


def test_crc_trailer_written_and_verified(tmp_path):
    path = tmp_path / "c.ckpt"
    with CheckpointWriter(path, crc=True, chunk_bytes=64) as w:
        w.add("a", np.arange(100, dtype=np.float32))
        w.add_str("s", "text")
    data = path.read_bytes()
    body, trailer = data[:-CRC_TRAILER_LEN], data[-CRC_TRAILER_LEN:]
    assert trailer[:7] == CRC_MAGIC == b"crc_num"
    assert trailer[7:] == zlib.crc32(body).to_bytes(10, "big")
    assert trailer[7:13] == bytes(6)
    with CheckpointReader(path) as r:
        assert r.has_crc and r.crc_stored == zlib.crc32(body)
        r.verify_crc()
        assert np.array_equal(r.read("a"), np.arange(100, dtype=np.float32))
        copy_checkpoint(r, tmp_path / "copy.ckpt")  # keeps the trailer
    assert (tmp_path / "copy.ckpt").read_bytes() == data


def test_no_crc_by_default(tmp_path):
    with CheckpointWriter(tmp_path / "n.ckpt") as w:
        w.add("a", np.arange(3, dtype=np.int8))
    assert CRC_MAGIC not in (tmp_path / "n.ckpt").read_bytes()
    with CheckpointReader(tmp_path / "n.ckpt") as r:
        assert not r.has_crc


@pytest.mark.parametrize("where", ["content", "trailer"])
def test_crc_mismatch_names_the_file(tmp_path, where):
    path = tmp_path / "c.ckpt"
    a = np.arange(64, dtype=np.float32)
    with CheckpointWriter(path, crc=True) as w:
        w.add("a", a)
    data = bytearray(path.read_bytes())
    pos = data.index(a.tobytes()) + 13 if where == "content" else len(data) - 1
    data[pos] ^= 0x01
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointFormatError, match="CRC") as ei:
        CheckpointReader(path)
    assert str(path) in str(ei.value)
    with CheckpointReader(path, verify_crc=False) as r:  # the check can be skipped on request
        assert r.has_crc


# ================================================================================ bad input


def assert_format_error(path, match: str | None = None):
    with pytest.raises(CheckpointFormatError) as ei:
        CheckpointReader(path)
    assert isinstance(ei.value, ReshardError)
    assert str(path) in str(ei.value)
    if match:
        assert match in str(ei.value)
    return ei.value


@pytest.fixture
def good_bytes(tmp_path) -> bytes:
    with CheckpointWriter(tmp_path / "good.ckpt", chunk_bytes=40) as w:
        w.add("weight", np.arange(30, dtype=np.float32).reshape(5, 6))
        w.add("step", np.array(3, dtype=np.int64))
    return (tmp_path / "good.ckpt").read_bytes()


def test_truncated_mid_record(tmp_path, good_bytes):
    for cut in (1, 2, 5, len(good_bytes) // 2, len(good_bytes) - 1):
        path = write_file(tmp_path / f"t{cut}.ckpt", good_bytes[:cut])
        assert_format_error(path)


def test_truncated_golden_file(tmp_path):
    data = GOLDEN_CKPTS[0].read_bytes()
    path = write_file(tmp_path / "g.ckpt", data[: len(data) - 100])
    assert_format_error(path, "truncated")


def test_zero_byte_file(tmp_path):
    assert_format_error(write_file(tmp_path / "empty.ckpt", b""), "empty")


def test_text_file_renamed_ckpt(tmp_path):
    assert_format_error(write_file(tmp_path / "notes.ckpt", b"these are my notes\nnot a checkpoint\n"),
                        "not a MindSpore checkpoint")


def test_missing_file_and_directory(tmp_path):
    assert_format_error(tmp_path / "nope.ckpt", "not found")
    (tmp_path / "dir.ckpt").mkdir()
    assert_format_error(tmp_path / "dir.ckpt")


def test_unknown_dtype(tmp_path):
    path = write_file(tmp_path / "u.ckpt", proto_record("x", [2], "Float8", b"\0\0"))
    assert_format_error(path, "Float8")


def test_dims_disagree_with_content(tmp_path):
    path = write_file(tmp_path / "d.ckpt", proto_record("x", [3, 4], "Float32", b"\0" * 40))
    err = assert_format_error(path, "'x'")
    assert "48" in str(err) and "40" in str(err)


def test_negative_dims(tmp_path):
    path = write_file(tmp_path / "n.ckpt", proto_record("x", [-1], "Float32", b""))
    assert_format_error(path, "negative")


def test_record_without_name(tmp_path):
    msg = schema.Checkpoint()
    v = msg.value.add()
    v.tensor.tensor_type = "Int8"
    v.tensor.tensor_content = b"\x01"
    path = write_file(tmp_path / "n.ckpt", msg.SerializePartialToString())
    assert_format_error(path, "without a parameter name")


@FAST
@given(data=st.binary(min_size=1, max_size=200), lead=st.booleans())
def test_random_bytes(tmp_path_factory, data, lead):
    if lead:
        data = b"\x0a" + data
    path = tmp_path_factory.mktemp("rnd") / "r.ckpt"
    path.write_bytes(data)
    try:
        r = CheckpointReader(path)
    except CheckpointFormatError as e:
        assert str(path) in str(e)
        return
    with r:  # a few random byte strings are valid checkpoints; reading them must not crash either
        for name in r.entries:
            try:
                r.value(name)
            except ReshardError as e:
                assert str(path) in str(e)


@pytest.fixture(scope="module")
def rich_checkpoint(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("rich") / "rich.ckpt"
    with CheckpointWriter(path, crc=True, chunk_bytes=24) as w:
        w.add("w", np.arange(12, dtype=np.float32).reshape(3, 4))
        w.add("b", np.arange(5, dtype=np.uint16), "BFloat16")
        w.add_str("s", "hi")
        part = [((2,), "int32", np.arange(2, dtype=np.int32).tobytes()),
                ((2, 2), "float32", np.zeros(4, np.float32).tobytes()),
                ((2,), "int32", bytes(8))]
        w.add_map("m", [part, part])
        w.add("step", np.array(7, dtype=np.int64))
    return path.read_bytes()


@settings(deadline=None, max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4),
       truncate=st.one_of(st.none(), st.integers(0, 10**6)), keep_crc=st.booleans())
def test_corrupted_files_never_raise_bare_errors(tmp_path_factory, rich_checkpoint, edits, truncate, keep_crc):
    """Mutations of a valid file (tensors, bf16, str, map tensor, CRC) either read or raise a
    ReshardError naming the file: never a bare protobuf, numpy or index error."""
    data = bytearray(rich_checkpoint if keep_crc else rich_checkpoint[:-CRC_TRAILER_LEN])
    for pos, byte in edits:
        data[pos % len(data)] = byte
    if truncate is not None:
        data = data[: truncate % (len(data) + 1)]
    path = tmp_path_factory.mktemp("mut") / "m.ckpt"
    path.write_bytes(bytes(data))
    try:
        with CheckpointReader(path) as r:
            for name in r.entries:
                try:
                    r.value(name)
                except ReshardError as e:
                    assert str(path) in str(e)
            copy_checkpoint(r, path.with_name("copy.ckpt"))
    except CheckpointFormatError as e:
        assert str(path) in str(e)


def test_map_tensor_round_trip(tmp_path):
    keys = np.array([3, 1], dtype=np.int32)
    values = np.arange(4, dtype=np.float32).reshape(2, 2)
    status = np.zeros(2, dtype=np.int32)
    part = [((2,), "int32", keys.tobytes()), ((2, 2), "float32", values.tobytes()), ((2,), "int32", status.tobytes())]
    with CheckpointWriter(tmp_path / "m.ckpt") as w:
        w.add_map("emb", [part, part])
    with CheckpointReader(tmp_path / "m.ckpt") as r:
        assert r.kind("emb") == "map"
        k, v, s = r.value("emb")
        assert k.tolist() == [3, 1, 3, 1]
        assert v.shape == (4, 2)
        copy_checkpoint(r, tmp_path / "copy.ckpt")
    assert (tmp_path / "copy.ckpt").read_bytes() == (tmp_path / "m.ckpt").read_bytes()


@pytest.mark.parametrize("parts", [4, 100_000])
def test_a_map_record_of_more_than_three_parts_is_refused_at_the_fourth(tmp_path, parts):
    """A map parameter of a million parts was walked whole (14 s) before being refused."""
    from reshard_job.formats.ckpt.records import map_record

    part = ((2,), "int32", bytes(8))
    path = tmp_path / "m.ckpt"
    path.write_bytes(map_record("emb", [part] * parts))
    with pytest.raises(ReshardError) as ei:
        CheckpointReader(path).close()
    assert str(ei.value) == (f"{path}: record at offset 0: map parameter: more than 3 parts (keys, values, status) "
                             "in one record")


# ================================================================================ writer behaviour


def test_writer_is_atomic_on_error(tmp_path):
    path = tmp_path / "a.ckpt"
    with pytest.raises(RuntimeError):
        with CheckpointWriter(path) as w:
            w.add("a", np.zeros(3, np.float32))
            raise RuntimeError("boom")
    assert not path.exists()
    assert list(tmp_path.iterdir()) == []


def test_writer_rejects_short_or_long_tensors(tmp_path):
    with CheckpointWriter(tmp_path / "a.ckpt") as w:
        sink = w.begin("a", "Float32", (2, 2))
        with pytest.raises(ValueError, match="more bytes"):
            sink.write(bytes(20))
        sink.write(bytes(8))
        with pytest.raises(ValueError, match="8 of 16"):
            sink.close()
        sink.write(bytes(8))
        sink.close()


def test_written_file_reports_sizes_and_hashes(tmp_path):
    a = np.arange(10, dtype=np.int16)
    with CheckpointWriter(tmp_path / "a.ckpt") as w:
        w.add("a", a)
    res = w.result
    data = (tmp_path / "a.ckpt").read_bytes()
    assert res.size == len(data)
    assert res.sha256 == hashlib.sha256(data).hexdigest()
    assert res.tensors == {"a": hashlib.sha256(a.tobytes()).hexdigest()}
    assert os.path.isabs(res.path)


def test_tensor_hashes_across_staging_buffers(tmp_path, monkeypatch):
    """Tensors that start, end and straddle the direct writer's staging buffers (8 MiB here), written
    in odd pieces, hash exactly their own bytes, and the file hash covers the whole file."""
    monkeypatch.setattr("reshard_job.storage.atomic.DIRECT_CHUNK", 8 << 20)
    from reshard_job.storage.atomic import DIRECT_CHUNK

    rng = np.random.default_rng(7)
    sizes = [DIRECT_CHUNK - 37, 3, DIRECT_CHUNK * 2 + 5, 1, 4096, DIRECT_CHUNK // 3]
    blobs = {f"t{i}": rng.integers(0, 256, n, dtype=np.uint8) for i, n in enumerate(sizes)}
    asked = {}
    with CheckpointWriter(tmp_path / "big.ckpt") as w:
        for i, (name, b) in enumerate(blobs.items()):
            if i == 2:  # through add(): the digest is wanted before the file is finished
                asked[name] = w.add(name, b)
                continue
            sink = w.begin(name, "UInt8", b.shape)
            for start in range(0, b.size, 1_000_003):
                sink.write(b[start:start + 1_000_003])
            sink.close()
    want = {name: hashlib.sha256(b.tobytes()).hexdigest() for name, b in blobs.items()}
    assert w.result.tensors == want
    assert list(w.result.tensors) == list(blobs)
    assert asked == {"t2": want["t2"]}
    assert w.result.sha256 == hashlib.sha256((tmp_path / "big.ckpt").read_bytes()).hexdigest()
    with CheckpointReader(tmp_path / "big.ckpt") as r:
        assert np.array_equal(r.read("t2"), blobs["t2"])


@pytest.mark.parametrize("data", [
    b"\n\x00",                          # an empty record: no name, nothing after it
    b"\n\x04\n\x00\x12\x00",            # a name and an empty tensor, ending with the file
    b"\n\x03\n\x00\x12",                # a tensor field cut after its key
    b"\n\x06\n\x00\x12\x02\x08\x05",    # a dims key whose value is the record's last byte
    b"\n\x05\n\x00\x12\x01\x08",        # a dims key and no value: the record ends first
])
def test_records_cut_short_at_the_end_of_the_file_are_format_errors(tmp_path, data):
    # The fast record parser reads ahead of each field's key: at the file's last byte that must
    # be a format error naming the file, never an IndexError.
    path = tmp_path / "short.ckpt"
    path.write_bytes(data)
    with pytest.raises(CheckpointFormatError, match="short.ckpt"):
        CheckpointReader(path).close()


# ================================================================================ many records alike


@st.composite
def record_runs(draw):
    """Records as MindSpore's loader sees them, drawn so that neighbours often share everything but
    the name (the indexer's shortcut) and sometimes the name too (a tensor in two chunks, a name
    given again later), with str entries and records of 128 bytes or more between them."""
    names = ["w", "x", "adam_m.w", "é"]
    shapes = [(2, 2), (2, 2), (4,), (70,)]
    out = []
    for _ in range(draw(st.integers(1, 24))):
        kind = draw(st.sampled_from(["tensor", "tensor", "tensor", "str", "chunks"]))
        name = "s" if kind == "str" else draw(st.sampled_from(names))
        if out and out[-1][0] == name:
            continue  # consecutive records of one name are one tensor's chunks: only "chunks" makes those
        if kind == "str":
            out.append((name, [], "str", draw(st.sampled_from(["", "abc"])).encode("utf-32-le")))
            continue
        shape = draw(st.sampled_from(shapes))
        content = bytes([draw(st.integers(0, 255))]) * (prod(shape) * 2)
        if kind == "chunks":  # two records of half the bytes each, both with the full dims
            half = len(content) // 2
            out += [(name, list(shape), "Float16", content[:half]), (name, list(shape), "Float16", content[half:])]
        else:
            out.append((name, list(shape), "Float16", content))
    return out


@FAST
@given(records=record_runs())
def test_index_of_records_alike_equals_protobufs_reading(tmp_path_factory, records):
    """Each group of consecutive records under one name is one entry, a later group replaces an
    earlier one, and every entry's bytes are those protobuf finds, however alike the records are."""
    data = b"".join(proto_record(*r) for r in records)
    path = write_file(tmp_path_factory.mktemp("alike") / "a.ckpt", data)
    groups: list[tuple[str, list]] = []
    for name, dims, dtype, content in records:
        if groups and groups[-1][0] == name:
            groups[-1][1].append((dims, dtype, content))
        else:
            groups.append((name, [(dims, dtype, content)]))
    last = {name: parts for name, parts in groups}
    order = [n for n in dict.fromkeys(reversed([g[0] for g in groups]))][::-1]
    with CheckpointReader(path) as r:
        assert [g.name for g in r.groups] == [g[0] for g in groups]
        assert list(r.entries) == order
        for name, parts in last.items():
            entry = r.entries[name]
            assert len(r.records_of(entry)) == len(parts)
            if parts[0][1] == "str":
                assert r.read_str(name) == parts[-1][2].decode("utf-32-le")
            else:
                assert entry.dtype == "Float16"
                assert entry.shape == tuple(parts[-1][0])
                assert r.read(name).tobytes() == b"".join(p[2] for p in parts)


def test_record_alike_but_for_a_trailing_field_is_read_as_protobuf_reads_it(tmp_path):
    """A record whose bytes after the name equal its neighbour's but which goes on (here a second
    tag field: protobuf keeps the last) must not be taken for its neighbour's twin."""
    content = b"\x01\x02\x03\x04"
    second = proto_record("b", [2], "Float16", content)
    retag = b"\x0a\x01z"  # Value field 1 again: the tag becomes "z"
    second = b"\x0a" + bytes([second[1] + len(retag)]) + second[2:] + retag
    data = proto_record("a", [2], "Float16", content) + second + proto_record("c", [2], "Float16", content)
    expected = schema.Checkpoint()
    expected.ParseFromString(data)
    assert [v.tag for v in expected.value] == ["a", "z", "c"]
    with CheckpointReader(write_file(tmp_path / "t.ckpt", data)) as r:
        assert list(r.entries) == ["a", "z", "c"]
        assert all(r.read(n).tobytes() == content for n in r.entries)


def test_files_alike_share_index_columns_and_still_read_their_own_bytes(tmp_path):
    """Ranks of a stage hold the same names, shapes and so offsets: their readers keep those
    columns once. A file that differs anywhere keeps its own, and every reader reads its own file."""
    def write(path, rows, fill):
        with CheckpointWriter(path) as w:
            for i in range(50):
                w.add(f"expert.{i}.w", np.full((rows, 3), fill + i, dtype=np.float16))
        return path

    a = write(tmp_path / "a.ckpt", 2, 0)
    b = write(tmp_path / "b.ckpt", 2, 100)  # same structure, other bytes
    c = write(tmp_path / "c.ckpt", 4, 200)  # same names, other shapes and offsets
    with CheckpointReader(a) as ra, CheckpointReader(b) as rb, CheckpointReader(c) as rc:
        assert rb._off is ra._off and rb._shape is ra._shape and rb._names is ra._names
        assert rc._off is not ra._off and rc._shape is not ra._shape and rc._names is ra._names
        for r, rows, fill in ((ra, 2, 0), (rb, 2, 100), (rc, 4, 200)):
            for i in (0, 49):
                assert r.read(f"expert.{i}.w").tolist() == np.full((rows, 3), fill + i, dtype=np.float16).tolist()


@pytest.fixture(scope="module")
def random_ckpt(tmp_path_factory):
    rng = np.random.default_rng(7)
    path = tmp_path_factory.mktemp("near") / "r.ckpt"
    with CheckpointWriter(path) as w:
        w.add("big", rng.integers(0, 255, size=(3 << 20) // 2, dtype=np.uint16).view(np.float16))
        for i in range(300):
            w.add(f"small.{i}", rng.integers(0, 255, size=3, dtype=np.uint16).view(np.float16))
    return str(path), Path(path).read_bytes()


@FAST
@given(reads=st.lists(st.tuples(st.integers(0, 3 << 20), st.integers(0, 70_000)), min_size=1, max_size=30),
       in_order=st.booleans())
def test_read_near_gives_the_files_bytes_in_any_order(random_ckpt, reads, in_order):
    """``read_near`` serves small reads from a read-ahead window: whatever the order and sizes,
    every view holds exactly the file's bytes there, and a read past the end is a format error."""
    path, data = random_ckpt
    if in_order:
        reads = sorted(reads)
    with CheckpointReader(path) as r:
        for offset, n in reads:
            if offset + n > len(data):
                with pytest.raises(CheckpointFormatError):
                    r.read_near(offset, n)
                continue
            assert bytes(r.read_near(offset, n)) == data[offset:offset + n]
        for name in ("small.0", "small.1", "small.299"):  # the many-small-tensors path: in file order
            _, _, offset, n = r.whole_span(name)
            assert bytes(r.read_near(offset, n)) == r.read(name).tobytes()


def test_a_tensor_in_more_records_than_any_real_file_has_is_refused_at_once(tmp_path):
    """MindSpore writes one record per 512 MiB of a tensor: 4096 records are a 2 TiB tensor. A file of
    millions of tiny same-name records is refused at the first record past that, naming file and
    parameter, instead of indexing (and holding) every one of them."""
    n = MAX_RECORDS_PER_TENSOR
    for count, refused in ((n, False), (n + 1, True)):
        path = tmp_path / f"c{count}.ckpt"
        data = np.arange(count, dtype=np.float32)
        with CheckpointWriter(path, mode=0o644) as w:
            w.add_bytes("chunked", "Float32", (count,), data, chunk_sizes=[4] * count)
        if refused:
            with pytest.raises(CheckpointFormatError) as e:
                CheckpointReader(path)
            assert str(e.value) == (f"{path}: parameter 'chunked': stored in more than {n} consecutive records "
                                    "(MindSpore writes one per 512 MiB of a tensor)")
        else:
            with CheckpointReader(path) as r:
                assert np.array_equal(r.read("chunked"), data)
                assert len(r.entries["chunked"].pieces) == count


@pytest.mark.parametrize("dims, needle", [
    ([0, 2**62, 2**62], "more than 2**63-1 bytes"),
    ([2**62, 0, 2**62, 2**62], "more than 2**63-1 bytes"),
    ([0] + [2**40] * 60, "more than 2**63-1 bytes"),
])
def test_zero_size_dims_beyond_any_array_are_refused_naming_the_parameter(tmp_path, dims, needle):
    """A zero-size tensor keeps its declared dims only where an array could have them (as in the
    safetensors and MindFormers readers): numpy refuses the rest, so the reader does, in one line."""
    path = write_file(tmp_path / "c.ckpt", proto_record("w", dims, "Float32", b""))
    with pytest.raises(CheckpointFormatError) as err:
        CheckpointReader(path).entries
    line = str(err.value)
    assert "'w'" in line and needle in line and str(tmp_path / "c.ckpt") in line
    assert "\n" not in line and len(line) < 400


def test_a_zero_size_ckpt_tensor_keeps_its_dims(tmp_path):
    path = write_file(tmp_path / "c.ckpt", proto_record("w", [0, 2**60], "Float32", b""))
    with CheckpointReader(path) as r:
        assert r.entries["w"].shape == (0, 2**60) and r.read("w").shape == (0, 2**60)


@pytest.mark.parametrize("magic, mode", [(0x7F3A5ED8, "AES-GCM"), (0x7F3A5ED9, "AES-CBC"), (0x7F3A5EDA, "SM4-CBC")])
def test_an_encrypted_checkpoint_is_named_as_such(tmp_path, magic, mode):
    """MindSpore's save_checkpoint(enc_key=...) starts each encrypted block with its mode's int32
    magic (little-endian): said as such, not as a file that is not a checkpoint."""
    body = magic.to_bytes(4, "little") + (48).to_bytes(4, "little") + os.urandom(300)
    path = write_file(tmp_path / "enc.ckpt", body)
    with pytest.raises(CheckpointFormatError) as err:
        CheckpointReader(path).entries
    line = str(err.value)
    assert line.startswith(path) and f"an encrypted checkpoint ({mode}" in line and "\n" not in line


def test_record_ranges_are_the_one_record_of_each_tensor_or_none(tmp_path):
    path = tmp_path / "c.ckpt"
    with CheckpointWriter(str(path), chunk_bytes=64) as w:
        w.add("a", np.arange(3, dtype=np.float32))
        w.add("b", np.arange(4, dtype=np.int64))
        w.add("chunked", np.arange(64, dtype=np.float32))  # 256 bytes in 64-byte records
        w.add_str("note", "hello")
    with CheckpointReader(str(path)) as r:
        ranges = r.record_ranges(["b", "a"])
        assert ranges.dtype == np.int64 and ranges.shape == (2, 2)
        assert list(map(tuple, ranges.tolist())) == [tuple(r.entries["b"].pieces[0]), tuple(r.entries["a"].pieces[0])]
        assert r.record_ranges(["a", "chunked"]) is None
        assert r.record_ranges(["a", "note"]) is None
        assert r.record_ranges(["a", "absent"]) is None


def test_a_str_entry_is_written_a_block_at_a_time_as_it_is_whole(tmp_path):
    """A 300 MB str entry was read, decoded and encoded again whole (726 MB): its UTF-32 bytes are
    copied in blocks, each checked, into the same record ``add_str`` writes."""
    text = "héllo 🌍 " * 3000
    raw = text.encode("utf-32-le")
    with CheckpointWriter(tmp_path / "whole.ckpt") as w:
        whole = w.add_str("s", text)
    with CheckpointWriter(tmp_path / "blocks.ckpt") as w:  # blocks that split characters
        blocks = w.add_str_blocks("s", [raw[i:i + 4099] for i in range(0, len(raw), 4099)], len(raw))
    assert blocks == whole and (tmp_path / "blocks.ckpt").read_bytes() == (tmp_path / "whole.ckpt").read_bytes()


def test_a_str_entry_that_is_not_utf32_is_refused_naming_file_and_parameter(tmp_path):
    from reshard_job.execute.rank_task import _write_str

    raw = ("abc" * 100).encode("utf-32-le")
    with CheckpointWriter(tmp_path / "bad.ckpt", crc=False) as w:
        w.add_str("s", "abc" * 100)
    data = bytearray((tmp_path / "bad.ckpt").read_bytes())
    at = data.find(raw[:16]) + 200
    data[at:at + 4] = b"\xff\xff\xff\xff"  # no code point
    (tmp_path / "bad.ckpt").write_bytes(bytes(data))
    with CheckpointReader(tmp_path / "bad.ckpt") as reader, CheckpointWriter(tmp_path / "out.ckpt") as w:
        with pytest.raises(ReshardError) as ei:
            _write_str(w, reader, "s")
    assert str(ei.value) == f"{tmp_path / 'bad.ckpt'}: parameter 's': str content is not valid UTF-32"
