"""Per-parameter fingerprints held as a table: the names in order, and 16 bytes each.

A job fingerprints every converted parameter on both sides. For a model of 600,000 parameters a
dict of hex strings is about 110 MiB a side (the dict's slots and a 32-character string for each);
as a table it is 24 bytes an entry (a reference to the name the job holds anyway, and the digest's
16 bytes). It reads as the dict it stands for (a ``Mapping`` of name to hex digest, in name order),
and two tables of the same names compare at once (``differing``).

Pure code: no I/O.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping
from typing import Iterable

import numpy as np

DIGEST_BYTES = 16


class DigestTable(Mapping):
    """Name -> hex fingerprint, read-only, iterated in name order."""

    __slots__ = ("_names", "_raw")

    def __init__(self, names: list[str], raw: bytes):
        """`names` sorted and unique, `raw` their digests' bytes in that order (16 each)."""
        if len(raw) != DIGEST_BYTES * len(names):
            raise ValueError(f"{len(raw)} bytes for {len(names)} digests of {DIGEST_BYTES}")
        self._names, self._raw = names, raw

    @classmethod
    def of(cls, names: list[str], rows: np.ndarray) -> "DigestTable":
        """From unique `names` in any order and their digests (``rows``: one 16-byte row each)."""
        by_name = np.empty(len(names), object)  # sorted as an array: no int object per index
        by_name[:] = names
        order = np.argsort(by_name, kind="stable")
        raw = np.ascontiguousarray(rows, dtype=np.uint8).reshape(len(names), DIGEST_BYTES)[order].tobytes()
        return cls(by_name[order].tolist(), raw)

    def _at(self, name) -> int:
        i = bisect_left(self._names, name) if isinstance(name, str) else len(self._names)
        return i if i < len(self._names) and self._names[i] == name else -1

    def __getitem__(self, name: str) -> str:
        i = self._at(name)
        if i < 0:
            raise KeyError(name)
        return self._raw[DIGEST_BYTES * i:DIGEST_BYTES * (i + 1)].hex()

    def __contains__(self, name) -> bool:
        return self._at(name) >= 0

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def items(self):
        text = self._raw.hex()  # one string for all, cut per entry: no lookup each
        return zip(self._names, (text[i:i + 2 * DIGEST_BYTES] for i in range(0, len(text), 2 * DIGEST_BYTES)))

    def columns(self, by_name: bool, size: int):
        """(names, hex digests) in chunks of `size` (``jsonchunks``): the table is in name order
        either way, and a chunk's hex is made in one call and cut apart in C."""
        step = DIGEST_BYTES * size
        for start in range(0, len(self._names), size):
            hexed = self._raw[start * DIGEST_BYTES:start * DIGEST_BYTES + step].hex("|", DIGEST_BYTES)
            yield self._names[start:start + size], hexed.split("|")

    def rows(self) -> np.ndarray:
        return np.frombuffer(self._raw, dtype=np.uint8).reshape(len(self._names), DIGEST_BYTES)


def differing(names: Iterable[str], source: Mapping[str, str], target: Mapping[str, str]) -> list[str]:
    """The `names` whose fingerprint differs between the two sides (absent on one side and not the
    other included), sorted. Two tables of the same names are compared row by row at once."""
    if isinstance(source, DigestTable) and isinstance(target, DigestTable) and source._names == target._names:
        rows = np.flatnonzero((source.rows() != target.rows()).any(axis=1)).tolist()
        wanted = names if isinstance(names, (set, frozenset, dict)) else set(names)
        return sorted(n for n in (source._names[i] for i in rows) if n in wanted)
    return sorted(n for n in names if source.get(n) != target.get(n))
