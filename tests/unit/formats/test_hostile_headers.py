"""Hostile headers and JSON documents, reader by reader: the streaming JSON reader, safetensors
headers, MindFormers ``metadata.json`` and the export index. Each is refused in one line naming
the file and what is wrong (the job-level runs, with time and memory bounds, are in
``tests/fuzz/test_hostile_sources.py``)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard_job.core.sizes import shape_problem
from reshard_job.errors import FormatError, SafetensorsFormatError
from reshard_job.formats.hf_index import ExportIndex, check_against_index, read_index_document
from reshard_job.formats.mindformers_metadata import MindFormersFormatError, parse_metadata
from reshard_job.formats.multifile import MultiFileReader
from reshard_job.formats.safetensors import SafetensorsReader
from reshard_job.json_stream import REUSED, JsonProblem, JsonStream, loads_bounded

GOLDEN = Path(__file__).resolve().parents[2] / "golden"
M1A_METADATA = GOLDEN / "M1a_mf_llama_dp2mp2os_bf16_to_mp4" / "src_mindformers" / "iteration_00000020" / "metadata.json"
HUGE = "9" * 5000


# ================================================================================ JsonStream


def walk(text: str, chunk: int, max_value: int = 1 << 20) -> dict:
    stream = JsonStream(io.BytesIO(text.encode()).read, chunk=chunk, max_value=max_value)
    out = {key: value for key, value, _ in stream.items()}
    stream.end()
    return out


json_docs = st.dictionaries(st.text(max_size=8), st.recursive(
    st.none() | st.booleans() | st.integers(-10**19, 10**19) | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=12), max_size=6)


@settings(max_examples=200, deadline=None)
@given(doc=json_docs, chunk=st.integers(1, 64), indent=st.sampled_from([None, 0, 2]))
def test_the_stream_reads_what_json_loads_reads_whatever_the_windows(doc, chunk, indent):
    text = json.dumps(doc, indent=indent)
    assert walk(text, chunk) == json.loads(text)


def test_equal_values_are_reused_by_their_text():
    text = json.dumps({f"p{i}": {"shape": [4, 4], "dtype": "F32"} for i in range(50)}, separators=(",", ":"))
    known: dict[str, object] = {}
    stream = JsonStream(io.BytesIO(text.encode()).read, chunk=97)
    reused = 0
    for key, value, raw in stream.items(known):
        if value is REUSED:
            reused += 1
            value = known[raw]
        else:
            known[raw] = value
        assert value == {"shape": [4, 4], "dtype": "F32"}
    assert reused >= 25  # scanned once, not once per parameter (but where a window ends)


@pytest.mark.parametrize("text,needle", [
    ('{"a": ' + HUGE + "}", "integers of absurd length"),
    ('{"a": [1, ' + "1" * 21 + "]}", "integers of absurd length"),
    ('{"a": {"global_shape": [-' + HUGE + "]}}", "(under key 'global_shape')"),
    ('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    ('{"a": "' + "x" * 5000 + '"}', "a value of more than 1000 characters"),
    ('{"a": 1', "expecting ',' or '}'"),
    ('{"a": 1} {}', "extra data"),
    ('{"a": tru}', "not valid JSON"),
])
def test_the_stream_refuses_in_words(text, needle):
    with pytest.raises(JsonProblem, match=None) as ei:
        walk(text, 7, max_value=1000)
    assert needle in str(ei.value) and "\n" not in str(ei.value)


def test_digits_in_names_are_not_integers():
    name = "layer_" + "0" * 40
    assert walk(json.dumps({name: {"n": name}}), 5) == {name: {"n": name}}
    assert loads_bounded(json.dumps([name, 12345678901234567890])) == [name, 12345678901234567890]


# ================================================================================ shapes


@pytest.mark.parametrize("shape,itemsize,problem", [
    ((0, 2**64), 4, "does not fit an int64"),
    ((0, 2**62), 4, "more than 2**63-1 bytes"),
    ((0, 2**62, 2**62), 1, "more than 2**63-1 bytes"),
    ((3, -1), 1, "not a non-negative integer"),
    ((0, 2**60), 4, None),
    ((2**31, 2**31), 1, None),
    ((), 8, None),
])
def test_shape_problem(shape, itemsize, problem):
    found = shape_problem(shape, itemsize)
    assert (found is None) if problem is None else (problem in found)


# ================================================================================ safetensors


def craft(path: Path, header: bytes, body: bytes = b"") -> str:
    header += b" " * (-len(header) % 8)
    path.write_bytes(len(header).to_bytes(8, "little") + header + body)
    return str(path)


@pytest.mark.parametrize("shape,problem", [
    ("[0, 18446744073709551616]", "does not fit an int64"),
    ("[0, 4611686018427387904, 4611686018427387904]", "more than any array can hold"),
    ("[" + ", ".join(["0"] * 65) + "]", "65 dims"),
    ("[0, " + HUGE + "]", "integers of absurd length"),
])
def test_safetensors_shapes_beyond_any_array_name_file_and_tensor(tmp_path, shape, problem):
    path = craft(tmp_path / "x.safetensors", b'{"w":{"dtype":"F32","shape":' + shape.encode() + b',"data_offsets":[0,0]}}')
    with pytest.raises(SafetensorsFormatError) as ei:
        SafetensorsReader(path)
    assert str(ei.value).startswith(f"{path}: ") and "'w'" in str(ei.value) and problem in str(ei.value)


@pytest.mark.parametrize("rows", [1, 40])  # one entry, and a run of alike entries read as one
def test_safetensors_data_offsets_past_any_file_name_file_and_tensor(tmp_path, rows):
    """[2^63, 2^63 + 8] overflowed the int64 column: an OverflowError traceback."""
    entries = [f'"w{i}":{{"dtype":"F32","shape":[2],"data_offsets":[{i * 8},{i * 8 + 8}]}}' for i in range(rows)]
    entries[-1] = f'"bad":{{"dtype":"F32","shape":[2],"data_offsets":[{2**63},{2**63 + 8}]}}'
    path = craft(tmp_path / "x.safetensors", ("{" + ",".join(entries) + "}").encode(), bytes(8 * rows))
    with pytest.raises(SafetensorsFormatError) as ei:
        SafetensorsReader(path)
    assert str(ei.value) == f"{path}: tensor 'bad': data_offsets begin at {2**63}, beyond any file"


@pytest.mark.parametrize("crc", ["9" * 5000, "4294967296", "12a"])
def test_a_safetensors_crc_num_that_is_no_crc32_is_one_line(tmp_path, crc):
    """A 5,000-digit crc_num was Python's int-conversion ValueError, unnamed."""
    header = '{"__metadata__":{"crc_num":"' + crc + '"},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
    path = craft(tmp_path / "x.safetensors", header.encode(), bytes(8))
    with pytest.raises(SafetensorsFormatError) as ei:
        with SafetensorsReader(path) as r:
            r.stored_crc()
    assert str(ei.value).startswith(f"{path}: metadata crc_num '{crc[:20]}") and len(str(ei.value)) < 400
    assert str(ei.value).endswith("is not a CRC32 value")


