"""JSON text in pieces, byte-identical to ``json.dumps`` with the same options.

A manifest of a checkpoint with a million small parameters holds a million per-tensor digests:
``json.dumps`` of it is one string of well over 100 MB, and encoding it to bytes doubles that.
``iter_json`` writes the outer dictionaries itself and hands every value below them to
``json.dumps`` (its C encoder, so no slower), so no piece is larger than one of those values (one
target rank's digests, for the manifest).
"""

from __future__ import annotations

import json
from typing import Iterator


def iter_json(obj, *, indent: int | None = None, sort_keys: bool = False, separators=None,
              ensure_ascii: bool = True, split_depth: int = 2) -> Iterator[str]:
    """Pieces of ``json.dumps(obj, indent=…, sort_keys=…, separators=…, ensure_ascii=…)``.

    Dictionaries down to `split_depth` levels are written piece by piece; anything else (and a
    dictionary with a key that is not a string, which ``json.dumps`` would convert) in one piece.
    """
    if separators is None:
        separators = (",", ": ") if indent is not None else (", ", ": ")
    opts = dict(indent=indent, sort_keys=sort_keys, separators=separators, ensure_ascii=ensure_ascii)
    yield from _pieces(obj, 0, split_depth, opts)


def _pieces(obj, depth: int, split_depth: int, opts: dict) -> Iterator[str]:
    if depth >= split_depth or not isinstance(obj, dict) or not obj or not all(isinstance(k, str) for k in obj):
        text = json.dumps(obj, **opts)
        indent = opts["indent"]
        if indent is not None and depth and "\n" in text:  # JSON strings never hold a raw newline
            text = text.replace("\n", "\n" + " " * (indent * depth))
        yield text
        return
    item_sep, key_sep = opts["separators"]
    indent = opts["indent"]
    if indent is not None:
        inner = "\n" + " " * (indent * (depth + 1))
        item_sep += inner
        yield "{" + inner
    else:
        yield "{"
    keys = sorted(obj) if opts["sort_keys"] else list(obj)
    for i, key in enumerate(keys):
        yield (item_sep if i else "") + json.dumps(key, ensure_ascii=opts["ensure_ascii"]) + key_sep
        yield from _pieces(obj[key], depth + 1, split_depth, opts)
    yield ("\n" + " " * (indent * depth) + "}") if indent is not None else "}"
