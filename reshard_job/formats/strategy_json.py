"""JSON strategy files read (MindSpore's ``.json`` form of ``ParallelStrategyMap``), a window at a
time: the members a strategy has are kept, anything else is read past."""

from __future__ import annotations

import io

from reshard_job.core.strategy_model import FORMAT_JSON, ParamLayout, StrategyFile, StrategyItem
from reshard_job.errors import StrategyFormatError
from reshard_job.formats.strategy_checks import check_stage, dev_matrix, int_list, interned, tensor_map_entries
from reshard_job.json_stream import REUSED, RUN, JsonProblem, JsonStream
from reshard_job.text import quoted, shorten


def parse_json_strategy(data: bytes, path: str | None = None) -> StrategyFile:
    """A JSON strategy file's content, read a window at a time (``JsonStream``): a file padded with
    hundreds of MB of spaces costs no copy of itself as text."""
    try:
        obj = _json_members(JsonStream(io.BytesIO(data).read))
    except JsonProblem as e:
        raise StrategyFormatError(path, _json_problem(str(e))) from None
    if not isinstance(obj, dict):
        raise StrategyFormatError(path, "JSON strategy must be an object with 'parallel_layout_item'")
    raw_layouts = obj.get("parallel_layout_item", {})
    raw_items = obj.get("parallel_strategy_item", {})
    if not isinstance(raw_layouts, dict) or not isinstance(raw_items, dict):
        raise StrategyFormatError(path, "'parallel_layout_item' and 'parallel_strategy_item' must be objects")
    if not raw_layouts and not raw_items:
        raise StrategyFormatError(path, "no parameter layouts or operator strategies: not a strategy file")
    shared: dict[ParamLayout, ParamLayout] = {}
    by_entry: dict[int, ParamLayout] = {}  # id of an entry (equal texts are one object, held) -> its layout
    layouts = {}
    for name, d in raw_layouts.items():
        layout = by_entry.get(id(d))
        if layout is None:  # (checked once per entry: the first name with it is the one an error names)
            layout = by_entry[id(d)] = interned(shared, _json_layout(name, d, path))
        layouts[name] = layout
    items = [_json_item(node, d, path) for node, d in raw_items.items()]
    stage = obj.get("current_stage", 1)
    return StrategyFile(layouts, items, stage if isinstance(stage, int) else 1, FORMAT_JSON, path)


def _json_problem(text: str) -> str:
    """A stream's problem as the strategy's: what is no JSON at all says how the file was taken."""
    key, sep, rest = text.partition(": ") if text.startswith("at key ") else ("", "", text)
    if not rest.startswith("not valid"):
        return text
    inner = rest[len("not valid JSON ("):-1] if rest.startswith("not valid JSON (") else rest
    return f"not valid JSON ({inner}{', ' + key if key else ''}); a name ending in .json is read as JSON"


def _json_members(stream: JsonStream):
    """The document's top-level members a strategy has (what others hold is read past), or the
    document itself if it is not an object."""
    if stream.peek() != "{":
        value = stream.value()
        stream.end()
        return value
    obj = {}
    for key in stream.members():
        if key in ("parallel_layout_item", "parallel_strategy_item") and stream.peek() == "{":
            obj[key] = _object_members(stream)
        elif key in ("parallel_layout_item", "parallel_strategy_item", "current_stage"):
            obj[key] = stream.value()
        else:
            stream.value()
    stream.end()
    return obj


def _json_layout(name: str, d, path) -> ParamLayout:
    """One ``parallel_layout_item`` entry as a layout, validated."""
    where = f"parameter {quoted(name)}"
    if not isinstance(d, dict):
        raise StrategyFormatError(path, f"{where}: layout must be an object")
    for key in ("dev_matrix", "tensor_map", "field", "opt_weight_shard_step", "opt_weight_shard_size"):
        if key not in d:
            raise StrategyFormatError(path, f"{where}: layout lacks {key!r}")
    entries = _json_tensor_map(d["tensor_map"], path, where)
    for key in ("field", "opt_weight_shard_step", "opt_weight_shard_size"):
        if not isinstance(d[key], int) or isinstance(d[key], bool):
            raise StrategyFormatError(path, f"{where}: {key} must be an integer, got {shorten(repr(d[key]), 80)}")
    return ParamLayout(
        dev_matrix=dev_matrix(int_list(d["dev_matrix"], path, f"{where}: dev_matrix"), path, name),
        tensor_map=tensor_map_entries(entries, path, name),
        opt_shard_step=d["opt_weight_shard_step"],
        opt_shard_size=d["opt_weight_shard_size"],
        param_split_shape=int_list(d.get("param_split_shape", []), path, f"{where}: param_split_shape"),
        indices_offset=int_list(d.get("indices_offset", []), path, f"{where}: indices_offset"),
        field=d["field"],
        tensor_shape=int_list(d["tensor_shape"], path, f"{where}: tensor_shape") if "tensor_shape" in d else None,
    )


def _json_tensor_map(tm, path, where: str) -> tuple:
    """A JSON ``tensor_map``: integers, or lists of integers for multi-axis dimensions."""
    if not isinstance(tm, list):
        raise StrategyFormatError(path, f"{where}: tensor_map must be a list")
    entries: list = []
    for e in tm:
        if isinstance(e, list):
            entries.append(int_list(e, path, f"{where}: tensor_map entry"))
        elif isinstance(e, int) and not isinstance(e, bool):
            entries.append(e)
        else:
            raise StrategyFormatError(path, f"{where}: tensor_map entries must be integers, got {shorten(repr(e), 80)}")
    return tuple(entries)


def _json_item(node: str, d, path) -> StrategyItem:
    """One ``parallel_strategy_item`` entry (an operator's stage and strategies), validated."""
    stage = d.get("stage", 0) if isinstance(d, dict) else None
    if not isinstance(stage, int) or isinstance(stage, bool):
        raise StrategyFormatError(path, f"operator {quoted(node)}: strategy item must be an object with an integer 'stage'")
    check_stage(stage, path, f"operator {quoted(node)}")
    strategies = d.get("parallel_strategy", [])
    if not isinstance(strategies, list):
        raise StrategyFormatError(path, f"operator {quoted(node)}: parallel_strategy must be a list")
    return StrategyItem(node, stage, tuple(int_list(s, path, f"operator {quoted(node)}: strategy") for s in strategies))


KNOWN_TEXTS = 4096  # distinct entry texts remembered (a model's layouts repeat a few)


def _object_members(stream: JsonStream) -> dict:
    """An object of many members as ``json.loads`` makes it (a repeated key: the last), equal entries
    scanned once and runs of them taken together (``JsonStream.items(runs=True)``)."""
    out: dict = {}
    known: dict = {}  # entry text -> its value (read, never changed: shared by the names that have it)
    for key, value, text in stream.items(known, runs=True):
        if value is RUN:
            out.update(dict.fromkeys(key, known[text]))
            continue
        if value is REUSED:
            value = known[text]
        elif len(known) < KNOWN_TEXTS:
            known[text] = value
        out[key] = value
    return out

