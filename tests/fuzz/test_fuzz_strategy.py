"""Fuzzing strategy files: random and mutated bytes under both kinds of names (protobuf for
``.ckpt``, JSON for ``.json``), and structurally odd JSON documents. Reading and then interpreting
them (devices, stages) either works or raises a ``ReshardError`` naming the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from hypothesis import example, given
from hypothesis import strategies as st

from fuzz_helpers import scratch_dir, TRIED, fuzz, mutations, read_expecting_clean_errors, strategy_seed_files

from reshard_job.formats.strategy import read_strategy, to_json_bytes
from reshard_job.core.topology import Topology

SCRATCH = scratch_dir("fuzz_strategy_")
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


# ================================================================================ hostile structures
#
# Strategies built to hurt: device counts of 2^20 and beyond (10^400 in JSON), a hundred axes,
# stage numbers of -1, 2^20 and 10^12 in per-stage files and in merged names, optimizer shard
# sizes of 2^31, target meshes of a million devices. Each is read, merged, interpreted and
# planned against a small index in a child process whose address space is capped (a little above
# what it needs to start) and which must answer within seconds: a regression that loops over
# declared devices or allocates what a file declares fails the test instead of taking the machine
# down. The answer must be a plan or a one-line ReshardError.

HOSTILE_CHILD = r"""
import base64, json, os, resource, shutil, sys, tempfile, time
with open("/proc/self/status") as f:
    vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
cap = vm + 384 * 2**20
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
from reshard_job.errors import ReshardError
from reshard_job.core.tensor_meta import TensorMeta
from reshard_job.plan.planner import Planner
from reshard_job.plan.rank_list import source_ranks_for
from reshard_job.sources.rank_folders import load_strategy

INDEX = {r: {"w": TensorMeta("Float32", (4, 4), "tensor", 64), "b": TensorMeta("Float32", (4,), "tensor", 16),
             "adam_m.w": TensorMeta("Float32", (4, 4), "tensor", 64),
             "global_step": TensorMeta("Int32", (1,), "tensor", 4)} for r in (0, 1)}
