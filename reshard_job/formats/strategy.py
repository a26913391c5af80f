"""MindSpore parallel-strategy files: protobuf (``ParallelStrategyMap``) and JSON, read and written,
and the merge of per-stage pipeline strategy files.

A file is JSON exactly when its name ends in ``.json`` (MindSpore's rule); anything else is
protobuf. Reading yields a ``StrategyFile`` whose ``layouts`` keep the file's own keys (merged
pipeline files prefix them with ``"<stage>-"``); the meaning of those keys (stages, shared
parameters, devices per stage) is worked out by ``reshard_job.core.topology``.

Layouts are kept as recorded. A multi-axis dimension is one nested ``tensor_map`` entry in
protobuf, but several flat entries in JSON (with the "extended" ``tensor_shape``, as MindSpore's
JSON writer records it): folding those back needs the tensor's number of dimensions, which only
the checkpoint knows, so it happens in planning (``layout.unflatten``). Writing JSON flattens
nested layouts the same way (``ParamLayout.flattened``). Counts a file declares are bounded
(``MAX_DEVICES``, ``MAX_STAGES``, ``MAX_AXES``) as it is read.
"""

from __future__ import annotations

import glob
import io
import json
import os
import sys

from google.protobuf.message import EncodeError

from reshard_job.errors import StrategyFormatError
from reshard_job.text import bounded_list, quoted
import reshard_job.formats.proto_schema as schema
from reshard_job.formats.strategy_wire import layout_bytes, plain_layout_items, split_layout_items, write_layout_items
from reshard_job.storage.atomic import write_bytes_atomic

from reshard_job.formats.strategy_checks import check_stage, dev_matrix, interned, tensor_map_entries
from reshard_job.formats.strategy_json import parse_json_strategy
from reshard_job.core.strategy_model import (FORMAT_JSON, FORMAT_PROTOBUF, JSON_SUFFIX, missing_stages, ParamLayout,
                                             StrategyFile, StrategyItem)


def format_for(path: str | os.PathLike) -> str:
    return FORMAT_JSON if os.fspath(path).endswith(JSON_SUFFIX) else FORMAT_PROTOBUF


# ============================================================================================ read


