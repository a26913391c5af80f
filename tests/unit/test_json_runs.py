"""``JsonStream.items(runs=True)``: consecutive members of one known value come as one run of keys,
and what they stand for is exactly what a member at a time gives, whatever the keys hold."""

from __future__ import annotations

import io
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard_job.errors import SafetensorsFormatError
from reshard_job.formats.mindformers_metadata import MindFormersFormatError, parse_metadata
from reshard_job.formats.mindformers_storage import parse_storage_key, parse_storage_keys
from reshard_job.formats.safetensors import SafetensorsReader
from reshard_job.json_stream import MATCHED, MATCHED_RUN, REUSED, RUN, JsonStream

VALUES = [{"shape": [4], "dtype": "F32"}, {"shape": [4], "dtype": "F32", "x": ":{\"a\":1},"}, 1, "s", [1, 2], None]
# keys that look like the separator a run is split on, hold quotes, escapes and control characters
KEYS = st.one_of(st.text(max_size=6), st.sampled_from(['a', 'b', ':1,"', '"', '\\', '\x1b[2J', '":1,"b', 'é',
                                                       ':{"shape":[4],"dtype":"F32"},"', '\u2028']))


def members(pairs: list[tuple[str, object]], ascii_only: bool) -> str:
    """A compact object with these members, repeated keys kept (``json.dumps`` of a dict cannot)."""
    return "{" + ",".join(json.dumps(k, ensure_ascii=ascii_only) + ":" + json.dumps(v, separators=(",", ":"))
                          for k, v in pairs) + "}"


def read(text: str, chunk: int, runs: bool) -> tuple[list[tuple[str, object]], int]:
    stream = JsonStream(io.BytesIO(text.encode()).read, chunk=chunk)
    known: dict[str, object] = {}
    out, run_count = [], 0
    for key, value, raw in stream.items(known, runs=runs):
        if value is RUN:
            run_count += 1
            out.extend((k, known[raw]) for k in key)
        elif value is REUSED:
            out.append((key, known[raw]))
        else:
            known[raw] = value
            out.append((key, value))
    stream.end()
    return out, run_count


@settings(max_examples=300, deadline=None)
@given(pairs=st.lists(st.tuples(KEYS, st.integers(0, len(VALUES) - 1)), max_size=60),
       repeat=st.integers(1, 30), chunk=st.sampled_from([7, 64, 333, 1 << 20]), ascii_only=st.booleans())
def test_runs_stand_for_exactly_the_members_one_at_a_time(pairs, repeat, chunk, ascii_only):
    expanded = [(f"{k}{i}" if i else k, VALUES[v]) for k, v in pairs for i in range(repeat)]
    text = members(expanded, ascii_only)
    with_runs, _ = read(text, chunk, runs=True)
    one_by_one, none = read(text, chunk, runs=False)
    assert none == 0
    assert with_runs == one_by_one == expanded


def test_a_long_run_is_read_in_a_few_runs_not_a_member_at_a_time():
    expanded = [(f"model.layers.{i}.w", VALUES[0]) for i in range(5000)]
    got, runs = read(members(expanded, True), 1 << 20, runs=True)
    assert got == expanded
    assert 0 < runs < 20  # the span doubles while the run lasts


def test_storage_keys_read_together_are_read_as_one_at_a_time():
    keys = [f"('model.w{i}', ({i % 3},))" for i in range(100)]
    assert parse_storage_keys(keys, "m.json") == [parse_storage_key(k, "m.json") for k in keys]
    odd = keys[:50] + ["('a', (00,))", "x('b', (1,))"] + keys[50:]
    with pytest.raises(MindFormersFormatError, match=r"x\('b'"):
        parse_storage_keys(odd, "m.json")
    assert parse_storage_keys(odd[:51], "m.json")[-1] == ("a", 0)


ENTRY = {"properties": {"dtype": "float32"}, "global_shape": [4], "axis_fragmentations": [1], "layout": None,
         "chunk": [{"global_offset": [0], "local_shape": [4]}]}
WHERE = [{"file_name": "model-0000000-0000001.safetensors", "storage_rank": 0, "rank_group": [0]}]


def metadata(names: list[str], storage_keys: list[str]) -> bytes:
    return ('{"state_dict_metadata":' + members([(n, ENTRY) for n in names], True)
            + ',"storage_data":' + members([(k, WHERE) for k in storage_keys], True) + "}").encode()


def test_a_run_of_parameters_gives_what_one_at_a_time_gives():
    names = [f"p{i}" for i in range(300)]
    params = parse_metadata(metadata(names, [str((n, (0,))) for n in names]), "m.json")
    assert list(params) == names
    assert len({id(p.spec) for p in params.values()}) == 1
    assert params["p299"].locations[0][0].file_name == WHERE[0]["file_name"]


