"""MindFormers 2.x checkpoint folders: parsing metadata.json, the synthesized strategy, the
multi-file rank reader, redundancy-removed saves, and one-line errors for broken folders.

The shard rule is checked against a reference written from the prose of the spec
(mindformers-checkpoint-format §3.2), not against the module's own helpers; synthetic saves are
written spec-exactly by ``write_mf_save``; both live in ``tests/mf_save.py``.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
from math import prod
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard_job.errors import FormatError, PlanError, ReshardError
from reshard_job.execute.rank_task import execute_rank
from reshard_job.formats.ckpt import CheckpointReader
from reshard_job.formats.mindformers_metadata import MindFormersFormatError, parse_metadata
from reshard_job.sources.mindformers import is_mindformers_checkpoint
from reshard_job.sources.mindformers_save import load_mindformers, resolve_iteration
from reshard_job.sources.mindformers_layouts import synthesize_strategy
from reshard_job.formats.multifile import MultiFileReader, MultiFileSources
from reshard_job.formats.safetensors import save_file
from reshard_job.core.strategy_model import ParamLayout
from reshard_job.core.layout import Layout
from reshard_job.plan.planner import Planner
from reshard_job.core.topology import Topology

from mf_save import (  # tests/mf_save.py (tests/ is on sys.path through its conftest)
    bf16, dedup_params, dedup_writer, f32, spec_box, spec_fragments, spec_shard, write_mf_save,
)

GOLDEN = Path(__file__).resolve().parents[2] / "golden"
M1A = GOLDEN / "M1a_mf_llama_dp2mp2os_bf16_to_mp4"
M1B = GOLDEN / "M1b_mf_llama_pp2dp2mp2os2_to_mp4"
M1A_ITERATION = "iteration_00000020"


def reassemble(src, name: str) -> np.ndarray:
    """A global tensor from its shards, each read from one holder's files (spec §4)."""
    p = src.params[name]
    out = None
    for k, holders in src.holders(name).items():
        with src.reader(holders[0]) as r:
            part = r.read(name)
        if out is None:
            out = np.zeros(p.global_shape, dtype=part.dtype)
        out[tuple(slice(a, b) for a, b in spec_box(k, p.global_shape, p.fragments))] = part
    return out


# ================================================================================ goldens


def test_m1a_is_described_as_saved():
    src = load_mindformers(M1A / "src_mindformers")
    assert src.iteration == 20 and src.folder.endswith(M1A_ITERATION)
    assert (src.devices, src.topology.num_stages, src.deduplicated) == (4, 1, False)
    assert {r: [os.path.basename(f) for f in fs] for r, fs in src.rank_files.items()} == {
        r: [f"llama-model-{r:07d}-0000004.safetensors", f"llama-opt-{r:07d}-0000004.safetensors"] for r in range(4)}
    assert len(src.params) == 63 and src.unreferenced == ()
    wq = src.params["model.layers.0.attention.wq.weight"]
    assert wq.dtype == "BFloat16" and wq.fragments == (4, 1)
    assert [wq.shard_of(r) for r in range(4)] == [0, 2, 1, 3]  # the spec's worked example
    assert src.strategy.layouts["model.layers.0.attention.wq.weight"] == ParamLayout(
        (2, 2), ((0, 1), -1), tensor_shape=(32, 32))
    assert src.holders("model.tok_embeddings.embedding_weight") == {0: (0, 1, 2, 3)}
    assert src.extras() == {"learning_rate": [0, 1, 2, 3], "global_step": [0, 1, 2, 3]}
    assert src.read_common()["global_step"] == 20
    index = src.index()
    assert index[1]["model.layers.0.attention.wq.weight"].shape == (8, 32)
    assert index[1]["global_step"].dtype == "Int32"


