"""JSON strategy files read (MindSpore's ``.json`` form of ``ParallelStrategyMap``): the members a
strategy has are kept, anything else is read past. A small file is parsed whole by ``json``'s C
scanner, a large one a window at a time (``JsonStream``); the stream also tells what is wrong with a
small one that the scanner refuses."""

from __future__ import annotations

import io
import json
import marshal

from reshard_job.core.strategy_model import FORMAT_JSON, ParamLayout, StrategyFile, StrategyItem
from reshard_job.errors import StrategyFormatError
from reshard_job.formats.strategy_checks import check_stage, dev_matrix, int_list, interned, tensor_map_entries
from reshard_job.json_stream import MAX_INT_DIGITS, REUSED, RUN, JsonProblem, JsonStream
from reshard_job.text import quoted, shorten

# A document this small is parsed whole: its objects cost some 30 times its size at worst, and the
# stream's Python loop per member is 10 times the C scanner's cost (a pipeline folder of 20,000
# stage files of a few KB each took 9 s to read through the stream).
WHOLE_DOCUMENT = 1 << 20
_DIGITS_TO_ZERO = bytes.maketrans(b"123456789", b"0" * 9)
_ABSURD_INT = b"0" * (MAX_INT_DIGITS + 1)
_MEMBERS = ("parallel_layout_item", "parallel_strategy_item", "current_stage")


class ValidatedEntries:
    """Layouts and operator strategies already validated, by their encoding, for the files of one
    pipeline folder: its stage files repeat a few of them, each validated once. Only valid ones are
    kept, so an error still names the first parameter or operator of the file that has a bad one.

    The encoding is ``marshal``'s, version 2 (no back-references: equal values encode alike), made
    in C and telling JSON's types apart (``1``, ``1.0``, ``true``): twice as fast as ``repr``."""

    MAX_KEY = 4096  # bytes of an encoding kept (longer ones are validated each time)
    MAX_ENTRIES = 1 << 16

    def __init__(self) -> None:
        self.layouts: dict[bytes | None, ParamLayout] = {}
        self.strategies: dict[bytes | None, tuple] = {}
        self.shared: dict[ParamLayout, ParamLayout] = {}  # equal layouts as one object, over the files

    @staticmethod
    def key(value) -> bytes | None:
        try:
            return marshal.dumps(value, 2)
        except (ValueError, RecursionError):  # nested deeper than marshal goes: validated (refused) directly
            return None

    def keep(self, table: dict, key: bytes | None, value) -> None:
        if key is not None and len(key) <= self.MAX_KEY and len(table) < self.MAX_ENTRIES:
            table[key] = value


def parse_json_strategy(data: bytes, path: str | None = None, known: ValidatedEntries | None = None) -> StrategyFile:
    """A JSON strategy file's content; a large one is read a window at a time (``JsonStream``): a
    file padded with hundreds of MB of spaces costs no copy of itself as text. `known`: entries
    validated in other files of the same folder."""
    try:
        obj = _whole_document(data) if len(data) <= WHOLE_DOCUMENT else None
        if obj is None:
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
    known = ValidatedEntries() if known is None else known
    layouts = _layouts(raw_layouts, path, known)
    items = _items(raw_items, path, known)
    stage = obj.get("current_stage", 1)
    return StrategyFile(layouts, items, stage if isinstance(stage, int) else 1, FORMAT_JSON, path)


def _whole_document(data: bytes) -> dict | None:
    """The members a strategy has of a small document parsed at once, or None where the stream is
    to read it: an integer of more than ``MAX_INT_DIGITS`` digits (refused by the stream), text that
    is not UTF-8 or not JSON, nesting too deep (the stream says what is wrong in its words)."""
    if data.translate(_DIGITS_TO_ZERO).find(_ABSURD_INT) >= 0:
        return None
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    return {k: v for k, v in obj.items() if k in _MEMBERS} if isinstance(obj, dict) else obj


def _layouts(raw_layouts: dict, path, known: ValidatedEntries) -> dict[str, ParamLayout]:
    """The ``parallel_layout_item`` entries as layouts, each distinct one validated once (the first
    name with a bad one is the one an error names)."""
    layouts = {}
    by_entry: dict[int, ParamLayout] = {}  # id of an entry (the stream makes equal texts one object, held)
    for name, d in raw_layouts.items():
        layout = by_entry.get(id(d))
        if layout is None:
            key = known.key(d)
            layout = known.layouts.get(key)
            if layout is None:
                layout = interned(known.shared, _json_layout(name, d, path))
                known.keep(known.layouts, key, layout)
            by_entry[id(d)] = layout
        layouts[name] = layout
    return layouts


def _items(raw_items: dict, path, known: ValidatedEntries) -> list[StrategyItem]:
    """The ``parallel_strategy_item`` entries, each distinct list of strategies validated once."""
    items = []
    for node, d in raw_items.items():
        stage = _item_stage(node, d, path)
        raw = d.get("parallel_strategy", [])
        key = known.key(raw)
        strategies = known.strategies.get(key)
        if strategies is None:
            strategies = _strategies(node, raw, path)
            known.keep(known.strategies, key, strategies)
        items.append(StrategyItem(node, stage, strategies))
    return items


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


def _item_stage(node: str, d, path) -> int:
    """The stage of one ``parallel_strategy_item`` entry (an operator's), validated."""
    stage = d.get("stage", 0) if isinstance(d, dict) else None
    if not isinstance(stage, int) or isinstance(stage, bool):
        raise StrategyFormatError(path, f"operator {quoted(node)}: strategy item must be an object with an integer 'stage'")
    check_stage(stage, path, f"operator {quoted(node)}")
    return stage


def _strategies(node: str, strategies, path) -> tuple[tuple[int, ...], ...]:
    """An operator's ``parallel_strategy``, validated."""
    if not isinstance(strategies, list):
        raise StrategyFormatError(path, f"operator {quoted(node)}: parallel_strategy must be a list")
    return tuple(int_list(s, path, f"operator {quoted(node)}: strategy") for s in strategies)


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

