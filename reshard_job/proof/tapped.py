"""The parameters a source file's tap counts, held as columns.

A tap lists, for every parameter it takes from its file, the name, the dtype, the global shape and
the box it counts. For a file of 600,000 small parameters a tuple each was 43 MiB, held through the
hash pass; as columns it is the name (a reference to the string the job holds anyway) and the
number of its (dtype, shape, box), which a few distinct ones share: 12 bytes a parameter.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from typing import Iterator, NamedTuple


class Tapped(NamedTuple):
    """A parameter counted in a file: its facts and its box in the global tensor (None: all of it)."""

    name: str
    dtype: str
    global_shape: tuple
    box: tuple | None


class TappedColumns:
    """A list of ``Tapped`` kept as a name column and a column of numbered (dtype, shape, box)."""

    __slots__ = ("_names", "_kind", "_kinds", "_kind_ids")

    def __init__(self) -> None:
        self._names: list[str] = []
        self._kind = array("I")
        self._kinds: list[tuple] = []  # (dtype, global shape, box), each once
        self._kind_ids: dict[tuple, int] = {}

    def append(self, t: Tapped) -> None:
        kind = (t.dtype, t.global_shape, t.box)
        number = self._kind_ids.get(kind)
        if number is None:
            number = self._kind_ids[kind] = len(self._kinds)
            self._kinds.append(kind)
        self._names.append(t.name)
        self._kind.append(number)

    def extend(self, names: list[str], kinds: list[tuple]) -> None:
        """``append`` of each name with its (dtype, global shape, box), for a run of them at once."""
        ids = self._kind_ids
        for kind in dict.fromkeys(kinds):  # numbered in the order first seen, as ``append`` does
            if kind not in ids:
                ids[kind] = len(self._kinds)
                self._kinds.append(kind)
        self._names.extend(names)
        self._kind.extend(map(ids.__getitem__, kinds))

    def __len__(self) -> int:
        return len(self._names)

    def __getitem__(self, i: int) -> Tapped:
        return Tapped(self._names[i], *self._kinds[self._kind[i]])

    def __iter__(self) -> Iterator[Tapped]:
        kinds = self._kinds
        for name, number in zip(self._names, self._kind):
            yield Tapped(name, *kinds[number])

    def numbered(self) -> tuple[array, list[tuple]]:
        """(the number of each tensor's (dtype, global shape, box), those kinds in number order)."""
        return self._kind, self._kinds

    def name(self, i: int) -> str:
        return self._names[i]

    def names(self) -> list[str]:
        return self._names

    def hash_into(self, h: "hashlib._Hash", run: int = 65536) -> None:
        """Every (name, dtype, shape, box), in order, into `h`, a run of names at a time (no text of
        them all at once)."""
        h.update(json.dumps(self._kinds).encode() + b"\n" + len(self._kind).to_bytes(8, "little"))
        h.update(self._kind.tobytes())
        for start in range(0, len(self._names), run):
            h.update(json.dumps(self._names[start:start + run]).encode())