def test_m1b_pipeline_stages_become_merged_keys():
    src = load_mindformers(M1B / "src_mindformers")
    topo = src.topology
    assert (topo.stage_devices, topo.num_stages, src.iteration) == (4, 2, 30)
    assert src.strategy.merged
    assert topo.stages_of("lm_head.weight") == [1]
    assert topo.stages_of("model.tok_embeddings.embedding_weight") == [0]
    assert src.holders("lm_head.weight") == {0: (4, 6), 1: (5, 7)}
    assert src.stored_by(5)["lm_head.weight"] == 1


@pytest.mark.parametrize("scenario", [M1A, M1B], ids=lambda p: p.name[:3])
def test_golden_slices_agree_with_synthesized_layouts(scenario):
    """Every stored slice is exactly the box the planner's Layout gives its rank, and the box the
    spec's shard rule gives; and every tensor's bytes are the ones the manifest lists."""
    manifest = json.loads((scenario / "manifest.json").read_text())
    src = load_mindformers(scenario / "src_mindformers")
    topo = src.topology
    checked = 0
    for name, p in src.params.items():
        stage = topo.lowest_stage(name)
        layout = Layout.from_recorded(topo.layout(name, stage), len(p.global_shape), topo.stage_devices, name)
        whole = reassemble(src, name)
        for position, rank in enumerate(p.layout.rank_list):
            k = spec_shard(position, p.layout.device_matrix, p.layout.tensor_map, p.fragments)
            assert p.shard_of(rank) == k
            assert layout.box(position, p.global_shape) == spec_box(k, p.global_shape, p.fragments)
            with src.reader(rank) as r:
                part = r.read(name)
                file_name = os.path.basename(r.file_of(name))
            want = manifest["src_mindformers_files"][file_name][name]
            assert part.shape == tuple(want["shape"])
            assert hashlib.sha256(part.tobytes()).hexdigest() == want["sha256"]
            box = layout.box(position, p.global_shape)
            assert np.array_equal(whole[tuple(slice(a, b) for a, b in box)], part)
            checked += 1
    assert checked > 200


def test_detection():
    assert is_mindformers_checkpoint(M1A / "src_mindformers")
    assert is_mindformers_checkpoint(M1A / "src_mindformers" / M1A_ITERATION)
    assert not is_mindformers_checkpoint(GOLDEN / "S1_mlp_tutorial_8to4" / "src_checkpoints")
    assert not is_mindformers_checkpoint(M1A / "manifest.json")
    assert not is_mindformers_checkpoint(M1A / "nowhere")


def test_iteration_folder_given_directly():
    src = load_mindformers(M1A / "src_mindformers" / M1A_ITERATION)
    assert src.iteration is None and src.devices == 4


# ================================================================================ iterations


@pytest.fixture
def m1a_copy(tmp_path) -> Path:
    """A writable copy of M1a's MindFormers folder."""
    root = tmp_path / "mf"
    shutil.copytree(M1A / "src_mindformers", root)
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            os.chmod(os.path.join(dirpath, n), 0o755 if n in dirnames else 0o644)
    return root


def one_line(excinfo, *needles: str) -> str:
    msg = str(excinfo.value)
    assert isinstance(excinfo.value, ReshardError)
    assert "\n" not in msg and len(msg) < 400, msg
    for needle in needles:
        assert needle in msg, (needle, msg)
    return msg


def test_iteration_selection(m1a_copy):
    shutil.copytree(m1a_copy / M1A_ITERATION, m1a_copy / "iteration_00000010")
    assert load_mindformers(m1a_copy).iteration == 20  # the tracker's
    assert load_mindformers(m1a_copy, iteration=10).folder == str(m1a_copy / "iteration_00000010")
    with pytest.raises(MindFormersFormatError) as ei:
        load_mindformers(m1a_copy, iteration=5)
    one_line(ei, str(m1a_copy), "iteration 5 does not exist", "[10, 20]")


