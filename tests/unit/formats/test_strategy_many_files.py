"""Strategies of many operators, and pipeline folders of many stage files: each distinct layout or
operator strategy is read and validated once, small JSON files are parsed whole (with the stream's
results and errors), and what is written back is byte for byte what was read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import reshard_job.formats.strategy as strategy_module
import reshard_job.formats.strategy_json as strategy_json
from reshard_job.core.strategy_model import ParamLayout, StrategyFile, StrategyItem
from reshard_job.errors import StrategyFormatError
from reshard_job.formats import wire
from reshard_job.formats.strategy import read_strategy, to_json_bytes, to_protobuf_bytes, write_strategy
from reshard_job.formats.strategy_json import ValidatedEntries, parse_json_strategy
from reshard_job.sources.rank_folders import load_strategy

PIPELINE = Path(__file__).resolve().parents[2] / "golden" / "S3_pipeline2x4opt_to_4" / "src_strategy_dir"


def counting(monkeypatch, module, name: str) -> list:
    """Calls of module.name, counted (the function still runs)."""
    calls: list = []
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def stage_folder(tmp_path: Path, stages: int) -> Path:
    """`stages` JSON stage files of the golden stage 0, each claiming its own stage."""
    d = json.loads(to_json_bytes(read_strategy(PIPELINE / "stage0.ckpt")))
    folder = tmp_path / "stages"
    folder.mkdir()
    for s in range(stages):
        for item in d["parallel_strategy_item"].values():
            item["stage"] = s
        (folder / f"stage{s}.json").write_text(json.dumps(d))
    return folder


# ============================================================================ pipeline folders


def test_the_stage_files_of_a_folder_validate_each_distinct_layout_once(tmp_path, monkeypatch):
    """20,000 stage files took a minute: every file validated its layouts and strategies anew."""
    folder = stage_folder(tmp_path, 30)
    one = read_strategy(folder / "stage0.json")
    layouts = counting(monkeypatch, strategy_json, "_json_layout")
    strategies = counting(monkeypatch, strategy_json, "_strategies")
    loaded = load_strategy(str(folder))
    assert len(layouts) == len(set(one.layouts.values()))
    assert len(strategies) == len({it.strategies for it in one.items})
    assert loaded.topology.num_stages == 30 and len(loaded.strategy.layouts) == 30 * len(one.layouts)
    assert {it.stage for it in loaded.strategy.items} == set(range(30))


def test_an_entry_validated_in_one_file_is_still_refused_in_words_in_another(tmp_path):
    folder = stage_folder(tmp_path, 2)
    d = json.loads((folder / "stage1.json").read_text())
    name = next(iter(d["parallel_layout_item"]))
    d["parallel_layout_item"][name]["field"] = "x"
    (folder / "stage1.json").write_text(json.dumps(d))
    with pytest.raises(StrategyFormatError, match=f"stage1.json.*parameter '{name}': field must be an integer"):
        load_strategy(str(folder))


def test_known_entries_tell_json_types_apart():
    known = ValidatedEntries()
    doc = {"parallel_strategy_item": {"op": {"stage": 0, "parallel_strategy": [[1]]}},
           "parallel_layout_item": {"w": {"dev_matrix": [2], "tensor_map": [0], "field": 0,
                                          "opt_weight_shard_step": 0, "opt_weight_shard_size": 0}}}
    parse_json_strategy(json.dumps(doc).encode(), "a.json", known)
    doc["parallel_layout_item"]["w"]["field"] = False  # equal to 0 in Python, not an integer in JSON
    with pytest.raises(StrategyFormatError, match="field must be an integer"):
        parse_json_strategy(json.dumps(doc).encode(), "b.json", known)
    doc["parallel_layout_item"]["w"]["field"] = 0
    doc["parallel_strategy_item"]["op"]["parallel_strategy"] = [[True]]
    with pytest.raises(StrategyFormatError, match="strategy must be a list of integers"):
        parse_json_strategy(json.dumps(doc).encode(), "c.json", known)


# ==================================================================== small JSON files, whole


DOCUMENTS = [
    '{"current_stage": 3, "x": [1, {"y": 2}], "parallel_strategy_item": {"op": {"stage": 0, "parallel_strategy": '
    '[[2, 1]]}}, "parallel_layout_item": {"w": {"dev_matrix": [2], "tensor_map": [0, -1], "field": 0, '
    '"opt_weight_shard_step": 0, "opt_weight_shard_size": 0}, "w": {"dev_matrix": [4], "tensor_map": [-1], '
    '"field": 0, "opt_weight_shard_step": 0, "opt_weight_shard_size": 0, "tensor_shape": [4]}}}',
    '{"parallel_layout_item": {"a": {"dev_matrix": [2, 2], "tensor_map": [[1, 0], -1], "field": 0, '
    '"opt_weight_shard_step": 2, "opt_weight_shard_size": 2, "param_split_shape": [1], "indices_offset": [0]}}}',
]


@pytest.mark.parametrize("text", DOCUMENTS)
def test_a_small_document_parses_as_the_stream_parses_it(text, monkeypatch):
    whole = parse_json_strategy(text.encode(), "s.json")
    monkeypatch.setattr(strategy_json, "WHOLE_DOCUMENT", 0)
    streamed = parse_json_strategy(text.encode(), "s.json")
    assert (whole.layouts, whole.items, whole.current_stage) == (streamed.layouts, streamed.items,
                                                                 streamed.current_stage)
    assert list(whole.layouts) == list(streamed.layouts)


@pytest.mark.parametrize("text", [
    '{"parallel_layout_item": {"w": {"dev_matrix": [123456789012345678901], "tensor_map": [0], "field": 0, '
    '"opt_weight_shard_step": 0, "opt_weight_shard_size": 0}}}',
    '{"parallel_layout_item": {"w": ' + "[" * 5000 + "]" * 5000 + "}}",
    '{"parallel_layout_item": {}} x',
    '\ufeff{"parallel_layout_item": {}}',
    '{"parallel_layout_item": {"w": "\xff"}}',
])
def test_a_small_document_the_scanner_refuses_is_told_in_the_stream_s_words(text, monkeypatch):
    data = text.encode("utf-8") if "\xff" not in text else text.encode("latin-1")
    with pytest.raises(StrategyFormatError) as whole:
        parse_json_strategy(data, "s.json")
    monkeypatch.setattr(strategy_json, "WHOLE_DOCUMENT", 0)
    with pytest.raises(StrategyFormatError) as streamed:
        parse_json_strategy(data, "s.json")
    assert str(whole.value) == str(streamed.value)


# ================================================================ many protobuf operator items


def test_operator_items_are_read_once_per_distinct_encoding(tmp_path, monkeypatch):
    """A million operator items spent 8 s reading each one's nested fields through protobuf."""
    items = [StrategyItem(f"op{i}", i % 3, ((1, 8), (8, 1)) if i % 2 else ((2, 4),)) for i in range(600)]
    path = tmp_path / "s.ckpt"
    write_strategy(StrategyFile({"w": ParamLayout((8,), (0, -1))}, items), path)
    checks = counting(monkeypatch, strategy_module, "check_stage")
    again = read_strategy(path)
    assert again.items == items and to_protobuf_bytes(again) == path.read_bytes()
    assert len(checks) == 6  # 3 stages x 2 strategies


