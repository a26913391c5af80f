"""``json.dumps(obj, indent=…)`` of a flat container at the speed of the C encoder.

The standard library encodes with its C accelerator only without ``indent``; with it, every item
goes through the pure-Python encoder, which for a manifest of a million per-parameter fingerprints
is seconds. A container of scalars (a dict of names to digests, a list of numbers) indents the
same as its items separated by a comma, a newline and the indent, which the C encoder writes
when given those as its item separator.
"""

from __future__ import annotations

import json

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