def test_tracker_naming_a_missing_folder(m1a_copy):
    (m1a_copy / "latest_checkpointed_iteration.txt").write_text("30")
    with pytest.raises(MindFormersFormatError) as ei:
        resolve_iteration(m1a_copy)
    one_line(ei, "latest_checkpointed_iteration.txt", "iteration 30", "iteration_00000030/ is missing", "[20]")


def test_garbled_tracker(m1a_copy):
    (m1a_copy / "latest_checkpointed_iteration.txt").write_bytes(b"\xff\xfe")
    with pytest.raises(MindFormersFormatError) as ei:
        load_mindformers(m1a_copy)
    one_line(ei, "latest_checkpointed_iteration.txt", "decimal iteration number")


def test_iterations_without_tracker_need_a_choice(m1a_copy):
    (m1a_copy / "latest_checkpointed_iteration.txt").unlink()
    with pytest.raises(MindFormersFormatError) as ei:
        load_mindformers(m1a_copy)
    one_line(ei, "source.iteration", "[20]")
    assert load_mindformers(m1a_copy, iteration=20).devices == 4


# ================================================================================ broken folders


def edit_metadata(root: Path, change) -> Path:
    path = root / M1A_ITERATION / "metadata.json"
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc, separators=(",", ":")))
    return path


WQ = "model.layers.0.attention.wq.weight"
WQ_KEY = str((WQ, (2,)))


def _set(path: list, value):
    def change(doc):
        node = doc
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return change


def _delete(path: list):
    def change(doc):
        node = doc
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]
    return change


def shift_ranks(doc, by: int) -> None:
    """Every rank moved up by `by`, consistently across layouts and storage_data."""
    for p in doc["state_dict_metadata"].values():
        p["layout"]["rank_list"] = [r + by for r in p["layout"]["rank_list"]]
    for entries in doc["storage_data"].values():
        for e in entries:
            e["storage_rank"] += by
            e["rank_group"] = [r + by for r in e["rank_group"]]


BROKEN_METADATA = [
    ("dtype", _set(["state_dict_metadata", WQ, "properties", "dtype"], "float16"),
     ["llama-model-0000000-0000004.safetensors", WQ, "BFloat16 [8, 32] in the file", "Float16 [8, 32]"]),
    ("shape", lambda d: (_set(["state_dict_metadata", WQ, "global_shape"], [64, 32])(d),
                         [c.update(local_shape=[16, 32]) for c in d["state_dict_metadata"][WQ]["chunk"]]),
     ["llama-model-0000000-0000004.safetensors", WQ, "[8, 32] in the file", "[16, 32]"]),
    ("unknown dtype", _set(["state_dict_metadata", WQ, "properties", "dtype"], "qint4x2"),
     ["metadata.json", WQ, "unsupported dtype"]),
    ("fragments contradict layout", _set(["state_dict_metadata", WQ, "axis_fragmentations"], [2, 1]),
     ["metadata.json", WQ, "contradict", "tensor_map [[0, 1], -1]"]),
    ("indivisible shape", lambda d: (_set(["state_dict_metadata", WQ, "global_shape"], [30, 32])(d)),
     ["metadata.json", WQ, "cannot be split into 4"]),
    ("chunk shape", _set(["state_dict_metadata", WQ, "chunk", 0, "local_shape"], [4, 32]),
     ["metadata.json", WQ, "local_shape [4, 32]"]),
    ("missing chunk", lambda d: d["state_dict_metadata"][WQ]["chunk"].pop(),
     ["metadata.json", WQ, "chunks lack shard(s) [3]"]),
    ("tensor map axis", _set(["state_dict_metadata", WQ, "layout", "tensor_map"], [[0, 2], -1]),
     ["metadata.json", WQ, "device axes -1..1"]),
    ("rank list", _set(["state_dict_metadata", WQ, "layout", "rank_list"], [0, 1, 2]),
     ["metadata.json", WQ, "4 distinct ranks"]),
    ("interleaved", _set(["state_dict_metadata", WQ, "layout", "interleaved_parallel"], True),
     ["metadata.json", WQ, "interleaved"]),
    ("no layout key", _delete(["state_dict_metadata", WQ, "layout"]), ["metadata.json", WQ, "lacks 'layout'"]),
    ("storage rank contradicts layout", _set(["storage_data", WQ_KEY, 0, "storage_rank"], 2),
     ["metadata.json", WQ, "shard 2", "layout gives rank 2 shard 1"]),
    ("storage entry missing", _delete(["storage_data", WQ_KEY]),
     ["metadata.json", WQ, "shard(s) [2] have no storage_data entry"]),
    ("storage key garbled", lambda d: d["storage_data"].__setitem__("wq-2", d["storage_data"].pop(WQ_KEY)),
     ["metadata.json", "storage_data key 'wq-2'"]),
    ("storage names unknown parameter",
     lambda d: d["storage_data"].__setitem__(str(("nope", (0,))), d["storage_data"][WQ_KEY]),
     ["metadata.json", "'nope'", "does not describe"]),
    ("file outside the folder", _set(["storage_data", WQ_KEY, 0, "file_name"], "../x.safetensors"),
     ["metadata.json", WQ, "must be a file of the iteration folder"]),
    ("one file for two ranks",
     _set(["storage_data", WQ_KEY, 0, "file_name"], "llama-model-0000000-0000004.safetensors"),
     ["metadata.json", "ranks 0 and 1", "llama-model-0000000-0000004.safetensors"]),
    ("no parameters", _set(["state_dict_metadata"], {}), ["metadata.json", "describes no parameter"]),
    ("pipeline gap", lambda d: shift_ranks(d, 8), ["metadata.json", "no parameter lives in pipeline stage(s) [0, 1]"]),
    ("rank list not a stage", lambda d: shift_ranks(d, 1),
     ["metadata.json", "not one pipeline stage of 4 consecutive"]),
]


