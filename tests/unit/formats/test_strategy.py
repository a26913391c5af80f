"""Strategy files (spec/strategy-format.md): protobuf and JSON, the `.json` naming rule, parameter
names with `-`, multi-axis tensor maps, and merging per-stage pipeline files."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reshard_job
from reshard_job.errors import ReshardError, StrategyFormatError
from reshard_job.formats import wire
import reshard_job.formats.proto_schema as schema
from reshard_job.core.strategy_model import FORMAT_JSON, FORMAT_PROTOBUF, ParamLayout, StrategyFile, StrategyItem
from reshard_job.formats.strategy import (format_for, merge_pipeline_strategies, merge_pipeline_strategys,
                                          read_strategy, to_json_bytes, to_protobuf_bytes, write_strategy)
from reshard_job.core.layout import Layout
from reshard_job.core.topology import Topology

GOLDEN = Path(__file__).resolve().parents[2] / "golden"
GOLDEN_STRATEGIES = sorted(p for p in GOLDEN.glob("*/**/*.ckpt") if "checkpoints" not in str(p) and "expected" not in str(p))
PIPELINE = GOLDEN / "S3_pipeline2x4opt_to_4"


def relname(p: Path) -> str:
    return str(p.relative_to(GOLDEN))


def assert_strategy_error(path, fn=read_strategy, match: str | None = None):
    with pytest.raises(StrategyFormatError) as ei:
        fn(path)
    assert isinstance(ei.value, ReshardError)
    assert str(path) in str(ei.value)
    if match:
        assert match in str(ei.value)
    return ei.value


def normalised(tensor_map) -> tuple:
    return tuple(e if isinstance(e, tuple) else (e,) for e in tensor_map)


# ================================================================================ golden files


def test_golden_strategies_present():
    names = {relname(p) for p in GOLDEN_STRATEGIES}
    assert "S3_pipeline2x4opt_to_4/src_strategy_merged.ckpt" in names
    assert "S3_pipeline2x4opt_to_4/src_strategy_dir/stage0.ckpt" in names
    assert len(names) >= 10


@pytest.mark.parametrize("path", GOLDEN_STRATEGIES, ids=relname)
def test_golden_strategy_protobuf_round_trip(path, tmp_path):
    raw = path.read_bytes()
    sf = read_strategy(path)
    assert sf.format == FORMAT_PROTOBUF
    assert sf.layouts and sf.items
    assert to_protobuf_bytes(sf) == raw
    size, _ = write_strategy(sf, tmp_path / "again.ckpt")
    assert (tmp_path / "again.ckpt").read_bytes() == raw
    assert size == len(raw)


@pytest.mark.parametrize("path", GOLDEN_STRATEGIES, ids=relname)
def test_golden_strategy_json_round_trip(path, tmp_path):
    sf = read_strategy(path)
    write_strategy(sf, tmp_path / "s.json")
    back = read_strategy(tmp_path / "s.json")
    assert back.format == FORMAT_JSON
    assert back.layouts == sf.layouts
    assert list(back.layouts) == list(sf.layouts)
    assert back.items == sf.items
    assert back.current_stage == sf.current_stage
    obj = json.loads((tmp_path / "s.json").read_text())
    assert list(obj) == ["current_stage", "parallel_strategy_item", "parallel_layout_item"]
    # and back to protobuf, byte for byte
    assert to_protobuf_bytes(back) == path.read_bytes()


def test_operator_items_of_equal_strategies_share_one_tuple(tmp_path):
    """A target strategy of a million operator items held a tuple of tuples per item (581 MB): equal
    strategies are one object, and the file is written back byte for byte."""
    items = [StrategyItem(f"op{i}", 0, ((1, 8), (8, 1)) if i % 2 else ((2, 4),)) for i in range(1000)]
    sf = StrategyFile({"w": ParamLayout((8,), (0, -1))}, items)
    path = tmp_path / "s.ckpt"
    write_strategy(sf, path)
    again = read_strategy(path)
    assert again.items == items and to_protobuf_bytes(again) == path.read_bytes()
    assert len({id(it.strategies) for it in again.items}) == 2


def test_golden_layout_values():
    sf = read_strategy(GOLDEN / "S1_mlp_tutorial_8to4" / "src_strategy.ckpt")
    topo = Topology.from_strategy(sf)
    assert topo.stage_devices == 8 and topo.num_stages == 1
    merged = read_strategy(PIPELINE / "src_strategy_merged.ckpt")
    assert merged.merged
    topo = Topology.from_strategy(merged)
    assert (topo.stage_devices, topo.num_stages) == (4, 2)
    assert topo.stages_of("embedding_table") == [0]
    assert topo.stages_of("head.weight") == [1]


# ================================================================================ naming rule


@pytest.mark.parametrize("name,fmt", [
    ("s.json", FORMAT_JSON), ("a/b/merged.json", FORMAT_JSON), ("s.ckpt", FORMAT_PROTOBUF),
    ("s.JSON", FORMAT_PROTOBUF), ("s.json.bak", FORMAT_PROTOBUF), ("s", FORMAT_PROTOBUF), ("json", FORMAT_PROTOBUF),
    ("s.pb", FORMAT_PROTOBUF), ("x.jsonl", FORMAT_PROTOBUF),
])
def test_format_follows_the_json_suffix_only(name, fmt):
    assert format_for(name) == fmt


def small_strategy(names=("w",), stage=0) -> StrategyFile:
    return StrategyFile({n: ParamLayout((2, 2), (1, -1)) for n in names}, [StrategyItem("MatMul-op0", stage, ((2, 1),))])


@pytest.mark.parametrize("name", ["s.JSON", "s.json.bak", "s.txt", "strategy"])
def test_json_content_under_a_non_json_name_is_read_as_protobuf(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(to_json_bytes(small_strategy()))
    assert_strategy_error(path, match="protobuf")


def test_protobuf_content_under_a_json_name_fails_as_json(tmp_path):
    path = tmp_path / "s.json"
    path.write_bytes(to_protobuf_bytes(small_strategy()))
    assert_strategy_error(path, match="JSON")


def test_write_strategy_picks_the_format_from_the_name(tmp_path):
    sf = small_strategy()
    write_strategy(sf, tmp_path / "a.json")
    write_strategy(sf, tmp_path / "a.ckpt")
    write_strategy(sf, tmp_path / "a.JSON")
    json.loads((tmp_path / "a.json").read_text())
    assert (tmp_path / "a.ckpt").read_bytes() == (tmp_path / "a.JSON").read_bytes() == to_protobuf_bytes(sf)


def test_json_as_cpp_writes_it_is_read(tmp_path):
    """Compact, sorted keys, with tensor_shape (C++ writer, spec §3.1)."""
    obj = {"current_stage": 1,
           "parallel_layout_item": {"w": {"dev_matrix": [2, 1, 2, 2], "field": 0, "opt_weight_shard_size": 0,
                                          "opt_weight_shard_step": 0, "tensor_map": [2, 1], "tensor_shape": [784, 512]}},
           "parallel_strategy_item": {"MatMul-op": {"parallel_strategy": [[2, 1], [1, 2]], "stage": 0}}}
    path = tmp_path / "cpp.json"
    path.write_text(json.dumps(obj, sort_keys=True, separators=(",", ":")))
    sf = read_strategy(path)
    assert sf.layouts["w"] == ParamLayout((2, 1, 2, 2), (2, 1), 0, 0, (), (), 0, (784, 512))
    assert sf.items == [StrategyItem("MatMul-op", 0, ((2, 1), (1, 2)))]


# ================================================================================ bad files


def test_missing_empty_and_directory(tmp_path):
    assert_strategy_error(tmp_path / "none.ckpt", match="not found")
    (tmp_path / "empty.ckpt").write_bytes(b"")
    assert_strategy_error(tmp_path / "empty.ckpt", match="empty")
    (tmp_path / "empty.json").write_bytes(b"")
    assert_strategy_error(tmp_path / "empty.json", match="empty")
    (tmp_path / "d.ckpt").mkdir()
    assert_strategy_error(tmp_path / "d.ckpt")


@pytest.mark.parametrize("content", [
    b"\xff\xff\xff\xff", b"hello world, not a strategy", b"\x0a\x05abc",
])
def test_corrupt_protobuf(tmp_path, content):
    (tmp_path / "bad.ckpt").write_bytes(content)
    assert_strategy_error(tmp_path / "bad.ckpt")


def test_truncated_golden_protobuf(tmp_path):
    raw = (GOLDEN / "S1_mlp_tutorial_8to4" / "src_strategy.ckpt").read_bytes()
    for cut in (3, len(raw) // 2, len(raw) - 1):
        (tmp_path / f"t{cut}.ckpt").write_bytes(raw[:cut])
        assert_strategy_error(tmp_path / f"t{cut}.ckpt")


def test_a_checkpoint_is_not_a_strategy(tmp_path):
    ckpt = next(GOLDEN.glob("S1_*/src_checkpoints/rank_0/*.ckpt"))
    shutil.copy(ckpt, tmp_path / "strategy.ckpt")
    assert_strategy_error(tmp_path / "strategy.ckpt")


@pytest.mark.parametrize("text", [
    "{not json", "[1, 2, 3]", '"a string"', "{}", '{"parallel_layout_item": []}',
    '{"parallel_layout_item": {"w": {"dev_matrix": [2], "tensor_map": [0]}}}',
    '{"parallel_layout_item": {"w": {"dev_matrix": [2], "tensor_map": ["x"], "field": 0, '
    '"opt_weight_shard_step": 0, "opt_weight_shard_size": 0}}}',
    '{"parallel_layout_item": {"w": {"dev_matrix": "2", "tensor_map": [0], "field": 0, '
    '"opt_weight_shard_step": 0, "opt_weight_shard_size": 0}}}',
    '{"parallel_layout_item": {"w": {"dev_matrix": [2], "tensor_map": [0], "field": null, '
    '"opt_weight_shard_step": 0, "opt_weight_shard_size": 0}}}',
    '{"parallel_layout_item": {"w": [1]}}',
])
def test_corrupt_json(tmp_path, text):
    (tmp_path / "bad.json").write_text(text)
    assert_strategy_error(tmp_path / "bad.json")


def test_non_utf8_json(tmp_path):
    (tmp_path / "bad.json").write_bytes(b"\xff\xfe{}")
    assert_strategy_error(tmp_path / "bad.json")


@settings(deadline=None, max_examples=100, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(min_size=1, max_size=120), suffix=st.sampled_from([".ckpt", ".json"]))
def test_random_bytes_never_raise_bare_errors(tmp_path_factory, data, suffix):
    path = tmp_path_factory.mktemp("s") / f"r{suffix}"
    path.write_bytes(data)
    try:
        sf = read_strategy(path)
    except StrategyFormatError as e:
        assert str(path) in str(e)
        return
    assert isinstance(sf, StrategyFile)


# ================================================================================ names with '-'


def test_dash_in_names_of_a_plain_file(tmp_path):
    sf = StrategyFile({"layer-1.weight": ParamLayout((2,), (0, -1)), "ffn.w-2": ParamLayout((2,), (-1, 0))},
                      [StrategyItem("MatMul-op", 0, ((2, 1),))])
    for name in ("s.ckpt", "s.json"):
        write_strategy(sf, tmp_path / name)
        back = read_strategy(tmp_path / name)
        assert not back.merged
        topo = Topology.from_strategy(back)
        assert sorted(topo.layouts) == ["ffn.w-2", "layer-1.weight"]
        assert topo.stages_of("layer-1.weight") == [0]


def test_dash_in_names_of_a_merged_file(tmp_path):
    stage_dir = tmp_path / "stages"
    for stage in (0, 1):
        sf = StrategyFile({f"block-{stage}.w": ParamLayout((2,), (0,)), "shared-emb": ParamLayout((2,), (-1,))},
                          [StrategyItem(f"op-{stage}", stage, ((2,),))])
        write_strategy(sf, stage_dir / f"stage{stage}.ckpt")
    out = merge_pipeline_strategies(stage_dir, tmp_path / "merged.ckpt")
    merged = read_strategy(out)
    assert list(merged.layouts) == ["0-block-0.w", "0-shared-emb", "1-block-1.w", "1-shared-emb"]
    topo = Topology.from_strategy(merged)
    assert topo.num_stages == 2
    assert topo.stages_of("shared-emb") == [0, 1]
    assert topo.stages_of("block-1.w") == [1]


# ================================================================================ merging


def merged_via_mindspore() -> StrategyFile:
    return read_strategy(PIPELINE / "src_strategy_merged.ckpt")


def test_merge_matches_mindspores_merged_file(tmp_path):
    out = merge_pipeline_strategies(PIPELINE / "src_strategy_dir", tmp_path / "merged.ckpt")
    assert out == str(tmp_path / "merged.ckpt") and os.path.isabs(out)
    ours, theirs = read_strategy(out), merged_via_mindspore()
    assert ours.layouts == theirs.layouts  # same keys, same layouts
    assert sorted(ours.items, key=repr) == sorted(theirs.items, key=repr)
    assert ours.current_stage == theirs.current_stage == 1
    assert Topology.from_strategy(ours).layouts == Topology.from_strategy(theirs).layouts
    # deterministic order: stage 0's file, then stage 1's (MindSpore follows the directory listing)
    s0 = read_strategy(PIPELINE / "src_strategy_dir" / "stage0.ckpt")
    s1 = read_strategy(PIPELINE / "src_strategy_dir" / "stage1.ckpt")
    assert list(ours.layouts) == [f"0-{n}" for n in s0.layouts] + [f"1-{n}" for n in s1.layouts]
    assert ours.items == s0.items + s1.items


def test_merge_alias_and_top_level_exports():
    assert merge_pipeline_strategys is merge_pipeline_strategies
    assert reshard_job.merge_pipeline_strategys is reshard_job.merge_pipeline_strategies


def test_merge_is_deterministic_whatever_the_file_names(tmp_path):
    a = merge_pipeline_strategys(PIPELINE / "src_strategy_dir", tmp_path / "a.ckpt")
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    # listing order reversed, and every rank's (identical) copy of its stage's file present
    for rank in range(8):
        stage = rank // 4
        shutil.copy(PIPELINE / "src_strategy_dir" / f"stage{stage}.ckpt", renamed / f"{'zyxwvuts'[rank]}_rank{rank}.ckpt")
    b = merge_pipeline_strategies(renamed, tmp_path / "b.ckpt")
    assert Path(a).read_bytes() == Path(b).read_bytes()
    c = merge_pipeline_strategies(PIPELINE / "src_strategy_dir", tmp_path / "c")  # any non-.json name: protobuf
    assert Path(c).read_bytes() == Path(a).read_bytes()


def test_merge_json_stage_files(tmp_path):
    jdir = tmp_path / "json_stages"
    for stage in (0, 1):
        write_strategy(read_strategy(PIPELINE / "src_strategy_dir" / f"stage{stage}.ckpt"), jdir / f"stage{stage}.json")
    out = merge_pipeline_strategies(jdir, tmp_path / "merged.json")
    merged = read_strategy(out)
    assert merged.format == FORMAT_JSON
    assert merged.layouts == merged_via_mindspore().layouts


def test_merge_refuses_a_missing_stage(tmp_path):
    d = tmp_path / "only1"
    d.mkdir()
    shutil.copy(PIPELINE / "src_strategy_dir" / "stage1.ckpt", d / "stage1.ckpt")
    err = assert_strategy_error(d, fn=lambda p: merge_pipeline_strategies(p, tmp_path / "m.ckpt"))
    assert "stage" in str(err) and "[0]" in str(err)
    assert not (tmp_path / "m.ckpt").exists()


def test_merge_refuses_two_files_claiming_one_stage_with_different_layouts(tmp_path):
    d = tmp_path / "clash"
    shutil.copytree(PIPELINE / "src_strategy_dir", d)
    sf = read_strategy(d / "stage0.ckpt")
    name = next(iter(sf.layouts))
    lay = sf.layouts[name]
    sf.layouts[name] = ParamLayout(lay.dev_matrix, tuple(-1 for _ in lay.tensor_map))
    write_strategy(sf, d / "stage0_other_rank.ckpt")
    with pytest.raises(StrategyFormatError, match="stage 0") as ei:
        merge_pipeline_strategies(d, tmp_path / "m.ckpt")
    assert "stage0" in str(ei.value)
    assert not (tmp_path / "m.ckpt").exists()


def test_merge_refuses_mixed_formats(tmp_path):
    d = tmp_path / "mixed"
    shutil.copytree(PIPELINE / "src_strategy_dir", d)
    write_strategy(read_strategy(d / "stage1.ckpt"), d / "stage1.json")
    assert_strategy_error(d, fn=lambda p: merge_pipeline_strategies(p, tmp_path / "m.ckpt"), match=".json")


@pytest.mark.parametrize("inputs,out_name", [("ckpt", "merged.json"), ("json", "merged.ckpt"), ("json", "merged")])
def test_merge_refuses_an_output_name_of_the_other_format(tmp_path, inputs, out_name):
    d = tmp_path / "stages"
    for stage in (0, 1):
        write_strategy(read_strategy(PIPELINE / "src_strategy_dir" / f"stage{stage}.ckpt"), d / f"stage{stage}.{inputs}")
    with pytest.raises(StrategyFormatError) as ei:
        merge_pipeline_strategies(d, tmp_path / out_name)
    assert out_name in str(ei.value)
    assert not (tmp_path / out_name).exists()


def test_merge_refuses_bad_directories(tmp_path):
    merge = lambda p: merge_pipeline_strategies(p, tmp_path / "m.ckpt")  # noqa: E731
    assert_strategy_error(tmp_path / "nothere", fn=merge)
    (tmp_path / "empty").mkdir()
    assert_strategy_error(tmp_path / "empty", fn=merge)
    shutil.copy(PIPELINE / "src_strategy_dir" / "stage0.ckpt", tmp_path / "a_file.ckpt")
    assert_strategy_error(tmp_path / "a_file.ckpt", fn=merge)
    d = tmp_path / "with_merged"
    d.mkdir()
    shutil.copy(PIPELINE / "src_strategy_merged.ckpt", d / "merged.ckpt")
    assert_strategy_error(d / "merged.ckpt", fn=lambda p: merge(d), match="already")


def test_merge_refuses_a_stage_file_without_strategy_items(tmp_path):
    d = tmp_path / "noitems"
    write_strategy(StrategyFile({"w": ParamLayout((2,), (0,))}, []), d / "stage.ckpt")
    assert_strategy_error(d / "stage.ckpt", fn=lambda p: merge_pipeline_strategies(d, tmp_path / "m.ckpt"))


# ================================================================================ multi-axis maps


multi_axis_cases = [
    (ParamLayout((2, 2, 2), ((2, 1), -1)), [[2, 1], [-1]]),
    (ParamLayout((2, 2, 2), (0, (2, 1))), [[0], [2, 1]]),
    (ParamLayout((4, 2), ((1, 0),)), [[1, 0], []]),  # 1-D: padded with an empty TensorMap
    (ParamLayout((2, 2, 3, 2), ((0, 2), -1, (1,)), 1, 2), [[0, 2], [-1], [1]]),
]


@pytest.mark.parametrize("layout,encoded", multi_axis_cases)
def test_multi_axis_tensor_maps_in_protobuf(tmp_path, layout, encoded):
    sf = StrategyFile({"w": layout}, [StrategyItem("op", 0, ())])
    write_strategy(sf, tmp_path / "m.ckpt")
    msg = schema.ParallelStrategyMap()
    msg.ParseFromString((tmp_path / "m.ckpt").read_bytes())
    pl = msg.parallel_layout_item[0].parallel_layouts
    assert [list(t.dim) for t in pl.tensor_map] == encoded  # one TensorMap per dimension
    assert [list(d.dim) for d in pl.dev_matrix] == [list(layout.dev_matrix)]
    assert len(pl.param_split_shape) == len(pl.indices_offset) == 1
    back = read_strategy(tmp_path / "m.ckpt").layouts["w"]
    # MindSpore's reader turns every entry of the nested form into a list: -1 comes back as (-1,)
    assert back.tensor_map == normalised(layout.tensor_map)
    assert back.dev_matrix == layout.dev_matrix
    assert (back.opt_shard_step, back.opt_shard_size) == (layout.opt_shard_step, layout.opt_shard_size)
    ndim = len(layout.tensor_map)
    assert Layout.from_recorded(back, ndim) == Layout.from_recorded(layout, ndim)
    write_strategy(read_strategy(tmp_path / "m.ckpt"), tmp_path / "again.ckpt")
    assert (tmp_path / "again.ckpt").read_bytes() == (tmp_path / "m.ckpt").read_bytes()


def test_flat_maps_use_a_single_tensor_map(tmp_path):
    sf = StrategyFile({"w": ParamLayout((2, 2), (1, 0)), "b": ParamLayout((2, 2), (0,))}, [StrategyItem("op", 0, ())])
    msg = schema.ParallelStrategyMap()
    msg.ParseFromString(to_protobuf_bytes(sf))
    assert [[list(t.dim) for t in it.parallel_layouts.tensor_map] for it in msg.parallel_layout_item] == [[[1, 0]], [[0]]]


def test_multi_axis_tensor_maps_are_refused_for_json(tmp_path):
    sf = StrategyFile({"flat": ParamLayout((2, 2), (1, 0)), "nested": ParamLayout((2, 2, 2), ((2, 1), -1))},
                      [StrategyItem("op", 0, ())])
    with pytest.raises(StrategyFormatError, match="multi-axis") as ei:
        write_strategy(sf, tmp_path / "s.json")
    assert "s.json" in str(ei.value)
    assert not (tmp_path / "s.json").exists()
    assert list(tmp_path.iterdir()) == []


# ================================================================================ property: round trips


axis_entry = st.one_of(st.integers(-1, 3), st.lists(st.integers(0, 3), min_size=1, max_size=3).map(tuple))


@st.composite
def strategy_files(draw):
    names = draw(st.lists(st.text(min_size=1, max_size=12).filter(lambda s: "-" not in s), min_size=1, max_size=4,
                          unique=True))
    layouts = {}
    for n in names:
        layouts[n] = ParamLayout(
            tuple(draw(st.lists(st.integers(1, 8), min_size=1, max_size=4))),
            tuple(draw(st.lists(st.integers(-1, 3), min_size=0, max_size=4))),
            draw(st.integers(0, 8)), draw(st.sampled_from([0, -1, 2, 4])),
            tuple(draw(st.lists(st.integers(0, 100), max_size=3))), (), draw(st.integers(0, 2)),
        )
    items = [StrategyItem(draw(st.text(min_size=1, max_size=8)), draw(st.integers(0, 3)),
                          tuple(tuple(s) for s in draw(st.lists(st.lists(st.integers(1, 8), max_size=3), max_size=3))))
             for _ in range(draw(st.integers(1, 3)))]
    return StrategyFile(layouts, items, draw(st.integers(1, 5)))


@settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(sf=strategy_files())
def test_random_flat_strategies_round_trip_in_both_formats(tmp_path_factory, sf):
    d = tmp_path_factory.mktemp("rt")
    for name in ("s.ckpt", "s.json"):
        write_strategy(sf, d / name)
        back = read_strategy(d / name)
        assert back.layouts == sf.layouts
        assert list(back.layouts) == list(sf.layouts)
        assert back.current_stage == sf.current_stage
    # JSON keeps one item per node name (it is an object keyed by name)
    assert read_strategy(d / "s.ckpt").items == sf.items


# ================================================================================ layouts read by their bytes


def _layout_item(name: str, layouts_messages: list[bytes], extra: bytes = b"") -> bytes:
    """One ParallelLayoutItem encoded by hand: the name, then each given ParallelLayouts encoding as
    its own field-2 occurrence (protobuf merges repeated occurrences of a message field)."""
    def field(number: int, payload: bytes) -> bytes:
        return wire.len_field(number, len(payload)) + payload

    body = field(1, name.encode()) + b"".join(field(2, m) for m in layouts_messages) + extra
    return field(3, body)


def _layouts(dev_matrix, tensor_map, step=0, size=-1) -> bytes:
    pl = schema.ParallelLayouts()
    pl.dev_matrix.add().dim.extend(dev_matrix)
    pl.tensor_map.add().dim.extend(tensor_map)
    pl.opt_weight_shard_step, pl.opt_weight_shard_size, pl.field = step, size, 0
    return pl.SerializeToString()


def test_layouts_shared_by_bytes_read_as_protobuf_reads_them(monkeypatch):
    """Items are matched to an already-decoded layout by their encoded bytes; odd encodings (a
    layouts field given twice, which protobuf merges; unknown fields; a field order no writer
    uses) must come out exactly as reading every item through protobuf gives them."""
    from reshard_job.formats import strategy as strategy_module

    a, b, c = _layouts((2, 4), (1, -1)), _layouts((8,), (0,), step=2, size=2), _layouts((4, 2), (0, 1), step=4)
    unknown = wire.key(9, wire.VARINT) + wire.encode_varint(7)
    stage = schema.ParallelStrategyMap()
    stage.current_stage = 1
    reversed_order = wire.len_field(2, len(b)) + b + wire.len_field(1, 1) + b"r"
    data = (stage.SerializeToString()
            + b"".join(_layout_item(f"w{i}", [a if i % 2 else b]) for i in range(6))
            + _layout_item("merged", [a, c])  # protobuf: a's and c's repeated fields, c's scalars
            + _layout_item("plain_c", [c])  # must not take the merged item's layout
            + _layout_item("unknown_after", [b], extra=unknown)
            + wire.len_field(3, len(reversed_order)) + reversed_order
            + _layout_item("w_last", [a]))
    sf = strategy_module.parse_protobuf_strategy(data, "s.ckpt")
    monkeypatch.setattr(strategy_module, "layout_bytes", lambda data: None)  # every item through protobuf
    reference = strategy_module.parse_protobuf_strategy(data, "s.ckpt")
    assert list(sf.layouts.items()) == list(reference.layouts.items())
    assert sf.layouts["merged"] != sf.layouts["plain_c"]
    assert sf.layouts["merged"].opt_shard_step == 4
    assert sf.layouts["w0"] is sf.layouts["w2"] is sf.layouts["unknown_after"] is sf.layouts["r"]
    assert sf.layouts["w1"] is sf.layouts["w_last"]


@pytest.mark.parametrize("where", ["dev_matrix", "tensor_map", "field"])
def test_a_json_strategy_with_an_integer_of_absurd_length_is_refused_as_such(tmp_path, where):
    """Python's int() refuses 4,300 digits with a bare ValueError (and builds anything below): a
    5,000-digit number in a strategy is refused naming the file, before it is a count or an index."""
    layout = {"dev_matrix": [2], "tensor_map": [0], "field": 0}
    path = tmp_path / "s.json"
    text = json.dumps({"parallel_layout_item": {"w": layout}})
    value = "7" * 5000
    old = json.dumps(layout[where])
    new = f"[{value}]" if isinstance(layout[where], list) else value
    text = text.replace(f'"{where}": {old}', f'"{where}": {new}')
    path.write_text(text)
    with pytest.raises(StrategyFormatError) as e:
        read_strategy(path)
    assert str(e.value) == (f"{path}: at key 'w': an integer of more than 20 digits (777777777777…): integers of absurd length are "
                            f"refused (under key {where!r})")


def test_a_json_strategy_of_many_equal_layouts_is_checked_once_per_entry_and_named_by_its_first(tmp_path):
    """Equal entries are one object (read as runs): each is checked once, so an error names the first
    parameter that has it, as checking every one would."""
    good = {"dev_matrix": [2], "tensor_map": [0], "field": 0, "opt_weight_shard_step": 0, "opt_weight_shard_size": 0}
    bad = dict(good, dev_matrix=[0])
    doc = {"parallel_layout_item": {**{f"w{i}": good for i in range(50)}, **{f"b{i}": bad for i in range(50)}}}
    path = tmp_path / "s.json"
    path.write_text(json.dumps(doc, separators=(",", ":")))
    with pytest.raises(StrategyFormatError, match="parameter 'b0': dev_matrix"):
        read_strategy(path)
    del doc["parallel_layout_item"]["b0"]
    doc["parallel_layout_item"] = {k: v for k, v in doc["parallel_layout_item"].items() if v is good}
    path.write_text(json.dumps(doc, separators=(",", ":")))
    sf = read_strategy(path)
    assert len(sf.layouts) == 50 and len({id(v) for v in sf.layouts.values()}) == 1
    assert sf.layouts["w49"].dev_matrix == (2,)