def test_a_zero_size_safetensors_tensor_keeps_its_dims(tmp_path):
    path = craft(tmp_path / "x.safetensors", b'{"w":{"dtype":"F32","shape":[0,1152921504606846976],"data_offsets":[0,0]}}')
    with SafetensorsReader(path) as r:
        assert r.entries["w"].shape == (0, 2**60) and r.read("w").shape == (0, 2**60)


def test_many_tensors_are_columns_and_entries_are_built_on_demand(tmp_path):
    n = 20_000
    header = {f"t{i}": {"dtype": "F32", "shape": [2], "data_offsets": [8 * i, 8 * i + 8]} for i in range(n)}
    path = craft(tmp_path / "many.safetensors", json.dumps(header).encode(), bytes(8 * n))
    with SafetensorsReader(path) as r:
        assert len(r.entries) == n and r.describe("t7") == ("Float32", (2,), "tensor", 8)
        assert r.entries["t7"].pieces == [(r.data_start + 56, 8)]
        assert r.entries["t7"].shape is r.entries["t8"].shape  # equal shapes: one tuple
    with MultiFileReader([path, craft(tmp_path / "b.safetensors", b'{"z":{"dtype":"U8","shape":[1],'
                                                                  b'"data_offsets":[0,1]}}', b"\x07")]) as m:
        assert m.read("z").tolist() == [7] and m.entries["z"].pieces[0][0] > r.size


# ================================================================================ metadata.json


@pytest.mark.parametrize("before,after,needle", [
    ('"global_shape":[32,32]', '"global_shape":[' + HUGE + ",32]", "'global_shape'"),
    ('"axis_fragmentations":[4,1]', '"axis_fragmentations":[' + HUGE + ",1]", "'axis_fragmentations'"),
    ('"device_matrix":[2,2]', '"device_matrix":[2,' + HUGE + "]", "'device_matrix'"),
    ('"rank_list":[0,1,2,3]', '"rank_list":[0,1,2,' + HUGE + "]", "'rank_list'"),
    ('"storage_rank":0', '"storage_rank":' + HUGE, "'storage_rank'"),
    ('"replica_id":[0,0,0,0]', '"replica_id":[' + HUGE + "]", "'replica_id'"),
])
def test_absurd_integers_anywhere_in_metadata_name_the_key(before, after, needle):
    text = M1A_METADATA.read_text()
    assert before in text
    with pytest.raises(MindFormersFormatError) as ei:
        parse_metadata(text.replace(before, after, 1).encode(), "metadata.json")
    msg = str(ei.value)
    assert msg.startswith("metadata.json: ") and "integers of absurd length" in msg and needle in msg, msg
    assert len(msg) < 400