@pytest.mark.parametrize("change,needles", [pytest.param(c, n, id=i) for i, c, n in BROKEN_METADATA])
def test_broken_metadata_is_one_line_naming_file_and_parameter(m1a_copy, change, needles):
    edit_metadata(m1a_copy, change)
    with pytest.raises(MindFormersFormatError) as ei:
        load_mindformers(m1a_copy)
    one_line(ei, *needles)


def test_garbled_metadata(m1a_copy):
    path = m1a_copy / M1A_ITERATION / "metadata.json"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(MindFormersFormatError) as ei:
        load_mindformers(m1a_copy)
    one_line(ei, str(path), "not valid JSON")
    path.write_bytes(b"")
    with pytest.raises(MindFormersFormatError) as ei:
        load_mindformers(m1a_copy)
    one_line(ei, str(path), "empty")
    path.write_text("[1, 2]")
    with pytest.raises(MindFormersFormatError) as ei:
        load_mindformers(m1a_copy)
    one_line(ei, str(path), "'state_dict_metadata'")


def test_missing_metadata_of_a_multi_rank_save(m1a_copy):
    (m1a_copy / M1A_ITERATION / "metadata.json").unlink()
    with pytest.raises(MindFormersFormatError) as ei:
        load_mindformers(m1a_copy)
    one_line(ei, "metadata.json", "not found", "4 ranks")


def test_missing_shard_file(m1a_copy):
    (m1a_copy / M1A_ITERATION / "llama-opt-0000002-0000004.safetensors").unlink()
    with pytest.raises(MindFormersFormatError) as ei:
        load_mindformers(m1a_copy)
    msg = one_line(ei, "llama-opt-0000002-0000004.safetensors", "file not found", "(rank 2)")
    assert "adam_" in msg


