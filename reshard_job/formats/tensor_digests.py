"""The per-tensor digests of a written file: parameter name -> sha256 hex, in file order.

A model of a million small parameters keeps every digest from the moment its tensor is written
until the manifest is: as a dict of hex strings that is about 150 bytes per tensor, here it is 40
(the name, shared with the plan, and 32 raw bytes in one buffer). Hex strings are made when asked.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Mapping

import numpy as np

DIGEST_SIZE = 32  # sha256


class TensorDigests(Mapping[str, str]):
    """A read-only mapping once complete; the writer fills it with ``add`` (a digest known now)
    and ``add_later`` (a hasher still being fed), then calls ``complete``. A name added twice keeps
    its first place and its last digest, as a dict would, once complete."""

    __slots__ = ("_names", "_raw", "_later", "_index")

    def __init__(self, items: Mapping[str, str] | Iterable[tuple[str, str]] = ()):
        self._names: list[str] = []
        self._raw = bytearray()
        self._later: dict[int, object] = {}  # position -> hasher, until ``complete``
        self._index: dict[str, int] | None = None  # name -> position, built when first looked up
        pairs = items.items() if isinstance(items, Mapping) else items
        for name, hex_digest in pairs:
            self.add(name, bytes.fromhex(hex_digest))
        self.complete()

    # --- filling ------------------------------------------------------------------------------
    def add(self, name: str, digest: bytes) -> None:
        if len(digest) != DIGEST_SIZE:
            raise ValueError(f"parameter {name!r}: a sha256 digest is {DIGEST_SIZE} bytes, got {len(digest)}")
        self._names.append(name)
        self._raw += digest
        self._index = None

    def add_all(self, names: list[str], digests: list[bytes]) -> None:
        """``add`` of each name and digest, in one call."""
        if len(names) != len(digests) or set(map(len, digests)) - {DIGEST_SIZE}:
            raise ValueError(f"{len(names)} names, {len(digests)} digests: a sha256 digest each, {DIGEST_SIZE} bytes")
        self._names += names
        self._raw += b"".join(digests)
        self._index = None

    def add_later(self, name: str, hasher) -> None:
        """A digest to take from `hasher` (anything with ``digest()``) at ``complete``."""
        self._later[len(self._names)] = hasher
        self.add(name, bytes(DIGEST_SIZE))

    def complete(self) -> "TensorDigests":
        """Take the pending hashers' digests; fold names added twice into one entry."""
        for i, hasher in self._later.items():
            self._raw[i * DIGEST_SIZE:(i + 1) * DIGEST_SIZE] = hasher.digest()
        self._later.clear()
        if len(set(self._names)) != len(self._names):
            last = {name: i for i, name in enumerate(self._names)}
            first = dict.fromkeys(self._names)
            raw = bytearray()
            for name in first:
                raw += self._raw[last[name] * DIGEST_SIZE:(last[name] + 1) * DIGEST_SIZE]
            self._names, self._raw = list(first), raw
        self._index = None
        return self

    # --- the mapping --------------------------------------------------------------------------
    def _hex(self, i: int) -> str:
        later = self._later.get(i)
        if later is not None:  # asked before the file was complete: the digest so far
            return later.hexdigest()
        return self._raw[i * DIGEST_SIZE:(i + 1) * DIGEST_SIZE].hex()

    def _position(self, name: str) -> int:
        if self._index is None:
            self._index = {n: i for i, n in enumerate(self._names)}  # the last place of a name added twice
        return self._index[name]

    def __getitem__(self, name: str) -> str:
        return self._hex(self._position(name))

    def __contains__(self, name) -> bool:
        try:
            self._position(name)
        except (KeyError, TypeError):
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)  # (before ``complete``, a name added twice is listed twice)

    def __len__(self) -> int:
        return len(self._names)

    def items(self):
        return _Items(self)

    def columns(self, by_name: bool, size: int) -> Iterator[tuple[list[str], list[str]]] | None:
        """The (names, hex digests) in chunks of `size`, in file order or by name; None before
        ``complete``. A chunk's hex is made in one call and cut apart in C (``bytes.hex`` with a
        separator): per-item Python is what a million digests, written three times, pay for."""
        if self._later:
            return None
        return self._sorted_columns(size) if by_name else self._columns(size)

    def _columns(self, size: int) -> Iterator[tuple[list[str], list[str]]]:
        for start in range(0, len(self._names), size):
            hexed = self._raw[start * DIGEST_SIZE:(start + size) * DIGEST_SIZE].hex("|", DIGEST_SIZE)
            yield self._names[start:start + size], hexed.split("|")

    def _sorted_columns(self, size: int) -> Iterator[tuple[list[str], list[str]]]:
        names = self._names
        order = sorted(range(len(names)), key=names.__getitem__)
        for start in range(0, len(order), size):
            at = order[start:start + size]
            rows = np.frombuffer(self._raw, dtype=np.uint8).reshape(-1, DIGEST_SIZE)[at].tobytes()
            yield list(map(names.__getitem__, at)), rows.hex("|", DIGEST_SIZE).split("|")

    def values(self):
        return [self._hex(i) for i in range(len(self._names))]

    def __reduce__(self):
        self.complete()
        return _restore, (self._names, bytes(self._raw))

    def __repr__(self) -> str:
        return f"TensorDigests({len(self)} tensors)"


class _Items:
    """(name, hex) pairs of a complete TensorDigests, made as iterated."""

    __slots__ = ("_d",)

    def __init__(self, digests: TensorDigests):
        self._d = digests

    def __len__(self) -> int:
        return len(self._d)

    def __iter__(self):
        d = self._d
        if d._later:
            hex_of = d._hex
            for i, name in enumerate(d._names):
                yield name, hex_of(i)
            return
        names, raw, step = d._names, d._raw, 4096
        for start in range(0, len(names), step):  # hex made a few thousand digests at a time
            hexed = raw[start * DIGEST_SIZE:(start + step) * DIGEST_SIZE].hex()
            yield from zip(names[start:start + step],
                           (hexed[j:j + 2 * DIGEST_SIZE] for j in range(0, len(hexed), 2 * DIGEST_SIZE)))


def _restore(names: list[str], raw: bytes) -> TensorDigests:
    d = TensorDigests()
    d._names, d._raw = list(names), bytearray(raw)
    return d
