"""A table of fingerprints reads as the dict of hex digests it stands for, and two tables compare
as those dicts do."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from reshard_job.core.digest_table import DigestTable, differing

NAMES = st.lists(st.text(max_size=6), unique=True, max_size=30)


def _rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, 16), dtype=np.uint8)


@given(names=NAMES, seed=st.integers(0, 99))
def test_a_table_is_the_dict_of_hex_digests_in_name_order(names, seed):
    rows = _rows(len(names), seed)
    table = DigestTable.of(names, rows)
    as_dict = {name: row.tobytes().hex() for name, row in zip(names, rows)}
    assert dict(table) == as_dict and dict(table.items()) == as_dict
    assert list(table) == sorted(names) and len(table) == len(names)
    for name in names:
        assert name in table and table[name] == as_dict[name] and table.get(name) == as_dict[name]
    assert "absent\x00" not in table and table.get("absent\x00") is None and 3 not in table


@given(names=NAMES, seed=st.integers(0, 99), changed=st.sets(st.integers(0, 29)), extra=st.sets(st.text(max_size=3)))
def test_tables_differ_where_the_dicts_do(names, seed, changed, extra):
    rows = _rows(len(names), seed)
    other = rows.copy()
    for i in changed:
        if i < len(names):
            other[i, i % 16] ^= 0x5A
    source, target = DigestTable.of(names, rows), DigestTable.of(list(reversed(names)), other[::-1])
    asked = set(names) | extra
    expected = sorted(n for n in asked if dict(source).get(n) != dict(target).get(n))
    assert differing(asked, source, target) == expected == sorted(names[i] for i in changed if i < len(names))
    fewer = DigestTable.of(names[1:], rows[1:])  # not the same names: compared one by one
    assert differing(asked, source, fewer) == sorted(n for n in asked if dict(source).get(n) != dict(fewer).get(n))


@given(names=NAMES, seed=st.integers(0, 99), size=st.integers(1, 7), indent=st.sampled_from([None, 2]),
       sort_keys=st.booleans())
def test_a_table_is_written_as_json_dumps_writes_its_dict(names, seed, size, indent, sort_keys):
    import json

    from reshard_job import jsonchunks

    table = DigestTable.of(names, _rows(len(names), seed))
    chunks = list(table.columns(sort_keys, size))
    assert all(len(keys) == len(values) <= size for keys, values in chunks)
    assert [k for keys, _ in chunks for k in keys] == sorted(names)
    doc = {"fingerprints": {"source": table}}
    expected = json.dumps({"fingerprints": {"source": dict(table)}}, indent=indent, sort_keys=sort_keys,
                          ensure_ascii=False)
    old, jsonchunks.CHUNK_ITEMS = jsonchunks.CHUNK_ITEMS, size
    try:
        written = "".join(jsonchunks.iter_json(doc, indent=indent, sort_keys=sort_keys, ensure_ascii=False))
    finally:
        jsonchunks.CHUNK_ITEMS = old
    assert written == expected