def test_file_lacking_a_tensor_and_file_holding_a_stray_one(m1a_copy, tmp_path):
    folder = m1a_copy / M1A_ITERATION
    name = "llama-model-0000001-0000004.safetensors"
    with MultiFileReader([folder / name]) as r:
        tensors = {n: r.read(n) for n in r.names()}
        kinds = {n: r[n].dtype for n in r.names()}
    del tensors[WQ]
    (folder / name).unlink()
    save_file(folder / name, tensors, dtype_overrides=kinds)
    with pytest.raises(MindFormersFormatError) as ei:
        load_mindformers(m1a_copy)
    one_line(ei, name, f"lacks parameter '{WQ}'")
    # metadata.json moved that shard elsewhere, but the file still holds it
    other = tmp_path / "other"
    shutil.copytree(M1A / "src_mindformers", other)
    for dirpath, dirnames, filenames in os.walk(other):
        for n in dirnames + filenames:
            os.chmod(os.path.join(dirpath, n), 0o755 if n in dirnames else 0o644)

    def move(doc):
        name = "model.layers.0.attention_norm.weight"
        key = str((name, (0,)))
        doc["storage_data"][key] = [e for e in doc["storage_data"][key] if e["storage_rank"] != 3]
    edit_metadata(other, move)
    with pytest.raises(MindFormersFormatError) as ei:
        load_mindformers(other)
    one_line(ei, "llama-model-0000003-0000004.safetensors", "model.layers.0.attention_norm.weight",
             "places none of its shards in this file")


def test_corrupt_shard_file_names_the_file(m1a_copy):
    path = m1a_copy / M1A_ITERATION / "llama-model-0000003-0000004.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(FormatError) as ei:
        load_mindformers(m1a_copy)
    one_line(ei, str(path))


def test_not_a_folder(tmp_path):
    with pytest.raises(MindFormersFormatError) as ei:
        load_mindformers(tmp_path / "nowhere")
    one_line(ei, "nowhere", "not a directory")
    with pytest.raises(MindFormersFormatError) as ei:
        load_mindformers(tmp_path)
    one_line(ei, "metadata.json", "not found", "no .safetensors")


def test_single_rank_save_without_metadata(tmp_path):
    folder = tmp_path / "iteration_00000003"
    folder.mkdir()
    save_file(folder / "model-0000000-0000001.safetensors", {"w": f32((4, 2), 1)})
    save_file(folder / "opt-0000000-0000001.safetensors", {"adam_m.w": f32((4, 2), 2)})
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("3")
    src = load_mindformers(tmp_path)
    assert src.strategy is None and src.devices == 1 and src.params == {}
    assert sorted(src.index()[0]) == ["adam_m.w", "w"]


# ================================================================================ multi-file reader


def test_multi_file_reader_dispatches_and_shares_one_address_space(tmp_path):
    a, b = f32((3, 4), 1), bf16((5, 2), 2)
    save_file(tmp_path / "one.safetensors", {"a": a})
    save_file(tmp_path / "two.safetensors", {"b": b, "c": np.arange(3, dtype=np.int64)},
              dtype_overrides={"b": "BFloat16"})
    with MultiFileReader([tmp_path / "one.safetensors", tmp_path / "two.safetensors"]) as r:
        assert sorted(r.names()) == ["a", "b", "c"] and "b" in r and len(r) == 3
        assert r.path == str(tmp_path / "{one.safetensors, two.safetensors}")
        assert r["b"].dtype == "BFloat16" and r.file_of("b").endswith("two.safetensors")
        assert np.array_equal(r.read_box("a", ((1, 3), (0, 4))), a[1:3])
        assert np.array_equal(r.read("b"), b)
        assert b"".join(bytes(x) for x in r.iter_content("c", 8)) == np.arange(3, dtype=np.int64).tobytes()
        for name, want in (("a", a.tobytes()), ("b", b.tobytes())):
            (offset, length), = r[name].pieces
            assert r.pread(offset, length) == want
        size_one = os.path.getsize(tmp_path / "one.safetensors")
        with pytest.raises(FormatError):
            r.pread(size_one - 2, 4)  # would run from one file into the next