def read_strategy(path: str | os.PathLike) -> StrategyFile:
    """Read a strategy file (JSON iff the name ends in ``.json``); errors name the file."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:  # read-only, never modified
            data = f.read()
    except FileNotFoundError:
        raise StrategyFormatError(path, "strategy file not found") from None
    except IsADirectoryError:
        raise StrategyFormatError(path, "is a directory, expected a strategy file") from None
    except OSError as e:
        raise StrategyFormatError(path, f"cannot read strategy file ({e.strerror})") from None
    if not data:
        raise StrategyFormatError(path, "strategy file is empty (0 bytes)")
    if format_for(path) == FORMAT_JSON:
        sf = parse_json_strategy(data, path)
    else:
        sf = parse_protobuf_strategy(data, path)
    sf.path = path
    return sf


NOT_PROTOBUF = "not a valid protobuf strategy file (a name that does not end in .json is read as protobuf)"


def parse_protobuf_strategy(data: bytes, path: str | None = None) -> StrategyFile:
    """A protobuf strategy file's content. Layout items in the form every writer produces are read
    from the wire bytes (``strategy_wire``), the rest (header, operator items) through protobuf: a
    file of 600,000 parameters parsed whole into protobuf objects took hundreds of MB."""
    split = split_layout_items(data)
    msg = schema.ParallelStrategyMap()
    try:
        msg.ParseFromString(data if split is None else split[0])
    except Exception:
        raise StrategyFormatError(path, NOT_PROTOBUF) from None
    plain = 0 if split is None else len(split[1])
    if not msg.parallel_layout_item and not plain and not msg.parallel_strategy_item:
        raise StrategyFormatError(path, "no parameter layouts or operator strategies: not a strategy file")
    if split is None:
        layouts = _protobuf_layouts(msg.parallel_layout_item, data, path)
    else:
        layouts = _plain_layouts(data, split[1], path)
    items = _protobuf_items(msg.parallel_strategy_item, path)
    return StrategyFile(layouts, items, int(msg.current_stage), FORMAT_PROTOBUF, path)


def _plain_layouts(data: bytes, found, path) -> dict[str, ParamLayout]:
    """The layouts of a file whose every layout item is plain (``split_layout_items``), by name;
    each distinct encoding is parsed and validated once."""
    layouts: dict[str, ParamLayout] = {}
    shared: dict[ParamLayout, ParamLayout] = {}
    checked: dict[tuple, ParamLayout] = {}
    by_bytes: dict[bytes, ParamLayout] = {}
    for raw_name, raw_layout in plain_layout_items(data, found):
        try:
            name = sys.intern(raw_name.decode("utf-8"))
        except UnicodeDecodeError:
            raise StrategyFormatError(path, f"parameter name {quoted(raw_name)} is not valid UTF-8") from None
        layout = by_bytes.get(raw_layout)
        if layout is None:
            message = schema.ParallelLayouts()
            try:
                message.ParseFromString(raw_layout)
            except Exception:
                raise StrategyFormatError(path, NOT_PROTOBUF) from None
            layout = by_bytes[raw_layout] = _protobuf_layout(message, path, name, checked, shared)
        layouts[name] = layout
    return layouts


def _protobuf_layouts(items, data: bytes, path) -> dict[str, ParamLayout]:
    """The layouts of the layout `items` of a protobuf file's `data`, by parameter name."""
    layouts: dict[str, ParamLayout] = {}
    shared: dict[ParamLayout, ParamLayout] = {}
    checked: dict[tuple, ParamLayout] = {}  # raw fields -> their validated layout
    # Reading nested fields through protobuf costs microseconds per parameter; a model of 300,000
    # parameters has a handful of distinct layouts. So each item's layout is looked up by its
    # encoded bytes and decoded (and validated) only the first time those bytes are seen.
    by_bytes: dict[bytes, ParamLayout] = {}
    encoded = layout_bytes(data)
    if encoded is None or len(encoded) != len(items):
        encoded = [None] * len(items)
    for item, raw_layout in zip(items, encoded):
        name = item.param_name
        if not isinstance(name, str):  # proto2 strings holding invalid UTF-8 come back as bytes
            raise StrategyFormatError(path, f"parameter name {quoted(name)} is not valid UTF-8")
        name = sys.intern(name)  # one string per name, shared with the other strategy and the checkpoint indexes
        layout = by_bytes.get(raw_layout) if raw_layout is not None else None
        if layout is not None:
            layouts[name] = layout
            continue
        layouts[name] = layout = _protobuf_layout(item.parallel_layouts, path, name, checked, shared)
        if raw_layout is not None:
            by_bytes[raw_layout] = layout
    return layouts


def _protobuf_layout(pl, path, name: str, checked: dict, shared: dict) -> ParamLayout:
    """One item's ``ParallelLayouts`` message as a layout, validated once per distinct layout
    (`checked`: raw fields -> their layout; a bad one fails at its first parameter)."""
    if not pl.dev_matrix:
        raise StrategyFormatError(path, f"parameter {quoted(name)}: layout has no dev_matrix")
    if not pl.tensor_map:
        raise StrategyFormatError(path, f"parameter {quoted(name)}: layout has no tensor_map")
    maps = [tuple(t.dim) for t in pl.tensor_map]
    if len(maps) == 1:
        tensor_map: tuple = maps[0]
    else:  # one TensorMap per dimension (multi-axis); the empty pad entry of 1-D tensors drops out
        tensor_map = tuple(m for m in maps if m)
    raw = (tuple(pl.dev_matrix[0].dim), tensor_map, int(pl.opt_weight_shard_step),
           int(pl.opt_weight_shard_size),
           tuple(pl.param_split_shape[0].dim) if pl.param_split_shape else (),
           tuple(pl.indices_offset[0].dim) if pl.indices_offset else (), int(pl.field))
    layout = checked.get(raw)
    if layout is None:
        layout = checked[raw] = interned(shared, ParamLayout(
            dev_matrix=dev_matrix(raw[0], path, name),
            tensor_map=tensor_map_entries(tensor_map, path, name),
            opt_shard_step=raw[2],
            opt_shard_size=raw[3],
            param_split_shape=raw[4],
            indices_offset=raw[5],
            field=raw[6],
        ))
    return layout


