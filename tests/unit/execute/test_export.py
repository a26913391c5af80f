"""Export for inference: shard assignment (pure, property-tested), and exports of golden scenarios
that the ``safetensors`` library loads, whose index is valid, and that convert back to the
original layout with every tensor's bytes unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.numpy import load_file

from reshard_job.errors import ConfigError, FormatError, PlanError
from reshard_job.sources.open_files import SourceFiles
from reshard_job.execute.rank_task import execute_rank
from reshard_job.execute.export import export_safetensors
from reshard_job.formats.hf_index import INDEX_FILE, PARAM_NAME_MAP_FILE
from reshard_job.plan.export_shards import is_training_state, natural_key, parse_shard_size, plan_export, shard_file_name
from reshard_job.sources.export_folder import open_export, read_index
from reshard_job.formats.ckpt import CheckpointReader
from reshard_job.sources.mindformers_save import load_mindformers
from reshard_job.formats.strategy import read_strategy
from reshard_job.plan.model import ParamPlan, RankPlan
from reshard_job.plan.planner import Planner
from reshard_job.core.topology import Topology

GOLDEN = Path(__file__).resolve().parents[2] / "golden"
M1A = GOLDEN / "M1a_mf_llama_dp2mp2os_bf16_to_mp4"
M1B = GOLDEN / "M1b_mf_llama_pp2dp2mp2os2_to_mp4"
S1 = GOLDEN / "S1_mlp_tutorial_8to4"


# ================================================================================ pure


def full_param(name: str, nbytes: int, kind: str = "tensor") -> ParamPlan:
    shape = (nbytes,)
    return ParamPlan(name, "UInt8", kind, "reshard", shape, shape, [], 1, nbytes)


def rank_plan(sizes: dict[str, int]) -> RankPlan:
    return RankPlan(0, [full_param(n, s) for n, s in sizes.items()])


def test_shards_in_natural_order_with_transformers_names():
    layout = plan_export(rank_plan({"layers.10.w": 40, "layers.2.w": 40, "embed": 40, "layers.2.b": 40}),
                         max_shard_size=80)
    assert [s.file_name for s in layout.shards] == [shard_file_name(1, 2), shard_file_name(2, 2)]
    assert shard_file_name(1, 2) == "model-00001-of-00002.safetensors"
    assert [s.names for s in layout.shards] == [["embed", "layers.2.b"], ["layers.2.w", "layers.10.w"]]
    doc = layout.index_document()
    assert doc == {"metadata": {"total_size": 160},
                   "weight_map": {"embed": "model-00001-of-00002.safetensors",
                                  "layers.2.b": "model-00001-of-00002.safetensors",
                                  "layers.2.w": "model-00002-of-00002.safetensors",
                                  "layers.10.w": "model-00002-of-00002.safetensors"}}
    assert json.loads(layout.index_bytes()) == doc and layout.index_bytes().endswith(b"}\n")


def test_a_tensor_larger_than_the_bound_gets_a_shard_of_its_own():
    layout = plan_export(rank_plan({"a": 10, "b": 500, "c": 10, "d": 10}), max_shard_size=100)
    assert [s.names for s in layout.shards] == [["a"], ["b"], ["c", "d"]]


def test_training_state_is_left_out_unless_asked_for():
    sizes = {"w": 4, "adam_m.w": 4, "adam_v.w": 4, "accu_grads.w": 4, "global_step": 4, "learning_rate": 4,
             "moments.w": 4, "exp_avg.w": 4, "epoch_num": 4}
    layout = plan_export(rank_plan(sizes), include="weights")
    assert [s.names for s in layout.shards] == [["w"]]
    assert sorted(n for n, _ in layout.left_out) == sorted(set(sizes) - {"w"})
    assert all("include=all" in why for _, why in layout.left_out)
    everything = plan_export(rank_plan(sizes), include="all")
    assert sorted(everything.weight_map()) == sorted(sizes) and everything.left_out == ()
    assert is_training_state("adam_m.model.layers.0.wq") and not is_training_state("model.adam_m")


def test_non_tensor_entries_are_left_out():
    plan = RankPlan(0, [full_param("w", 4), ParamPlan("note", "str", "str", "copy", (0,), (0,), [], 0, 12)])
    layout = plan_export(plan, include="all")
    assert layout.weight_map() == {"w": "model-00001-of-00001.safetensors"}
    assert layout.left_out == (("note", "a str entry; safetensors holds tensors only"),)


def test_refusals():
    sliced = RankPlan(0, [ParamPlan("w", "Float32", "tensor", "reshard", (8, 4), (4, 4), [], 4, 64)])
    with pytest.raises(PlanError, match="'w'.*one full rank"):
        plan_export(sliced)
    with pytest.raises(ConfigError, match="target.include"):
        plan_export(rank_plan({"w": 4}), include="weights_only")
    with pytest.raises(ConfigError, match="max_shard_size"):
        plan_export(rank_plan({"w": 4}), max_shard_size="lots")
    with pytest.raises(PlanError, match="nothing to export"):
        plan_export(rank_plan({"adam_m.w": 4}))
    complex128 = RankPlan(0, [ParamPlan("z", "Complex128", "tensor", "reshard", (2,), (2,), [], 16, 32)])
    with pytest.raises(PlanError, match="'z'.*Complex128"):
        plan_export(complex128)


@pytest.mark.parametrize("text,size", [
    ("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("4GiB", 4 * 2**30), ("1.5kb", 1500), ("123", 123), (77, 77),
    ("2 MiB", 2 * 2**20),
])
def test_shard_sizes_follow_transformers_units(text, size):
    assert parse_shard_size(text) == size


@pytest.mark.parametrize("bad", ["0", 0, -5, "5 parsecs", True, "GB"])
def test_bad_shard_sizes(bad):
    with pytest.raises(ConfigError):
        parse_shard_size(bad)


names = st.lists(st.from_regex(r"[a-z]{1,3}(\.[0-9]{1,2}){0,2}\.[a-z]{1,2}", fullmatch=True),
                 min_size=1, max_size=30, unique=True)


@settings(max_examples=200, deadline=None)
@given(names.flatmap(lambda ns: st.tuples(st.just(ns), st.lists(st.integers(0, 300), min_size=len(ns),
                                                                 max_size=len(ns)))),
       st.integers(1, 400))
def test_assignment_properties(named_sizes, bound):
    ns, sizes = named_sizes
    layout = plan_export(rank_plan(dict(zip(ns, sizes))), max_shard_size=bound, include="all")
    listed = [n for s in layout.shards for n in s.names]
    assert listed == sorted(ns, key=natural_key)  # every tensor once, in natural order, across shards
    count = len(layout.shards)
    assert [s.file_name for s in layout.shards] == [shard_file_name(i + 1, count) for i in range(count)]
    for s in layout.shards:
        assert s.nbytes <= bound or len(s.params) == 1
    # greedy: a shard was only closed because the next tensor did not fit
    for a, b in zip(layout.shards, layout.shards[1:]):
        assert a.nbytes + b.params[0].nbytes > bound
    assert layout.total_size == sum(sizes)
    again = plan_export(rank_plan(dict(zip(reversed(ns), reversed(sizes)))), max_shard_size=bound, include="all")
    assert again.index_document() == layout.index_document()


# ================================================================================ golden exports


def full_plan_of(scenario: Path):
    src = load_mindformers(scenario / "src_mindformers")
    (rp,) = Planner(src.topology, None, src.index()).plan().ranks
    return src, rp


def data_bytes(path: str) -> int:
    """A safetensors file's tensor bytes (header excluded), as the safetensors library reads it."""
    with safe_open(path, framework="numpy") as f:
        total = 0
        for name in f.keys():
            sl = f.get_slice(name)
            itemsize = {"BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8, "F64": 8, "U8": 1}[sl.get_dtype()]
            total += int(np.prod(sl.get_shape(), dtype=np.int64)) * itemsize
    return total


@pytest.mark.parametrize("scenario", [M1A, M1B], ids=lambda p: p.name[:3])
def test_export_loads_and_its_index_is_valid(scenario, tmp_path):
    src, rp = full_plan_of(scenario)
    bound = 16_000
    with src.sources() as sources:
        result = export_safetensors(rp, sources, tmp_path, max_shard_size=bound, include="all")
    shard_names = sorted(n for n in os.listdir(tmp_path) if n not in (INDEX_FILE, PARAM_NAME_MAP_FILE))
    count = len(shard_names)
    assert count >= 3 and shard_names == [shard_file_name(i + 1, count) for i in range(count)]
    for wf in result.files:  # what was reported is what is on disk
        data = Path(wf.path).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (wf.size, wf.sha256)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    weight_map = index["weight_map"]
    seen = {}
    for name in shard_names:
        with safe_open(str(tmp_path / name), framework="numpy") as f:
            assert f.metadata() == {"format": "pt"}  # what transformers requires
            for tensor in f.keys():
                assert tensor not in seen, f"{tensor} in {seen.get(tensor)} and {name}"
                seen[tensor] = name
                sl = f.get_slice(tensor)
                assert tuple(sl.get_shape()) == rp.params[[p.name for p in rp.params].index(tensor)].target_shape
        in_shard = data_bytes(str(tmp_path / name))
        assert in_shard <= bound or len([t for t, n in seen.items() if n == name]) == 1
    assert seen == weight_map  # every tensor listed once, in the file that holds it
    assert set(weight_map) == {p.name for p in rp.params}  # include=all: everything
    assert index["metadata"]["total_size"] == sum(data_bytes(str(tmp_path / n)) for n in shard_names)
    assert index["metadata"]["total_size"] == sum(p.nbytes for p in rp.params)
    assert read_index(tmp_path) == weight_map
    assert_mindspore_name_map(tmp_path, result, weight_map, index["metadata"]["total_size"])


def assert_mindspore_name_map(folder: Path, result, weight_map: dict, total_size: int) -> None:
    """param_name_map.json as MindSpore's unified_safetensors writes it and its unified loader reads it:
    the object's "weight_map" maps every tensor to the shard in the folder that holds it."""
    raw = (folder / PARAM_NAME_MAP_FILE).read_bytes()
    doc = json.loads(raw)
    assert doc == {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    assert raw == json.dumps(doc, indent=4).encode()  # four-space indent, no final newline
    assert list(doc["weight_map"].values()) == sorted(doc["weight_map"].values())  # in shard order
    for name, file_name in doc["weight_map"].items():  # the loader's lookup: the file, then the name in it
        with safe_open(str(folder / file_name), framework="numpy") as f:
            assert name in f.keys()
    assert result.param_name_map.path == str(folder / PARAM_NAME_MAP_FILE) and result.param_name_map in result.files


def test_one_shard_has_no_name_map_as_mindspore_maps_a_lone_file_itself(tmp_path):
    src, rp = full_plan_of(M1B)
    with src.sources() as sources:
        result = export_safetensors(rp, sources, tmp_path, include="all")
    assert len(result.shards) == 1 and result.param_name_map is None
    assert sorted(os.listdir(tmp_path)) == sorted([INDEX_FILE, shard_file_name(1, 1)])


def test_export_values_load_with_the_safetensors_library(tmp_path):
    """M1b is float32: the library's numpy loader gives the values we wrote, tensor for tensor."""
    src, rp = full_plan_of(M1B)
    with src.sources() as sources:
        result = export_safetensors(rp, sources, tmp_path, max_shard_size="8KiB")
        full = execute_rank(rp, sources, str(tmp_path / "full.ckpt"))
    loaded = {}
    for wf in result.shards:
        loaded.update(load_file(wf.path))
    assert sorted(loaded) == sorted(n for n in src.params if not n.startswith(("adam_m.", "adam_v.")))
    with CheckpointReader(full.path) as r:
        for name, array in loaded.items():
            assert np.array_equal(array, r.read(name)), name


def source_tensor_hashes(manifest: dict, files) -> dict[str, str]:
    out = {}
    for f in files:
        out.update({n: e["sha256"] for n, e in manifest["src_mindformers_files"][os.path.basename(f)].items()})
    return out


@pytest.mark.parametrize("include", ["all", "weights"])
@pytest.mark.parametrize("scenario", [M1A, M1B], ids=lambda p: p.name[:3])
def test_round_trip_back_to_the_saved_layout(scenario, include, tmp_path):
    """Export, then read the shards as one unsharded source and plan back to the MindFormers
    layout: every source rank's tensors come back byte for byte."""
    manifest = json.loads((scenario / "manifest.json").read_text())
    src, rp = full_plan_of(scenario)
    with src.sources() as sources:
        export_safetensors(rp, sources, tmp_path / "export", max_shard_size=12_000, include=include)
    with open_export(tmp_path / "export") as exported:
        back = Planner(Topology.unsharded(), src.topology, exported.index()).plan()
        assert sorted(p.target_rank for p in back.ranks) == sorted(src.rank_files)
        for target in back.ranks:
            written = execute_rank(target, exported, str(tmp_path / f"back_{target.target_rank}.safetensors"),
                                   fmt="safetensors")
            want = source_tensor_hashes(manifest, src.rank_files[target.target_rank])
            if include == "weights":
                want = {n: h for n, h in want.items() if not is_training_state(n)}
            assert written.tensors == want, f"rank {target.target_rank}"


def test_export_of_a_mindspore_checkpoint_round_trips(tmp_path, helpers):
    """A MindSpore .ckpt source (S1: 8 ranks with a strategy file) exports and converts back."""
    strategy = Topology.from_strategy(read_strategy(S1 / "src_strategy.ckpt"))
    files = {r: str(S1 / "src_checkpoints" / f"rank_{r}" / f"checkpoint_{r}.ckpt") for r in range(8)}
    with SourceFiles(files) as sources:
        (rp,) = Planner(strategy, None, sources.index()).plan().ranks
        result = export_safetensors(rp, sources, tmp_path / "export", max_shard_size="100KB")
    assert [s.names for s in result.layout.shards][:2] == [["layer1.bias"], ["layer1.weight"]]  # 100 352 B: alone
    with open_export(tmp_path / "export") as exported:
        back = Planner(Topology.unsharded(), strategy, exported.index()).plan()
        for target in back.ranks:
            written = execute_rank(target, exported, str(tmp_path / f"back_{target.target_rank}.ckpt"))
            want = helpers.tensor_sha256s(files[target.target_rank])
            assert written.tensors == {n: h for n, h in want.items() if n in written.tensors}
            assert set(written.tensors) == {n for n in want if not is_training_state(n)}


def test_open_export_checks_the_folder_against_its_index(tmp_path):
    src, rp = full_plan_of(M1B)
    with src.sources() as sources:
        export_safetensors(rp, sources, tmp_path, max_shard_size=12_000)
    index_path = tmp_path / INDEX_FILE
    doc = json.loads(index_path.read_text())
    name = next(iter(doc["weight_map"]))
    files = sorted(set(doc["weight_map"].values()))
    doc["weight_map"][name] = files[-1] if doc["weight_map"][name] != files[-1] else files[0]
    index_path.chmod(0o644)
    index_path.write_text(json.dumps(doc))
    with pytest.raises(FormatError, match=re.escape(name)):
        open_export(tmp_path)
    doc["weight_map"][name] = "../elsewhere.safetensors"
    index_path.write_text(json.dumps(doc))
    with pytest.raises(FormatError, match="not a file of the export folder"):
        open_export(tmp_path)
    index_path.unlink()
    with pytest.raises(FormatError, match="index not found"):
        open_export(tmp_path)
