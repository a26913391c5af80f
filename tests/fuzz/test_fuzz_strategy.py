"""Fuzzing strategy files: random and mutated bytes under both kinds of names (protobuf for
``.ckpt``, JSON for ``.json``), and structurally odd JSON documents. Reading and then interpreting
them (devices, stages) either works or raises a ``ReshardError`` naming the file.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from hypothesis import example, given
from hypothesis import strategies as st

from fuzz_helpers import fuzz, mutations, read_expecting_clean_errors, strategy_seed_files

from reshard_job.formats.strategy import read_strategy, to_json_bytes
from reshard_job.topology import Topology

SCRATCH = Path(tempfile.mkdtemp(prefix="fuzz_strategy_"))
PROTO_SEEDS = [p.read_bytes() for p in strategy_seed_files()]
JSON_SEEDS = [to_json_bytes(read_strategy(p)) for p in strategy_seed_files()]


def interpret(path: Path) -> None:
    sf = read_strategy(path)
    topo = Topology.from_strategy(sf)
    assert topo.devices >= 1
    for name in topo.layouts:
        topo.stages_of(name)


def check(target: str, data: bytes, suffix: str) -> None:
    read_expecting_clean_errors(target, SCRATCH / f"{os.getpid()}_strategy{suffix}", data, interpret)


@fuzz(150)
@given(data=st.binary(max_size=400), suffix=st.sampled_from([".ckpt", ".json"]))
@example(data=b"[" * 100_000, suffix=".json")
@example(data=b'{"parallel_layout_item": ' * 50_000, suffix=".json")
@example(data=b"\x12" + b"\xff" * 10 + b"\x01", suffix=".ckpt")
def test_random_bytes(data, suffix):
    check(f"strategy: random bytes ({suffix})", data, suffix)


@fuzz(300)
@given(data=mutations(PROTO_SEEDS, [[] for _ in PROTO_SEEDS]))
def test_mutated_protobuf(data):
    check("strategy: mutated protobuf", data, ".ckpt")


@fuzz(200)
@given(data=mutations(JSON_SEEDS, [[] for _ in JSON_SEEDS]))
def test_mutated_json(data):
    check("strategy: mutated JSON bytes", data, ".json")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 9) | st.integers() | st.floats() | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
small_ints = st.integers(-2, 8)
layouts = st.fixed_dictionaries(
    {"dev_matrix": st.lists(small_ints, max_size=3) | json_values,
     "tensor_map": st.lists(small_ints | st.lists(small_ints, max_size=2), max_size=3) | json_values,
     "field": small_ints | json_values,
     "opt_weight_shard_step": small_ints,
     "opt_weight_shard_size": small_ints},
    optional={"tensor_shape": st.lists(small_ints, max_size=3) | json_values,
              "param_split_shape": st.lists(small_ints, max_size=2) | json_values,
              "indices_offset": st.lists(small_ints, max_size=2)},
)
param_names = st.sampled_from(["w", "b", "0-w", "1-w", "2-b", "-", "a-b"]) | st.text(max_size=6)
items = st.fixed_dictionaries({"stage": small_ints | json_values,
                               "parallel_strategy": st.lists(st.lists(small_ints, max_size=2), max_size=2) | json_values})
documents = st.fixed_dictionaries(
    {"parallel_layout_item": st.dictionaries(param_names, layouts | json_values, max_size=3) | json_values},
    optional={"parallel_strategy_item": st.dictionaries(st.text(max_size=4), items | json_values, max_size=2),
              "current_stage": json_values},
)


@fuzz(200)
@given(doc=documents)
def test_structured_json(doc):
    check("strategy: structured JSON", json.dumps(doc).encode(), ".json")