def _protobuf_items(strategy_items, path) -> list[StrategyItem]:
    """The operator strategy items of a protobuf file, their names and stages checked. Operators'
    strategies repeat: each distinct encoding is read once (reading a million items' nested fields
    through protobuf took 8 s) and gives one tuple (a million items)."""
    alike: dict[bytes, tuple[int, tuple]] = {}  # encoded ParallelStrategys -> (stage, strategies)
    items = []
    try:
        for it in strategy_items:
            name = it.node_name
            if not isinstance(name, str):  # proto2 strings holding invalid UTF-8 come back as bytes
                raise StrategyFormatError(path, f"operator name {quoted(name)} is not valid UTF-8")
            ps = it.parallel_strategys
            encoded = _encoding(ps)
            checked = alike.get(encoded) if encoded is not None else None
            if checked is None:
                check_stage(int(ps.stage), path, f"operator {quoted(name)}")
                checked = (int(ps.stage), tuple(tuple(s.dim) for s in ps.parallel_strategy))
                if encoded is not None:
                    alike[encoded] = checked
            items.append(StrategyItem(name, *checked))
    except StrategyFormatError:
        bad = next((it.node_name for it in strategy_items if not isinstance(it.node_name, str)), None)
        if bad is not None:  # a name that is not UTF-8 is told first, wherever it lies
            raise StrategyFormatError(path, f"operator name {quoted(bad)} is not valid UTF-8") from None
        raise
    return items


def _encoding(message) -> bytes | None:
    """A message's encoding, None where protobuf will not encode what it parsed (upb refuses some
    messages that lack a required field nested in them): such an item is read on its own."""
    try:
        return message.SerializePartialToString()
    except EncodeError:
        return None


# =========================================================================================== write


def to_protobuf_bytes(sf: StrategyFile) -> bytes:
    out = io.BytesIO()
    write_protobuf(sf, out.write)
    return out.getvalue()


def write_protobuf(sf: StrategyFile, write) -> None:
    """`sf` encoded, handed to `write` a field at a time: the header and operator items through
    protobuf, then each layout item (field 3, after them, as protobuf orders fields) from its name
    and its layout's encoding, made once per distinct layout. Byte for byte what protobuf writes
    for the whole message, without an object per parameter (600,000 of them took 400 MB)."""
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
    write(msg.SerializeToString())
    write_layout_items(sf.layouts, write)


def to_json_bytes(sf: StrategyFile) -> bytes:
    obj = {
        "current_stage": sf.current_stage,
        "parallel_strategy_item": {
            it.node_name: {"stage": it.stage, "parallel_strategy": [list(s) for s in it.strategies]} for it in sf.items
        },
        "parallel_layout_item": {name: lay.to_json_dict() for name, lay in sf.layouts.items()},
    }
    return json.dumps(obj).encode("utf-8")


def write_strategy(sf: StrategyFile, path: str | os.PathLike, *, mode: int = 0o444) -> tuple[int, str]:
    """Write atomically in the format the name implies; return (size, sha256)."""
    path = os.fspath(path)
    if format_for(path) == FORMAT_JSON:
        for name, lay in sf.layouts.items():
            try:
                lay.flattened()
            except ValueError as e:
                raise StrategyFormatError(path, f"parameter {quoted(name)}: {e}") from None
        data = to_json_bytes(sf)
    else:
        data = to_protobuf_bytes(sf)
    return write_bytes_atomic(path, data, mode=mode)


# =========================================================================================== merge


