"""The layouts of a protobuf strategy file's items as they lie encoded in its bytes, read and written.

``strategy.parse_protobuf_strategy`` decodes one layout per distinct encoding: a model of 300,000
parameters has a handful of layouts, and reading each item's nested fields through protobuf costs
microseconds per parameter, and holding the file as protobuf objects hundreds of bytes per
parameter. This walks the file's wire bytes to find each item's name and encoding, and writes
items the same way (the bytes protobuf's serializer gives: fields in number order).
"""

from __future__ import annotations

from array import array

import reshard_job.formats.proto_schema as schema
from reshard_job.formats import wire


def layout_bytes(data: bytes) -> list | None:
    """The encoded ``parallel_layouts`` of every layout item, in order: an item whose layouts field
    is absent or repeated (protobuf merges repeated copies) gets None and is read through protobuf.
    None when the walk meets anything unexpected (protobuf has parsed the file already, so that
    only means: read every item the slow way)."""
    out: list = []
    view = memoryview(data)
    pos, end = 0, len(data)
    decode = wire.decode_varint
    try:
        while pos < end:
            key, pos = decode(data, pos, end)
            field, wire_type = key >> 3, key & 7
            if field != 3 or wire_type != wire.LEN:
                pos = wire.skip_field(data, pos, end, wire_type)
                continue
            n, pos = decode(data, pos, end)
            item_end = pos + n
            if item_end > end:
                return None
            # the form every writer produces: name (field 1), then the layouts (field 2) to the end
            if n >= 2 and data[pos] == 0x0A and data[pos + 1] < 0x80:
                at = pos + 2 + data[pos + 1]
                if at + 1 < item_end and data[at] == 0x12 and data[at + 1] < 0x80 and at + 2 + data[at + 1] == item_end:
                    out.append(data[at + 2:item_end])
                    pos = item_end
                    continue
            found = None
            count = 0
            while pos < item_end:
                key, pos = decode(data, pos, item_end)
                if key == 0x12:  # field 2, length-delimited: the ParallelLayouts message
                    n, pos = decode(data, pos, item_end)
                    if pos + n > item_end:
                        return None
                    found = bytes(view[pos:pos + n])
                    count += 1
                    pos += n
                else:
                    pos = wire.skip_field(data, pos, item_end, key & 7)
            out.append(found if count == 1 else None)
    except wire.WireError:
        return None
    return out


LAYOUT_ITEM = 3  # ParallelStrategyMap.parallel_layout_item
KNOWN_FIELDS = (1, 2)  # ParallelStrategyMap.current_stage, .parallel_strategy_item: the rest of the head
_NAME_KEY, _LAYOUTS_KEY = 0x0A, 0x12  # ParallelLayoutItem: param_name (1), parallel_layouts (2), both LEN
_NAME_TAG, _LAYOUTS_TAG = bytes((_NAME_KEY,)), bytes((_LAYOUTS_KEY,))


def _plain_item(data, pos: int, item_end: int) -> int | None:
    """Where the layouts of the layout item at data[pos:item_end] start, when it is in the form every
    writer produces (the name, then the layouts, each once, to the end); else None."""
    decode = wire.decode_varint
    if pos >= item_end or data[pos] != _NAME_KEY:
        return None
    n, at = decode(data, pos + 1, item_end)
    at += n
    if at >= item_end or data[at] != _LAYOUTS_KEY:
        return None
    n, body = decode(data, at + 1, item_end)
    return at if body + n == item_end else None


def split_layout_items(data: bytes) -> tuple[bytes, array] | None:
    """The file's bytes without its layout items (the header, the operator items: for protobuf to
    parse) and where each layout item's length lies (for ``plain_layout_items``), when every layout
    item is in the plain form (``_plain_item``); None otherwise (then protobuf reads the whole file).
    Runs of consecutive head fields are copied as one slice (not a slice per operator item)."""
    head: list = []
    kept = (0, 0)  # the run of head fields found last
    items = array("q")
    pos, end = 0, len(data)
    view = memoryview(data)
    decode, skip = wire.decode_varint, wire.skip_field
    try:
        while pos < end:
            start = pos
            key, pos = decode(data, pos, end)
            if key >> 3 == LAYOUT_ITEM and key & 7 == wire.LEN:
                items.append(pos)
                n, pos = decode(data, pos, end)
                if pos + n > end or _plain_item(data, pos, pos + n) is None:
                    return None
                pos += n
                continue
            pos = skip(data, pos, end, key & 7)
            if key >> 3 not in KNOWN_FIELDS:  # fields of a newer schema: neither read nor copied (they can be large)
                continue
            if start != kept[1]:
                head.append(view[kept[0]:kept[1]])
                kept = (start, pos)
            else:
                kept = (kept[0], pos)
    except wire.WireError:
        return None
    head.append(view[kept[0]:kept[1]])
    return b"".join(head), items


def plain_layout_items(data: bytes, items: array):
    """(name as UTF-8 bytes, encoded ``ParallelLayouts``) of each layout item, in order: for a file
    ``split_layout_items`` accepted, `items` being where it found them."""
    decode = wire.decode_varint
    end = len(data)
    for length_at in items:
        n, pos = decode(data, length_at, end)
        item_end = pos + n
        layouts_at = _plain_item(data, pos, item_end)
        name_len, name_at = decode(data, pos + 1, item_end)
        body_len, body_at = decode(data, layouts_at + 1, item_end)
        yield data[name_at:name_at + name_len], data[body_at:item_end]


def layout_item(name: bytes, layouts: bytes) -> bytes:
    """One encoded ``parallel_layout_item`` field: the name, then the encoded layouts."""
    inner = b"".join((_NAME_TAG, wire.encode_varint(len(name)), name,
                      _LAYOUTS_TAG, wire.encode_varint(len(layouts)), layouts))
    return wire.len_field(LAYOUT_ITEM, len(inner)) + inner


def write_layout_items(layouts, write) -> None:
    """Each (name, layout) of `layouts` as an encoded layout item, handed to `write`; a layout's
    encoding is made once per distinct layout, through protobuf."""
    encoded: dict = {}
    by_id: dict[int, bytes] = {}  # the same object again (layouts are shared): not even hashed
    for name, lay in layouts.items():
        body = by_id.get(id(lay))
        if body is None:
            body = encoded.get(lay)
            if body is None:
                body = encoded[lay] = _layout_message(lay).SerializeToString()
            if len(by_id) < 65536:
                by_id[id(lay)] = body
        write(layout_item(name.encode("utf-8"), body))


def _layout_message(lay):
    """One layout (a ``ParamLayout``) as a ``ParallelLayouts`` message."""
    pl = schema.ParallelLayouts()
    pl.dev_matrix.add().dim.extend(lay.dev_matrix)
    if lay.nested:
        for e in lay.tensor_map:
            pl.tensor_map.add().dim.extend(e if isinstance(e, tuple) else (e,))
        if len(lay.tensor_map) == 1:  # keeps the count above one so readers see the nested form
            pl.tensor_map.add()
    else:
        pl.tensor_map.add().dim.extend(lay.tensor_map)
    pl.param_split_shape.add().dim.extend(lay.param_split_shape)
    pl.indices_offset.add().dim.extend(lay.indices_offset)
    pl.field = lay.field
    pl.opt_weight_shard_step = lay.opt_shard_step
    pl.opt_weight_shard_size = lay.opt_shard_size
    return pl