def test_multi_file_reader_refuses_a_name_in_two_files(tmp_path):
    save_file(tmp_path / "one.safetensors", {"a": f32((2,), 1)})
    save_file(tmp_path / "two.safetensors", {"a": f32((2,), 2)})
    with pytest.raises(FormatError) as ei:
        MultiFileReader([tmp_path / "one.safetensors", tmp_path / "two.safetensors"])
    one_line(ei, "two.safetensors", "'a'", "one.safetensors")


def test_multi_file_sources(tmp_path):
    save_file(tmp_path / "one.safetensors", {"a": f32((2,), 1)})
    with MultiFileSources({0: [tmp_path / "one.safetensors"]}) as s:
        assert s.index()[0]["a"].shape == (2,)
        with pytest.raises(PlanError):
            s.reader(1)


# ================================================================================ layouts, property


@st.composite
def metadata_layouts(draw):
    dev = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    ndim = draw(st.integers(1, 3))
    owner = [draw(st.integers(-1, ndim - 1)) for _ in dev]  # which dimension each axis splits
    tmap = []
    for d in range(ndim):
        axes = draw(st.permutations([m for m in range(len(dev)) if owner[m] == d]))
        tmap.append(-1 if not axes else (axes[0] if len(axes) == 1 and draw(st.booleans()) else list(axes)))
    frags = spec_fragments(dev, tmap)
    shape = [f * draw(st.integers(1, 2)) for f in frags]
    return dev, tmap, frags, shape


