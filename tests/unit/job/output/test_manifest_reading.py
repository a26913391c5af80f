"""Reading a manifest found in an output directory: what is kept, what is read past, what is refused."""

from __future__ import annotations

import hashlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard_job.job.output.manifest_reading import ManifestDamaged, _skip_object, read_manifest_summary
from reshard_job.json_stream import JsonStream
from reshard_job.storage import storage_for


def _summary(path):
    with storage_for(str(path)).open_read(str(path)) as f:
        return read_manifest_summary(f)


def _manifest(tensors: dict) -> dict:
    return {"manifest_version": 1, "run_id": "r1", "fingerprint": "ab" * 32,
            "target": {"devices": 1, "files": [{"rank": 0, "path": "/o/rank_0/c_0.ckpt", "size": 10 ** 6,
                                                 "sha256": "cd" * 32}]},
            "tensors": tensors, "plan": {"notes": ["a \"quoted\" note", "tab\there"], "n": [1, -2.5e-3, None]}}


TRICKY = {"0": {"plain": "ef" * 32, "esc\\aped\"name\u00e9\u2028": "01" * 32, "n": -12, "f": 1.5e+10, "t": True,
                "nil": None, "nested": {"a": [1, {"b": "c"}]}, "after": "23" * 32}}


@pytest.mark.parametrize("indent", [None, 2])
@pytest.mark.parametrize("ascii_only", [True, False])
def test_kept_values_and_the_file_digest_whatever_the_skipped_sections_hold(tmp_path, indent, ascii_only):
    path = tmp_path / "manifest.json"
    data = json.dumps(_manifest(TRICKY), indent=indent, ensure_ascii=ascii_only).encode()
    path.write_bytes(data)
    kept, (size, sha) = _summary(path)
    assert (size, sha) == (len(data), hashlib.sha256(data).hexdigest())
    assert kept["run_id"] == "r1" and kept["fingerprint"] == "ab" * 32
    assert kept["target"]["files"][0]["sha256"] == "cd" * 32


@pytest.mark.parametrize("bad", [
    '"x": 123456789012345678901234',  # an integer of absurd length, in a section read past
    '"x": "a\\qb"',  # an escape JSON has not
    '"x": "a\tb"',  # a raw control character in a string
    '"x": 1,',  # a trailing comma
    '"x" 1',  # no colon
])
def test_a_skipped_section_that_is_not_json_as_written_is_damage(tmp_path, bad):
    path = tmp_path / "manifest.json"
    text = json.dumps(_manifest({"0": {"a": "ef" * 32}}), indent=2)
    path.write_text(text.replace('"a": "' + "ef" * 32 + '"', f'"a": "{"ef" * 32}", {bad}'))
    with pytest.raises(ManifestDamaged):
        _summary(path)


_SCALARS = st.one_of(st.text(max_size=40), st.integers(-10 ** 19, 10 ** 19), st.booleans(), st.none(),
                     st.floats(allow_nan=False, allow_infinity=False),
                     st.lists(st.integers(0, 9), max_size=3))


@settings(max_examples=200, deadline=None)
@given(members=st.dictionaries(st.text(max_size=30), _SCALARS, max_size=60), indent=st.sampled_from([None, 1, 4]),
       ascii_only=st.booleans(), chunk=st.sampled_from([7, 64, 1 << 20]))
def test_an_object_is_read_past_to_where_walking_its_items_ends(members, indent, ascii_only, chunk):
    """``_skip_object`` ends where ``items()`` ends, in windows of any size (a member cut by the
    window's end, escapes, numbers, nested lists read the careful way)."""
    text = json.dumps({"k": members, "next": 1}, indent=indent, ensure_ascii=ascii_only).encode()

    def walk(skip) -> list:
        data = bytearray(text)

        def read(n):
            out = bytes(data[:n])
            del data[:n]
            return out
        stream = JsonStream(read, chunk=chunk)
        seen = []
        for key in stream.members():
            if key == "k":
                skip(stream)
            else:
                seen.append((key, stream.value()))
        stream.end()
        return seen

    assert walk(_skip_object) == walk(lambda s: list(s.items())) == [("next", 1)]