def stage_files(src_strategy_dir: str | os.PathLike) -> tuple[list[str], str]:
    """The per-stage strategy files of a pipeline directory (sorted) and their format."""
    src = os.fspath(src_strategy_dir)
    if not os.path.isdir(src):
        raise StrategyFormatError(src, "pipeline strategy directory not found (expected a directory of per-stage files)")
    ckpts = sorted(glob.glob(os.path.join(glob.escape(src), "*.ckpt")))
    jsons = sorted(glob.glob(os.path.join(glob.escape(src), "*.json")))
    if ckpts and jsons:
        raise StrategyFormatError(src, "holds both .ckpt and .json strategy files; they must be all one format")
    files = ckpts or jsons
    if not files:
        raise StrategyFormatError(src, "no strategy files (*.ckpt or *.json) in pipeline strategy directory")
    return files, FORMAT_PROTOBUF if ckpts else FORMAT_JSON


def merge_pipeline_strategies(src_strategy_dir: str | os.PathLike, dst_strategy_file: str | os.PathLike) -> str:
    """Merge per-stage strategy files into one file with ``"<stage>-<name>"`` keys.

    Deterministic, unlike MindSpore's (which follows the file system's listing order): stages are
    merged in increasing order. Files of one stage must agree (all ranks of a stage write the same
    layouts); files claiming the same stage with different layouts are an error, as is a gap in the
    stages. The output has the inputs' format, and its name must say so.
    """
    dst = os.path.abspath(os.fspath(dst_strategy_file))
    files, fmt = stage_files(src_strategy_dir)
    if format_for(dst) != fmt:
        want = ".json" if fmt == FORMAT_JSON else "a name not ending in .json (e.g. .ckpt)"
        raise StrategyFormatError(dst, f"the stage files are {fmt}, so the merged file needs {want}")
    if _same_place(os.path.dirname(dst), os.fspath(src_strategy_dir)):
        raise StrategyFormatError(dst, "lies in the pipeline strategy directory it merges (it would replace a stage "
                                       "file, or be read as one by the next merge); write it elsewhere")
    merged = merge_strategy_files([read_strategy(f) for f in files])
    merged.format = fmt
    write_strategy(merged, dst, mode=0o644)
    return dst


def _same_place(a: str, b: str) -> bool:
    """Whether two paths name one folder (by device and inode: a bind mount, a link)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def merge_strategy_files(files: list[StrategyFile]) -> StrategyFile:
    """Merge parsed per-stage files (pure): stage-prefixed layouts, stages in increasing order.

    A file's stage is that of its operators, which must all agree (a per-stage file describes one
    stage); the stages found must be exactly ``0..k-1``. Stage numbers that lie (two files
    claiming one stage with different layouts, a gap, an operator of another stage) are errors:
    taken at their word they would put layouts on the wrong ranks.
    """
    by_stage: dict[int, StrategyFile] = {}
    for sf in files:
        if sf.merged:
            raise StrategyFormatError(sf.path, "is already a merged pipeline strategy; pass the per-stage files only")
        if not sf.items:
            raise StrategyFormatError(sf.path, "has no operator strategy items, so its pipeline stage is unknown")
        claimed = sorted({it.stage for it in sf.items})
        if len(claimed) > 1:
            raise StrategyFormatError(
                sf.path, f"its operators claim pipeline stages {bounded_list(claimed)}; a per-stage strategy file "
                         "belongs to one stage"
            )
        stage = claimed[0]
        seen = by_stage.get(stage)
        if seen is None:
            by_stage[stage] = sf
        elif seen.layouts != sf.layouts:
            raise StrategyFormatError(
                sf.path, f"claims pipeline stage {stage}, like {seen.path}, but its layouts differ"
            )
    stages = sorted(by_stage)
    missing = missing_stages(stages)
    if missing:
        raise StrategyFormatError(
            os.path.dirname(files[0].path or "") or None,
            f"pipeline stage file(s) missing for stage(s) {bounded_list(missing)}: found stages {bounded_list(stages)}",
        )
    layouts: dict[str, ParamLayout] = {}
    items: list[StrategyItem] = []
    for stage in stages:
        sf = by_stage[stage]
        items.extend(sf.items)
        for name, lay in sf.layouts.items():
            layouts[f"{stage}-{name}"] = lay
    return StrategyFile(layouts, items, 1, files[0].format, None)


merge_pipeline_strategys = merge_pipeline_strategies  # MindSpore's spelling