@settings(max_examples=150, deadline=None)
@given(metadata_layouts(), st.integers(0, 2))
def test_any_metadata_layout_gives_the_spec_shard_and_box(layout, stage):
    dev, tmap, frags, shape = layout
    n = prod(dev)
    ranks = list(range(stage * n, (stage + 1) * n))
    rank_shards = [spec_shard(i, dev, tmap, frags) for i in range(n)]
    groups = {}
    for i, k in enumerate(rank_shards):
        groups.setdefault(k, []).append(ranks[i])
    doc = {"state_dict_metadata": {"p": {
        "properties": {"dtype": "float32"}, "global_shape": shape, "axis_fragmentations": frags,
        "layout": {"device_matrix": dev, "tensor_map": tmap, "rank_list": ranks},
        "chunk": [{"global_offset": [k], "local_shape": [g // f for g, f in zip(shape, frags)]}
                  for k in dict.fromkeys(rank_shards)]}},
        "storage_data": {str(("p", (k,))): [{"file_name": f"f{r}", "storage_rank": r, "rank_group": g} for r in g]
                         for k, g in groups.items()}}
    params = parse_metadata(json.dumps(doc).encode(), "metadata.json")
    p = params["p"]
    if stage == 0:
        sf = synthesize_strategy(params, "metadata.json")
        topo = Topology.from_strategy(sf)
        layout_obj = Layout.from_recorded(topo.layout("p", 0), len(shape), topo.stage_devices, "p")
    for i, r in enumerate(ranks):
        k = rank_shards[i]
        assert p.shard_of(r) == k
        assert p.shard_box(k) == spec_box(k, shape, frags)
        if stage == 0:
            assert layout_obj.box(i, tuple(shape)) == p.shard_box(k)


def test_spec_examples_of_split_device_axes():
    """The held-back dp4 x mp2, optimizer_weight_shard_size=2 sample (spec §3.2): wq's dp axis split
    2 x 2 gives rank r shard 2*(r%2) + (r//2)%2; lm_head's size-2 axis on the right gives r%2."""
    def param(dev, tmap, shape):
        frags = spec_fragments(dev, tmap)
        shards = [spec_shard(i, dev, tmap, frags) for i in range(8)]
        groups = {}
        for r, k in enumerate(shards):
            groups.setdefault(k, []).append(r)
        return {"properties": {"dtype": "bfloat16"}, "global_shape": shape, "axis_fragmentations": frags,
                "layout": {"device_matrix": dev, "tensor_map": tmap, "rank_list": list(range(8))},
                "chunk": [{"global_offset": [k], "local_shape": [g // f for g, f in zip(shape, frags)]}
                          for k in dict.fromkeys(shards)]}, groups
    wq, wq_groups = param([2, 2, 2], [[0, 1], -1], [16, 8])
    head, head_groups = param([4, 2], [0, -1], [8, 8])
    storage = {str((n, (k,))): [{"file_name": f"m{g[0]}", "storage_rank": g[0], "rank_group": g}]
               for n, groups in (("wq", wq_groups), ("lm_head", head_groups)) for k, g in groups.items()}
    params = parse_metadata(json.dumps({"state_dict_metadata": {"wq": wq, "lm_head": head},
                                        "storage_data": storage}).encode(), "metadata.json")
    assert [params["wq"].shard_of(r) for r in range(8)] == [2 * (r % 2) + (r // 2) % 2 for r in range(8)]
    assert [params["lm_head"].shard_of(r) for r in range(8)] == [r % 2 for r in range(8)]
    assert params["lm_head"].holders(1) == (1,)  # one entry each: a redundancy-removed description


# ================================================================================ synthetic saves


def split_axis_params():
    """8 ranks with the split-axis layouts of the spec's held-back sample, plus a replicated norm."""
    ranks = list(range(8))
    return {
        "model.wq.weight": (bf16((16, 8), 1), "BFloat16", [2, 2, 2], [[0, 1], -1], ranks),
        "lm_head.weight": (bf16((8, 8), 2), "BFloat16", [4, 2], [0, -1], ranks),
        "model.norm.weight": (f32((8,), 3), "Float32", [4, 2], [-1], ranks),
        "adam_m.model.wq.weight": (f32((16, 8), 4), "Float32", [2, 2, 2], [[0, 1], -1], ranks),
    }


def test_synthetic_split_axis_save_converts_to_full_tensors(tmp_path):
    params = split_axis_params()
    write_mf_save(tmp_path / "mf", params, world=8,
                  extras={"global_step": np.array([7], dtype=np.int32), "learning_rate": np.array(0.5, np.float32)})
    src = load_mindformers(tmp_path / "mf")
    assert (src.devices, src.deduplicated, src.iteration) == (8, False, 7)
    plan = Planner(src.topology, None, src.index()).plan()
    with src.sources() as sources:
        written = execute_rank(plan.ranks[0], sources, str(tmp_path / "full.ckpt"))
    with CheckpointReader(written.path) as r:
        for name, (array, *_rest) in params.items():
            assert np.array_equal(r.read(name), array), name
        assert r.read("global_step").tolist() == [7]


def test_redundancy_removed_save_is_described_by_storage_data(tmp_path):
    params = dedup_params()
    write_mf_save(tmp_path / "mf", params, stored_by=dedup_writer, world=4)
    src = load_mindformers(tmp_path / "mf")
    assert src.deduplicated and src.devices == 4
    # opt files are numbered over the ranks that stored an opt shard (2 and 3), not by rank
    assert {r: [os.path.basename(f) for f in fs] for r, fs in src.rank_files.items()} == {
        0: ["llama-model-0000000-0000004.safetensors"],
        1: ["llama-model-0000001-0000004.safetensors"],
        2: ["llama-model-0000002-0000004.safetensors", "llama-opt-0000000-0000002.safetensors"],
        3: ["llama-model-0000003-0000004.safetensors", "llama-opt-0000001-0000002.safetensors"],
    }
    assert src.holders("model.wo.weight") == {0: (2,), 1: (1,)}
    assert src.holders("model.norm.weight") == {0: (3,)}
    assert src.params["model.wo.weight"].locations[0][0].rank_group == (0, 2)
    assert src.stored_by(3) == {"model.wq.weight": 3, "model.norm.weight": 0,
                                "adam_m.model.wo.weight": 1, "adam_m.model.norm.weight": 0}
    assert src.stored_by(0) == {"model.wq.weight": 0}
    index = src.index()
    assert sorted(index[0]) == ["model.wq.weight"]
    assert index[1]["model.wo.weight"].shape == (4, 4)
    assert src.extras() == {}
    for name, (array, *_rest) in params.items():
        assert np.array_equal(reassemble(src, name), array), name


def test_redundancy_removed_save_converts_to_the_saved_tensors(tmp_path):
    """A redundancy-removed save (each shard stored by one rank only) is planned from whichever rank
    holds each slice, and the full checkpoint holds exactly the saved tensors."""
    params = dedup_params()
    write_mf_save(tmp_path / "mf", params, stored_by=dedup_writer, world=4)
    src = load_mindformers(tmp_path / "mf")
    plan = Planner(src.topology, None, src.index()).plan()
    with src.sources() as sources:
        written = execute_rank(plan.ranks[0], sources, str(tmp_path / "full.ckpt"))
    with CheckpointReader(written.path) as r:
        assert sorted(r.names()) == sorted(params)
        for name, (array, *_rest) in params.items():
            assert np.array_equal(r.read(name), array), name


# ================================================================================ robustness


def small_m1a_metadata() -> dict:
    """M1a's metadata.json cut down to three parameters (sharded, replicated, optimizer state)."""
    doc = json.loads((M1A / "src_mindformers" / M1A_ITERATION / "metadata.json").read_text())
    keep = {WQ, "model.norm_out.weight", "adam_m.lm_head.weight"}
    return {"state_dict_metadata": {n: v for n, v in doc["state_dict_metadata"].items() if n in keep},
            "storage_data": {k: v for k, v in doc["storage_data"].items() if ast.literal_eval(k)[0] in keep}}


SMALL_M1A = small_m1a_metadata()
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 40) | st.floats(allow_nan=True) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_mutated_metadata_fails_with_one_line_errors_only(data):
    """Random structural damage to a real metadata.json: parsed, or refused with our error, never a crash."""
    doc = json.loads(json.dumps(SMALL_M1A))
    for _ in range(data.draw(st.integers(1, 3))):
        node = doc
        while True:
            keys = list(node) if isinstance(node, dict) else list(range(len(node)))
            if not keys:
                break
            key = data.draw(st.sampled_from(keys))
            child = node[key]
            if isinstance(child, (dict, list)) and child and data.draw(st.integers(0, 4)):
                node = child
                continue
            if isinstance(node, dict) and data.draw(st.booleans()):
                del node[key]
            else:
                node[key] = data.draw(json_values)
            break
    try:
        params = parse_metadata(json.dumps(doc).encode(), "metadata.json")
        sf = synthesize_strategy(params, "metadata.json")
        if sf is not None:
            Topology.from_strategy(sf)
    except ReshardError as e:
        assert "\n" not in str(e) and len(str(e)) < 600


def test_each_rank_keeps_only_the_files_the_plan_reads_from():
    """Left out of the target, the optimizer states' `-opt-` files are not read (nor hashed), but for
    rank 0's, which holds `global_step` and `learning_rate` too."""
    from reshard_job.job.config.spec import SourceSpec, TargetSpec
    from reshard_job.job.stages.prepare import prepare

    source = SourceSpec(str(M1A / "src_mindformers"))
    with prepare(source, TargetSpec(devices=1)) as every:
        assert all(len(files) == 2 for files in every.readers.paths.values())
    with prepare(source, TargetSpec(devices=1, exclude=("adam_*",))) as weights:
        kept = weights.readers.paths
    assert sorted(kept) == [0, 1, 2, 3] and all(len(kept[r]) == 1 and "-model-" in kept[r][0] for r in (1, 2, 3))
    assert [f.rsplit("-", 3)[1] for f in kept[0]] == ["model", "opt"]
