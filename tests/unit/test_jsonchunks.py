"""``iter_json`` joins to exactly what ``json.dumps`` gives with the same options: the manifest's
own digest and its file are written from these pieces."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard_job.jsonchunks import iter_json

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12))  # text: \n, é, \u2028
KEYS = st.one_of(st.text(max_size=8), st.integers(0, 9))  # an int key is converted by json.dumps
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(KEYS, inner, max_size=4)), max_leaves=25)
OPTIONS = [dict(indent=2), dict(sort_keys=True, separators=(",", ":"), ensure_ascii=False), dict(),
           dict(indent=4, sort_keys=True, ensure_ascii=False)]


@settings(max_examples=300, deadline=None)
@given(obj=st.dictionaries(st.text(max_size=8), VALUES, max_size=6), which=st.integers(0, len(OPTIONS) - 1),
       split_depth=st.integers(0, 3))
def test_pieces_join_to_json_dumps(obj, which, split_depth):
    opts = OPTIONS[which]
    try:
        want = json.dumps(obj, **opts)
    except TypeError:  # keys json cannot sort (an int beside a str): refused the same way
        with pytest.raises(TypeError):
            "".join(iter_json(obj, split_depth=split_depth, **opts))
        return
    assert "".join(iter_json(obj, split_depth=split_depth, **opts)) == want


def test_a_manifest_shaped_document_comes_in_pieces_no_larger_than_one_rank():
    tensors = {str(r): {f"layer{i}.w": f"{i:064x}" for i in range(2000)} for r in range(4)}
    doc = {"run_id": "x", "target": {"files": [{"rank": 0, "path": "/a\nb"}]}, "tensors": tensors, "empty": {}}
    pieces = list(iter_json(doc, indent=2))
    assert "".join(pieces) == json.dumps(doc, indent=2)
    assert max(map(len, pieces)) < len(json.dumps(tensors["0"], indent=2)) * 1.1 < len("".join(pieces)) / 3


@settings(max_examples=100, deadline=None)
@given(names=st.lists(st.text(max_size=6), max_size=40), which=st.integers(0, len(OPTIONS) - 1),
       depth=st.integers(0, 2), chunk=st.sampled_from([1, 3, 8192]))
def test_tensor_digests_come_out_as_the_dict_they_stand_for(names, which, depth, chunk):
    """A file's digests (a mapping that is not a dict, encoded in chunks) give exactly the text
    of the equal dict, at any depth, with any options, whatever the chunk size."""
    import hashlib

    from reshard_job import jsonchunks
    from reshard_job.formats.tensor_digests import TensorDigests

    digests = TensorDigests()
    for i, name in enumerate(names):
        digests.add(name, hashlib.sha256(str(i).encode()).digest())
    digests.complete()
    plain = dict(digests.items())
    assert list(plain) == list(dict.fromkeys(names))  # first place, last digest, as a dict keeps them
    assert all(plain[n] == hashlib.sha256(str(max(i for i, m in enumerate(names) if m == n)).encode()).hexdigest()
               for n in plain)
    opts = OPTIONS[which]
    doc, want_doc = digests, plain
    for level in range(depth):
        doc, want_doc = {"tensors": doc, "n": level}, {"tensors": want_doc, "n": level}
    saved, jsonchunks.CHUNK_ITEMS = jsonchunks.CHUNK_ITEMS, chunk
    try:
        assert "".join(iter_json(doc, **opts)) == json.dumps(want_doc, **opts)
    finally:
        jsonchunks.CHUNK_ITEMS = saved
    assert json.dumps(doc, default=jsonchunks.plain, **opts) == json.dumps(want_doc, **opts)


def test_tensor_digests_pickle_compare_and_complete_deferred_hashers():
    import hashlib
    import pickle

    from reshard_job.formats.tensor_digests import TensorDigests

    d = TensorDigests()
    h = hashlib.sha256(b"partial")
    d.add("a", hashlib.sha256(b"a").digest())
    d.add_later("b", h)
    h.update(b" and the rest")
    d.complete()
    want = {"a": hashlib.sha256(b"a").hexdigest(), "b": hashlib.sha256(b"partial and the rest").hexdigest()}
    assert d == want and dict(d) == want and d["b"] == want["b"] and "c" not in d and len(d) == 2
    assert pickle.loads(pickle.dumps(d)) == want
    assert TensorDigests(want) == d


@settings(max_examples=100, deadline=None)
@given(items=st.lists(VALUES, max_size=30), which=st.integers(0, len(OPTIONS) - 1), depth=st.integers(0, 2),
       chunk=st.sampled_from([1, 4, 8192]))
def test_lazy_lists_come_out_as_the_list_they_stand_for(items, which, depth, chunk):
    """A list made as it is written gives exactly the text of the list, nested at any depth (also
    as a list item), with any options and chunk size."""
    from reshard_job import jsonchunks
    from reshard_job.jsonchunks import LazyList

    opts = OPTIONS[which]
    doc, want = LazyList(lambda: iter(items)), items
    for level in range(depth):
        doc, want = {"x": [level, doc], "n": level}, {"x": [level, want], "n": level}
    try:
        expected = json.dumps(want, **opts)
    except TypeError:  # keys json cannot sort
        return
    saved, jsonchunks.CHUNK_ITEMS = jsonchunks.CHUNK_ITEMS, chunk
    try:
        assert "".join(iter_json(doc, split_depth=9, **opts)) == expected
    finally:
        jsonchunks.CHUNK_ITEMS = saved
    assert json.dumps(doc, default=jsonchunks.plain, **opts) == expected


@given(obj=st.one_of(st.dictionaries(st.text(max_size=8), SCALARS, max_size=8), st.lists(SCALARS, max_size=8)),
       indent=st.sampled_from([1, 2, 4]), sort_keys=st.booleans(), ensure_ascii=st.booleans())
def test_a_flat_container_indents_as_json_dumps_does(obj, indent, sort_keys, ensure_ascii):
    from reshard_job.json_flat import dumps_flat

    text = dumps_flat(obj, indent=indent, separators=(",", ": "), sort_keys=sort_keys, ensure_ascii=ensure_ascii)
    if obj:
        assert text == json.dumps(obj, indent=indent, sort_keys=sort_keys, ensure_ascii=ensure_ascii)
    else:
        assert text is None  # left to json.dumps


def test_a_plan_shaped_document_keeps_its_lazy_lists_lazy_inside_a_list_of_ranks():
    """A plan's ranks are a list of dicts, each with its parameter list made as it is written: none
    of those lists is made whole (a plan of 1,300,000 parameters on 4 ranks wrote its ranks as one
    string, over 1 GB), and the text is ``json.dumps``'s."""
    from reshard_job.jsonchunks import LazyList

    made = []

    def params(rank):
        def items():
            for i in range(50_000):
                made.append(rank)
                yield i
        return items

    doc = {"version": 3, "ranks": [{"target_rank": r, "params": LazyList(params(r))} for r in range(3)],
           "more": [{"a": [1, 2]}, 4]}
    want = {"version": 3, "ranks": [{"target_rank": r, "params": list(range(50_000))} for r in range(3)],
            "more": [{"a": [1, 2]}, 4]}
    for opts in ({"indent": 1}, {"separators": (",", ":")}, {}):
        pieces = list(iter_json(doc, **opts))
        assert "".join(pieces) == json.dumps(want, **opts)
        assert max(map(len, pieces)) < 100_000  # a rank's whole list is some 340,000 characters
    assert len(made) == 3 * 3 * 50_000