scratch = tempfile.mkdtemp(prefix="hostile_")
import atexit
atexit.register(shutil.rmtree, scratch, True)
for n, line in enumerate(sys.stdin):
    case = json.loads(line)
    if case.get("control"):
        try:
            bytearray(1 << 34)
            print(json.dumps({"outcome": "allocated", "seconds": 0}), flush=True)
        except MemoryError:
            print(json.dumps({"outcome": "MemoryError", "seconds": 0}), flush=True)
        continue
    root = os.path.join(scratch, str(n))
    os.makedirs(root)
    paths = []
    for side in ("source", "target"):
        files = case.get(side)
        if not files:
            paths.append(None)
            continue
        where = os.path.join(root, side)
        if len(files) > 1:  # a directory of per-stage files
            os.makedirs(where)
        for i, (suffix, data) in enumerate(files):
            name = os.path.join(where, f"stage{i}{suffix}") if len(files) > 1 else where + suffix
            with open(name, "wb") as f:
                f.write(base64.b64decode(data))
        paths.append(where if len(files) > 1 else where + files[0][0])
    started = time.monotonic()
    try:
        src = load_strategy(paths[0]).topology
        dst = load_strategy(paths[1]).topology if paths[1] else None
        index = {r: m for r, m in INDEX.items() if r < src.devices}
        planner = Planner(src, dst, index)
        last = (dst.devices if dst else 1) - 1
        planner.plan(sorted({0, last // 2, last}), missing={})
        if src.devices <= 4096:
            source_ranks_for(src, dst, last)
        out = {"outcome": "ok"}
    except ReshardError as e:
        out = {"outcome": "ReshardError", "message": str(e)}
    except MemoryError:
        out = {"outcome": "MemoryError"}
    except BaseException as e:
        out = {"outcome": f"{type(e).__name__}: {e}"[:500]}
    out["seconds"] = time.monotonic() - started
    shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(out), flush=True)
"""


class HostileChild:
    """One capped child process answering one case per line (started once: spawning one per case
    would cost a second each)."""

    TIMEOUT = 20.0

    def __init__(self):
        self.proc = None

    def ask(self, case: dict) -> dict:
        import select
        import subprocess
        import sys

        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, "-c", HOSTILE_CHILD], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.proc.stdin.write(json.dumps(case) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], self.TIMEOUT)
        if not ready:
            self.proc.kill()
            self.proc = None
            raise AssertionError(f"no answer within {self.TIMEOUT} s (a hang or a loop over declared sizes)")
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read()[-2000:]
            self.proc = None
            raise AssertionError(f"the capped child died: {err}")
        return json.loads(line)


CHILD = HostileChild()

HUGE = [2**20, 2**20 + 1, 2**31 - 1, 2**32 - 1, 2**62, 10**12, 10**400]
huge_dev_matrices = st.one_of(
    st.lists(st.integers(1, 4) | st.sampled_from(HUGE), min_size=1, max_size=3).filter(lambda d: max(d) > 4),
    st.lists(st.just(1), min_size=60, max_size=100),
    st.sampled_from([[1024, 1024], [2**16, 16], [2, 2**19], [2**20], [2**10] * 3, [512, 512], [0], [-1, 2], []]))
hostile_values = st.sampled_from([-2, -1, 63, 64, 2**20, 2**31 - 1, -2**31, 10**30])


def layout(dev, tmap, step=0, size=0) -> dict:
    return {"dev_matrix": list(dev), "tensor_map": list(tmap), "field": 0,
            "opt_weight_shard_step": step, "opt_weight_shard_size": size}


def stage_doc(layouts: dict, stage: int) -> dict:
    return {"parallel_layout_item": layouts, "parallel_strategy_item": {"op": {"stage": stage, "parallel_strategy": []}}}


@st.composite
def hostile_cases(draw):
    """A plausible source strategy for the child's index (ranks 0 and 1 holding w [4,4], b [4]
    and adam_m.w), and a target, with one hostile change (or none: then it must plan)."""
    dev = draw(st.sampled_from([(2,), (2, 1), (1, 2)]))
    ax = draw(st.sampled_from([0, 1])) if len(dev) == 2 else 0
    ax = ax if dev[len(dev) - 1 - ax] == 2 else 1 - ax
    w_map = draw(st.sampled_from([(ax, -1), (-1, ax), (-1, -1)]))
    src = {"w": layout(dev, w_map), "adam_m.w": layout(dev, w_map), "b": layout(dev, draw(st.sampled_from([(ax,), (-1,)])))}
    t_dev = draw(st.sampled_from([(1,), (2,), (4,)]))
    tgt = {"w": layout(t_dev, (0, -1)), "b": layout(t_dev, (-1,))}
    source, target, stages = [src], (tgt if draw(st.booleans()) else None), [0]
    what = draw(st.sampled_from(["none", "dev", "map", "opt", "stage", "merged key", "target", "stages"]))
    victim = draw(st.sampled_from(["w", "b", "adam_m.w"]))
    if what == "dev":
        src[victim]["dev_matrix"] = draw(huge_dev_matrices)
    elif what == "map":
        tm = src[victim]["tensor_map"]
        tm[draw(st.integers(0, len(tm) - 1))] = draw(hostile_values | st.lists(hostile_values, min_size=1, max_size=3))
    elif what == "opt":
        src[victim]["opt_weight_shard_step"] = draw(st.sampled_from([1, 4, 2**31 - 1]))
        src[victim]["opt_weight_shard_size"] = draw(hostile_values | st.sampled_from([2, -1]))
    elif what == "stage":
        stages = [draw(st.sampled_from([-1, 1, 2**20 - 1, 2**20, 10**12, 2**32 - 1]))]
    elif what == "merged key":
        src[draw(st.sampled_from(["1000000000000000-w", "-1-w", "0-w", "1048575-b"]))] = src.pop(victim)
    elif what == "target":
        target = {"w": layout(draw(huge_dev_matrices), (-1, -1)), "b": layout((2,), (-1,))}
    elif what == "stages":  # per-stage files with lying numbers
        source = [{"w": layout((1,), (-1, -1))}, {"b": layout((1,), (-1,))}]
        stages = draw(st.lists(st.sampled_from([0, 1, 2, -1, 2**20, 10**12]), min_size=2, max_size=2))
    docs = [stage_doc(doc, stage) for doc, stage in zip(source, stages * len(source) if len(stages) == 1 else stages)]
    return what, docs, stage_doc(target, 0) if target else None


def encode(docs: list[dict], protobuf: bool) -> list[tuple[str, str]]:
    """[(suffix, base64 bytes)] of documents: all protobuf when every number fits its field,
    else all JSON (a directory holds one format)."""
    import base64

    from reshard_job.formats.strategy import to_protobuf_bytes

    from reshard_job.core.strategy_model import ParamLayout, StrategyFile, StrategyItem

    if protobuf:
        try:
            out = []
            for doc in docs:
                sf = StrategyFile(
                    {n: ParamLayout(tuple(d["dev_matrix"]), tuple(tuple(e) if isinstance(e, list) else e
                                                                  for e in d["tensor_map"]),
                                    d["opt_weight_shard_step"], d["opt_weight_shard_size"])
                     for n, d in doc["parallel_layout_item"].items()},
                    [StrategyItem(n, d["stage"], ()) for n, d in doc["parallel_strategy_item"].items()])
                out.append((".ckpt", base64.b64encode(to_protobuf_bytes(sf)).decode()))
            return out
        except (ValueError, TypeError, OverflowError):
            pass  # a value protobuf cannot carry (negative uint32, beyond int32): send them as JSON
    return [(".json", base64.b64encode(json.dumps(doc).encode()).decode()) for doc in docs]


@fuzz(80)
@given(case=hostile_cases(), protobuf=st.booleans())
@example(case=("target", [stage_doc({"w": layout((2,), (0, -1))}, 0)],
               stage_doc({"w": layout((1024, 1024), (-1, -1))}, 0)), protobuf=True)
@example(case=("dev", [stage_doc({"w": layout((2**32 - 1, 2**32 - 1), (1, 0))}, 0)], None), protobuf=True)
@example(case=("dev", [stage_doc({"w": layout((1024, 1024), (1, 0))}, 0)], None), protobuf=True)
@example(case=("dev", [stage_doc({"w": layout((10**400,), (0, -1))}, 0)], None), protobuf=False)
@example(case=("stages", [stage_doc({"w": layout((2,), (0, -1))}, s) for s in (0, 10**12)], None), protobuf=False)
def test_hostile_structures_end_quickly_in_one_line(case, protobuf):
    what, source, target = case
    request = {"source": encode(source, protobuf), "target": encode([target], protobuf) if target else None}
    TRIED["strategy: hostile structures (capped child)"] += 1
    answer = CHILD.ask(request)
    assert answer["outcome"] in ("ok", "ReshardError"), answer
    assert answer["seconds"] < 10, answer
    if answer["outcome"] == "ReshardError":
        assert "\n" not in answer["message"] and len(answer["message"]) < 1200, answer["message"]
    if what == "none":
        assert answer["outcome"] == "ok", answer  # unaltered, it plans


def test_the_hostile_child_is_capped():
    """The control: the child's cap does stop an allocation of what a hostile file could declare."""
    answer = CHILD.ask({"control": True})
    assert answer["outcome"] == "MemoryError", answer
