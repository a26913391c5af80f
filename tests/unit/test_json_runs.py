"""``JsonStream.items(runs=True)``: consecutive members of one known value come as one run of keys,
and what they stand for is exactly what a member at a time gives, whatever the keys hold."""

from __future__ import annotations

import io
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard_job.formats.mindformers_metadata import MindFormersFormatError, parse_metadata
from reshard_job.formats.mindformers_storage import parse_storage_key, parse_storage_keys
from reshard_job.json_stream import REUSED, RUN, JsonStream

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