@pytest.mark.parametrize("shape,problem", [
    ([0, 2**62], "more than any array can hold"),  # bfloat16: 2**63 bytes over its non-zero dims
    ([0, 2**64], "does not fit an int64"),
])
def test_metadata_global_shapes_beyond_any_array_are_refused(shape, problem):
    doc = json.loads(M1A_METADATA.read_text())
    p = doc["state_dict_metadata"]["lm_head.weight"]
    p["global_shape"] = shape
    for c in p["chunk"]:
        c["local_shape"] = [shape[0] // 4, shape[1]]
    with pytest.raises(MindFormersFormatError) as ei:
        parse_metadata(json.dumps(doc).encode(), "metadata.json")
    assert "'lm_head.weight': global_shape" in str(ei.value) and problem in str(ei.value)


def test_duplicate_parameters_and_storage_keys_are_refused():
    text = M1A_METADATA.read_text()
    start = text.index('"lm_head.weight":')
    entry = text[start:text.index('"adam_m.lm_head.weight":')]
    with pytest.raises(MindFormersFormatError, match="describes parameter 'lm_head.weight' twice"):
        parse_metadata(text.replace(entry, entry + entry, 1).encode(), "metadata.json")
    key = json.dumps(str(("lm_head.weight", (0,))))
    start = text.index(key)
    entry = text[start:text.index("}]", start) + 2] + ","
    with pytest.raises(MindFormersFormatError, match="storage_data has two keys for it"):
        parse_metadata(text.replace(entry, entry + entry, 1).encode(), "metadata.json")


def test_metadata_read_in_small_windows_is_the_same():
    data = M1A_METADATA.read_bytes()
    whole = parse_metadata(data, "metadata.json")
    from reshard_job.formats.mindformers_metadata import read_metadata

    source = io.BytesIO(data)
    windowed = read_metadata(lambda n: source.read(min(n, 13)), "metadata.json")
    assert list(windowed) == list(whole)
    for name, p in whole.items():
        q = windowed[name]
        assert (q.dtype, q.global_shape, q.fragments, q.layout, q.local_shape, q.locations) == (
            p.dtype, p.global_shape, p.fragments, p.layout, p.local_shape, p.locations)


# ================================================================================ the export index


def index_doc(**metadata) -> bytes:
    return json.dumps({"metadata": metadata, "weight_map": {"w": "model-00001-of-00001.safetensors"}}).encode()


@pytest.mark.parametrize("data,needle", [
    (index_doc(total_size=int(HUGE[:30])), "integers of absurd length"),
    (index_doc(total_size=-1), "non-negative number of bytes"),
    (index_doc(total_size="8"), "non-negative number of bytes"),
    (b'{"weight_map": {"w": "a.safetensors", "w": "b.safetensors"}}', "lists tensor 'w' twice"),
    (b'{"weight_map": {"w": "/etc/passwd"}}', "not a file of the export folder"),
    (b'{"weight_map": {"w": "sub/../x.safetensors"}}', "not a file of the export folder"),
    (b'{"weight_map": {"w": 3}}', "'weight_map' of tensor names to file names"),
    (b"", "is empty"),
])
def test_bad_indexes_name_the_file(data, needle):
    with pytest.raises(FormatError) as ei:
        read_index_document(io.BytesIO(data).read, "model.safetensors.index.json")
    assert str(ei.value).startswith("model.safetensors.index.json: ") and needle in str(ei.value)


def test_total_size_is_checked_against_the_shards(tmp_path):
    path = craft(tmp_path / "model-00001-of-00001.safetensors",
                 b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', bytes(8))
    weight_map = {"w": "model-00001-of-00001.safetensors"}
    with MultiFileReader([path]) as reader:
        for ok in (8, reader.size, None):
            check_against_index(reader, ExportIndex(weight_map, ok), "index.json")
        assert read_index_document(io.BytesIO(index_doc(total_size=8.0)).read, "i").total_size == 8
        with pytest.raises(FormatError, match=r"index.json: metadata.total_size says 9 bytes, but the tensors of its 1 "
                                              r"shard\(s\) hold 8 bytes"):
            check_against_index(reader, ExportIndex(weight_map, 9), "index.json")


def test_a_shard_header_longer_than_the_tensors_its_index_lists_can_need_is_refused_unparsed(tmp_path):
    """An export shard whose header would describe far more tensors than the index lists in it
    (a 100 MB header of a million empty tensors took 20 s and 640 MB to parse before the refusal)
    is refused from its declared length; one within the bound is read."""
    from reshard_job.formats.hf_index import SHARD_ENTRY_BYTES, SHARD_EXTRA_BYTES
    from reshard_job.sources.export_folder import discover_export, open_export

    folder = tmp_path / "exp"
    folder.mkdir()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "model-00001-of-00001.safetensors"}}))
    shard = folder / "model-00001-of-00001.safetensors"
    entry = b'"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}'
    limit = SHARD_EXTRA_BYTES + 12 + SHARD_ENTRY_BYTES
    craft(shard, b"{" + entry + b"}" + b" " * (limit - 1000), bytes(8))
    discover_export(str(folder))
    open_export(folder).close()
    craft(shard, b"{" + entry + b"}" + b" " * (limit + 1000), bytes(8))
    for attempt in (lambda: discover_export(str(folder)), lambda: open_export(folder)):
        with pytest.raises(FormatError) as ei:
            attempt()
        assert str(ei.value).startswith(f"{shard}: header length ")
        assert "the header describes tensors the index does not list" in str(ei.value)