@pytest.mark.parametrize("names,keys,needle", [
    ([f"p{i}" for i in range(100)] + ["p7"], None, "describes parameter 'p7' twice"),
    ([f"p{i}" for i in range(100)], [str((f"p{i}", (0,))) for i in range(100)] + ["('p3', (00,))"],
     "parameter 'p3' shard 0: storage_data has two keys for it"),
    ([f"p{i}" for i in range(100)], [str((f"p{i}", (0,))) for i in range(100)] + ["('p200', (0,))"],
     "storage_data names parameter 'p200'"),
    ([f"p{i}" for i in range(100)], [str((f"p{i}", (0,))) for i in range(99)],
     "parameter 'p99': shard\\(s\\) \\[0\\] have no storage_data entry"),
])
def test_a_run_with_something_wrong_in_it_is_refused_as_one_at_a_time_would(names, keys, needle):
    keys = [str((n, (0,))) for n in names] if keys is None else keys
    with pytest.raises(MindFormersFormatError, match=needle):
        parse_metadata(metadata(names, keys), "m.json")


PATTERN = re.compile(r'"([^"\\\x00-\x1f]*)":\[([0-9]{1,3})(,[0-9]{1,3})?\]')
LISTS = st.one_of(st.lists(st.integers(0, 999), min_size=1, max_size=2), st.lists(st.integers(-5, 5000), max_size=3),
                  st.just("x"), st.just({"a": [1]}))


def read_matched(text: str, chunk: int, runs: bool) -> list[tuple[str, object]]:
    stream = JsonStream(io.BytesIO(text.encode()).read, chunk=chunk)
    out = []
    for key, value, m in stream.items(pattern=PATTERN, runs=runs):
        if value is MATCHED_RUN:
            out.extend((row[0], json.loads(f"[{row[1]}{row[2] or ''}]")) for row in key)
        elif value is MATCHED:
            out.append((m[1], json.loads(f"[{m[2]}{m[3] or ''}]")))
        else:
            out.append((key, value))
    stream.end()
    return out


@settings(max_examples=300, deadline=None)
@given(pairs=st.lists(st.tuples(KEYS, LISTS), max_size=40), repeat=st.integers(1, 40),
       chunk=st.sampled_from([5, 64, 333, 1 << 20]), spaced=st.booleans())
def test_runs_of_matched_members_stand_for_exactly_the_members_one_at_a_time(pairs, repeat, chunk, spaced):
    expanded = [(f"{k}{i}" if i else k, v) for k, v in pairs for i in range(repeat)]
    text = members(expanded, True)
    if spaced:  # every so often a member the pattern does not match for its spacing alone
        text = text.replace(':[1', ': [1')
    assert read_matched(text, chunk, True) == read_matched(text, chunk, False) == expanded


def test_a_long_run_of_matched_members_is_found_in_a_few_splits():
    expanded = [(f"t{i}", [i % 1000, 4]) for i in range(20000)]
    stream = JsonStream(io.BytesIO(members(expanded, True).encode()).read)
    kinds = [value for _, value, _ in stream.items(pattern=PATTERN, runs=True)]
    assert kinds.count(MATCHED_RUN) < 40 and len(kinds) < 60


def safetensors_file(path, entries: list[tuple[str, dict]], spaced: bool) -> str:
    """A safetensors file of these header entries (repeated names kept), compact or spaced."""
    seps = (", ", ": ") if spaced else (",", ":")
    text = ("{" + seps[0].join(json.dumps(k) + seps[1] + json.dumps(v, separators=seps) for k, v in entries)
            + "}").encode()
    size = max((v["data_offsets"][1] for k, v in entries if k != "__metadata__"), default=0)
    path.write_bytes(len(text).to_bytes(8, "little") + text + bytes(size))
    return str(path)


def tensor(i: int, shape=(2,)) -> dict:
    return {"dtype": "F32", "shape": list(shape), "data_offsets": [8 * i, 8 * i + 8]}


def header_of(path: str):
    """What a reader makes of a header: its (name, dtype, shape, begin) rows, or its refusal."""
    try:
        reader = SafetensorsReader(path)
    except SafetensorsFormatError as e:
        return str(e).split(": ", 1)[1]
    start = reader.data_start
    return [(n, e.dtype, e.shape, [(at - start, k) for at, k in e.pieces]) for n, e in reader.entries.items()], \
        reader.metadata


CASES = {
    "plain": [(f"t{i}", tensor(i)) for i in range(3000)],
    "a shape met late": [(f"t{i}", tensor(i, (2,) if i != 2500 else (1, 2))) for i in range(3000)],
    "a name twice": [(f"t{i if i != 2000 else 7}", tensor(i)) for i in range(3000)],
    "a length that disagrees": [(f"t{i}", dict(tensor(i), data_offsets=[8 * i, 8 * i + (8 if i != 1500 else 4)]))
                                for i in range(3000)],
    "metadata among tensors": [(f"t{i}" if i != 900 else "__metadata__", tensor(i)) for i in range(3000)],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_header_read_many_entries_at_a_time_reads_as_one_at_a_time(tmp_path, case):
    entries = CASES[case]
    compact = header_of(safetensors_file(tmp_path / "a.safetensors", entries, spaced=False))
    spaced = header_of(safetensors_file(tmp_path / "b.safetensors", entries, spaced=True))
    assert compact == spaced
    if case in ("plain", "a shape met late"):
        assert len(compact[0]) == 3000 and compact[0][2500][2] == ((1, 2) if case != "plain" else (2,))
    else:
        assert isinstance(compact, str)
