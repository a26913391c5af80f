"""Layout items written and read on the wire (``formats.strategy_wire``): the bytes protobuf writes
for the whole message, and the layouts protobuf reads, for every kind of layout."""

from __future__ import annotations

import pytest

import reshard_job.formats.proto_schema as schema
from reshard_job.core.strategy_model import ParamLayout, StrategyFile, StrategyItem
from reshard_job.errors import StrategyFormatError
from reshard_job.formats.strategy import _protobuf_layouts, parse_protobuf_strategy, to_protobuf_bytes
from reshard_job.formats.strategy_wire import _layout_message, layout_item, split_layout_items

LAYOUTS = {
    "a": ParamLayout((2, 4), (1, -1), 2, 4, (3,), (1,), 1),
    "é" * 200: ParamLayout((8,), ((0,),)),  # a name over 127 bytes: a two-byte length
    "c": ParamLayout((2, 2), ((1, 0), -1)),
    "d": ParamLayout((1,), (-1,)),
    "e": ParamLayout((1,), (-1,)),  # equal to d: one encoding for both
}
STRATEGY = StrategyFile(LAYOUTS, [StrategyItem("op", 0, ((1, 2),)), StrategyItem("op2", 0, ())], 1)


def _whole_message(sf: StrategyFile) -> bytes:
    msg = schema.ParallelStrategyMap()
    msg.current_stage = sf.current_stage
    for it in sf.items:
        item = msg.parallel_strategy_item.add()
        item.node_name = it.node_name
        item.parallel_strategys.stage = it.stage
        for s in it.strategies:
            item.parallel_strategys.parallel_strategy.add().dim.extend(s)
        if not it.strategies:
            item.parallel_strategys.SetInParent()
    for name, lay in sf.layouts.items():
        li = msg.parallel_layout_item.add()
        li.param_name = name
        li.parallel_layouts.CopyFrom(_layout_message(lay))
    return msg.SerializeToString()


def test_the_bytes_written_are_protobufs_for_the_whole_message():
    assert to_protobuf_bytes(STRATEGY) == _whole_message(STRATEGY)


def test_the_layouts_read_are_protobufs_in_the_files_order():
    data = to_protobuf_bytes(STRATEGY)
    msg = schema.ParallelStrategyMap()
    msg.ParseFromString(data)
    read = parse_protobuf_strategy(data, "s.ckpt")
    expected = _protobuf_layouts(msg.parallel_layout_item, data, "s.ckpt")
    assert list(read.layouts.items()) == list(expected.items())
    assert read.layouts["d"] is read.layouts["e"]
    assert read.items == STRATEGY.items and read.current_stage == 1


def test_an_item_in_another_field_order_is_read_through_protobuf():
    good = _layout_message(LAYOUTS["d"]).SerializeToString()
    inner = b"\x12" + bytes([len(good)]) + good + b"\x0a\x01x"  # the layouts before the name
    data = b"\x08\x01" + layout_item(b"w", good) + b"\x1a" + bytes([len(inner)]) + inner
    assert split_layout_items(data) is None
    assert list(parse_protobuf_strategy(data, "s.ckpt").layouts) == ["w", "x"]


@pytest.mark.parametrize("name, body, error", [
    (b"a", b"", "s.ckpt: parameter 'a': layout has no dev_matrix"),
    (b"\xff", None, "s.ckpt: parameter name \"b'\\\\xff'\" is not valid UTF-8"),
    (b"a", b"\xff\xff", "s.ckpt: not a valid protobuf strategy file (a name that does not end in .json is read as "
                        "protobuf)"),
])
def test_a_bad_item_is_refused_naming_the_file(name, body, error):
    body = _layout_message(LAYOUTS["d"]).SerializeToString() if body is None else body
    with pytest.raises(StrategyFormatError) as e:
        parse_protobuf_strategy(b"\x08\x01" + layout_item(name, body), "s.ckpt")
    assert str(e.value) == error
