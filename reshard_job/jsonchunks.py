"""JSON text in pieces, written byte-identical to ``json.dumps`` with the same options (reading
them back a piece at a time, with bounds: ``json_stream``).

A manifest of a checkpoint with a million small parameters holds a million per-tensor digests:
``json.dumps`` of it is one string of well over 100 MB, and encoding it to bytes doubles that.
``iter_json`` writes the outer dictionaries itself and hands every value below them to ``json.dumps``
(``json_flat`` for flat ones), so no piece is larger than one of those values (a rank's digests).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from itertools import islice
from typing import Iterator

from reshard_job.json_flat import LazyList, dumps_flat, plain
from reshard_job.text import json_object_pieces

CHUNK_ITEMS = 8192  # items of a large mapping encoded per ``json.dumps`` call


def iter_json(obj, *, indent: int | None = None, sort_keys: bool = False, separators=None,
              ensure_ascii: bool = True, allow_nan: bool = True, split_depth: int = 2) -> Iterator[str]:
    """Pieces of ``json.dumps(obj, indent=…, sort_keys=…, separators=…, ensure_ascii=…)``.

    Dictionaries down to `split_depth` levels are written piece by piece; anything else (and a
    dictionary with a key that is not a string, which ``json.dumps`` would convert) in one piece.
    """
    if separators is None:
        separators = (",", ": ") if indent is not None else (", ", ": ")
    opts = dict(indent=indent, sort_keys=sort_keys, separators=separators, ensure_ascii=ensure_ascii,
                allow_nan=allow_nan)
    yield from _pieces(obj, 0, split_depth, opts)


def _pieces(obj, depth: int, split_depth: int, opts: dict) -> Iterator[str]:
    if isinstance(obj, Mapping) and not isinstance(obj, dict):
        yield from _mapping_pieces(obj, depth, opts)
        return
    if isinstance(obj, LazyList):
        yield from _list_pieces(obj, depth, opts)
        return
    if type(obj) is list and obj and _holds_lazy(obj):
        yield from _items_pieces(obj, depth, split_depth, opts)
        return
    if ((depth >= split_depth and not _holds_lazy(obj)) or not isinstance(obj, dict) or not obj
            or not all(isinstance(k, str) for k in obj)):
        text = dumps_flat(obj, **opts) or json.dumps(obj, default=plain, **opts)
        indent = opts["indent"]
        if indent is not None and depth and "\n" in text:  # JSON strings never hold a raw newline
            text = text.replace("\n", "\n" + " " * (indent * depth))
        yield text
        return
    key_sep, ensure_ascii = opts["separators"][1], opts["ensure_ascii"]
    keys = sorted(obj) if opts["sort_keys"] else list(obj)
    entries = ((json.dumps(key, ensure_ascii=ensure_ascii) + key_sep, obj[key]) for key in keys)
    yield from _container_pieces(entries, "{}", depth, split_depth, opts)


def _holds_lazy(obj) -> bool:
    """Whether a dict has a ``LazyList`` value, or a list a dict item that has one (a plan's ranks,
    each with its parameter list): written whole, the lazy lists would be made whole."""
    if type(obj) is dict:
        return any(isinstance(v, LazyList) for v in obj.values())
    if type(obj) is list:
        return any(type(v) is dict and _holds_lazy(v) for v in obj)
    return False


def _items_pieces(obj: list, depth: int, split_depth: int, opts: dict) -> Iterator[str]:
    """A list an item at a time, each item in pieces, as ``json.dumps`` writes the list."""
    yield from _container_pieces((("", item) for item in obj), "[]", depth, split_depth, opts)


def _container_pieces(entries: Iterator, brackets: str, depth: int, split_depth: int, opts: dict) -> Iterator[str]:
    """A dict's (its key's text and separator, value) or a list's ("", item) `entries`, each value
    in pieces, between `brackets` and separated and indented as ``json.dumps`` writes them."""
    item_sep, indent = opts["separators"][0], opts["indent"]
    if indent is not None:
        inner = "\n" + " " * (indent * (depth + 1))
        item_sep += inner
        yield brackets[0] + inner
    else:
        yield brackets[0]
    for i, (head, value) in enumerate(entries):
        yield (item_sep if i else "") + head
        yield from _pieces(value, depth + 1, split_depth, opts)
    yield ("\n" + " " * (indent * depth) + brackets[1]) if indent is not None else brackets[1]


def _mapping_pieces(obj: Mapping, depth: int, opts: dict) -> Iterator[str]:
    """A mapping of string keys to plain values in chunks of ``CHUNK_ITEMS``, never the whole of it
    as a dict or as one string (a file's tensor digests: as names and hex digests in lists)."""
    if (columns := getattr(obj, "columns", lambda *_: None)(opts["sort_keys"], CHUNK_ITEMS)) is not None:
        yield from json_object_pieces(columns, depth, opts["indent"], opts["separators"], opts["ensure_ascii"])
        return
    items = ((k, obj[k]) for k in sorted(obj)) if opts["sort_keys"] else iter(obj.items())
    yield from _chunked(dict, items, "{}", depth, opts)


def _list_pieces(obj: LazyList, depth: int, opts: dict) -> Iterator[str]:
    """A ``LazyList`` in chunks of ``CHUNK_ITEMS`` items, as ``json.dumps`` writes the list."""
    yield from _chunked(list, iter(obj), "[]", depth, opts)


def _chunked(container, items: Iterator, brackets: str, depth: int, opts: dict) -> Iterator[str]:
    """One JSON object or array (`container`: dict or list) from `items`, a chunk of
    ``CHUNK_ITEMS`` at a time, each chunk encoded by ``json.dumps`` and its brackets cut off."""
    indent = opts["indent"]
    close = ("\n" + " " * (indent * depth) + brackets[1]) if indent is not None else brackets[1]
    first = True
    while True:
        chunk = container(islice(items, CHUNK_ITEMS))
        if not chunk:
            break
        text = "".join(_pieces(chunk, depth, depth, opts))  # opening bracket + items + close, indented for `depth`
        body = text[1:len(text) - len(close)]
        if first:
            yield brackets[0] + body
            first = False
        else:
            # indented, every body begins with its own newline and indent: a comma joins them
            yield ("," if indent is not None else opts["separators"][0]) + body
    yield brackets if first else close
