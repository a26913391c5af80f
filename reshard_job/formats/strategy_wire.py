"""The layouts of a protobuf strategy file's items as they lie encoded in its bytes.

``strategy.parse_protobuf_strategy`` decodes one layout per distinct encoding: a model of 300,000
parameters has a handful of layouts, and reading each item's nested fields through protobuf costs
microseconds per parameter. This walks the file's wire bytes to find each item's encoding.
"""

from __future__ import annotations

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