def test_a_name_that_is_not_utf8_is_told_before_a_stage_out_of_range(tmp_path):
    def item(name: bytes, stage: int) -> bytes:
        strategys = wire.key(1, 0) + wire.encode_varint(stage)
        inner = wire.len_field(1, len(name)) + name + wire.len_field(2, len(strategys)) + strategys
        return wire.len_field(2, len(inner)) + inner

    path = tmp_path / "s.ckpt"
    path.write_bytes(wire.key(1, 0) + b"\x01" + item(b"op", (1 << 20) + 1) + item(b"\xff\xfe", 0))
    with pytest.raises(StrategyFormatError, match="operator name .* is not valid UTF-8"):
        read_strategy(path)


def test_an_operator_item_protobuf_will_not_encode_again_is_read_on_its_own():
    """An item whose node name came with another wire type and whose required strategies are
    absent parses, but upb refuses to encode its strategies again (the key operator items are
    remembered by): it is read on its own, as every item was before they were remembered."""
    from reshard_job.formats.strategy import parse_protobuf_strategy

    one = b"\x12\x02\x08\x01"  # parallel_strategy_item { <field 1 as a varint> }
    sf = parse_protobuf_strategy(b"\x08\x00" + one + one, "s.ckpt")
    assert [(it.node_name, it.stage, it.strategies) for it in sf.items] == [("", 0, ())] * 2
