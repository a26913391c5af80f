"""``json.dumps(obj, indent=…)`` of a flat container at the speed of the C encoder.

The standard library encodes with its C accelerator only without ``indent``; with it, every item
goes through the pure-Python encoder, which for a manifest of a million per-parameter fingerprints
is seconds. A container of scalars (a dict of names to digests, a list of numbers) indents the
same as its items separated by a comma, a newline and the indent, which the C encoder writes
when given those as its item separator. ``LazyList`` and ``plain`` let a document hold values
that are written as the plain ones they stand for.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

_SCALARS = frozenset({str, int, float, bool, type(None)})


def dumps_flat(obj, *, indent: int | None, separators: tuple[str, str], sort_keys: bool = False,
               ensure_ascii: bool = True, allow_nan: bool = True) -> str | None:
    """``json.dumps(obj, indent=indent, separators=separators, …)`` of a non-empty dict of string
    keys to scalars, or list of scalars; None for anything else (then ``json.dumps`` it)."""
    if indent is None or type(obj) not in (dict, list) or not obj:
        return None
    values = obj.values() if type(obj) is dict else obj
    if not _SCALARS.issuperset(map(type, values)) or (type(obj) is dict and not {str}.issuperset(map(type, obj))):
        return None
    inner = "\n" + " " * indent
    text = json.dumps(obj, separators=(separators[0] + inner, separators[1]), sort_keys=sort_keys,
                      ensure_ascii=ensure_ascii, allow_nan=allow_nan)
    return text[0] + inner + text[1:-1] + "\n" + text[-1]


class LazyList:
    """A JSON array whose items are made only as it is written (``iter_json``: a few thousand at
    a time), from `items`, a function returning an iterable of plain values. A plan of a million
    parameters describes them in tables of that length; as Python lists they would cost far more
    than their text."""

    __slots__ = ("items",)

    def __init__(self, items):
        self.items = items

    def __iter__(self):
        return iter(self.items())


def plain(obj):
    """``default=`` for ``json.dumps``: a mapping that is not a dict (a file's tensor digests)
    is written as the dict it stands for, a ``LazyList`` as the list."""
    if isinstance(obj, Mapping):
        return dict(obj.items())
    if isinstance(obj, LazyList):
        return list(obj)
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")
