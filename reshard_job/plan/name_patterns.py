"""Matching parameter names against many ``fnmatch`` patterns at once (``target.include``/``exclude``).

100,000 patterns made one regular expression took seconds to compile, and finding those that
match nothing, each pattern tried on every name through ``fnmatch``, took a minute. Patterns are
sorted by their form instead:

- a literal name (no ``*``, ``?`` or ``[``) is looked up in a set;
- a prefix (``layers.*``: one ``*``, at the end) is looked up in the sorted, prefix-free list of
  them: a name starts with one of them only if it starts with the greatest of them not above it;
- the rest are one regular expression, their ``fnmatch.translate`` forms side by side.

Which patterns match nothing is found the same way: literal ones in the set of names, prefixes by
a search in the sorted names, and only the rest one by one, each stopping at its first match.
"""

from __future__ import annotations

import bisect
import fnmatch
import re
from typing import Iterable, Sequence

WILDCARDS = frozenset("*?[")
LITERAL, PREFIX, OTHER = "literal", "prefix", "other"


def form(pattern: str) -> tuple[str, str]:
    """(LITERAL, the name), (PREFIX, the text before the ``*``) or (OTHER, the pattern)."""
    head = pattern.rstrip("*")
    if WILDCARDS.isdisjoint(head):
        return (LITERAL if head == pattern else PREFIX), head
    return OTHER, pattern


class NamePatterns:
    """`patterns` (``fnmatch``, case-sensitive): ``matches`` says whether one of them matches a name."""

    def __init__(self, patterns: Sequence[str]):
        self.patterns = tuple(patterns)
        self._literal: set[str] = set()
        prefixes: set[str] = set()
        other: list[str] = []
        for pattern in dict.fromkeys(self.patterns):
            kind, text = form(pattern)
            if kind == LITERAL:
                self._literal.add(text)
            elif kind == PREFIX:
                prefixes.add(text)
            else:
                other.append(pattern)
        self._prefixes = _prefix_free(sorted(prefixes))
        self._other = re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in other)).match if other else None

    def matches(self, name: str) -> bool:
        if name in self._literal:
            return True
        if self._prefixes:
            i = bisect.bisect_right(self._prefixes, name)
            if i and name.startswith(self._prefixes[i - 1]):
                return True
        return self._other is not None and self._other(name) is not None

    def unmatched(self, names: Iterable[str]) -> list[str]:
        """The patterns, in their order, that match none of `names`."""
        ordered = sorted(set(names))
        present = set(ordered)
        known: dict[str, bool] = {}
        for pattern in self.patterns:
            if pattern not in known:
                known[pattern] = _matches_one(pattern, ordered, present)
        return [p for p in self.patterns if not known[p]]


def _prefix_free(ordered: list[str]) -> list[str]:
    """`ordered` (sorted) without the prefixes that start with another: those follow it at once."""
    kept: list[str] = []
    for prefix in ordered:
        if not kept or not prefix.startswith(kept[-1]):
            kept.append(prefix)
    return kept


def _matches_one(pattern: str, ordered: list[str], present: set[str]) -> bool:
    """Whether `pattern` matches one of the sorted names `ordered` (`present`: the same, as a set)."""
    kind, text = form(pattern)
    if kind == LITERAL:
        return text in present
    if kind == PREFIX:  # the first name not below the prefix starts with it, if any name does
        i = bisect.bisect_left(ordered, text)
        return i < len(ordered) and ordered[i].startswith(text)
    return any(map(re.compile(fnmatch.translate(pattern)).match, ordered))
