"""A parameter's fingerprint in shares: what one rank holds of it, and the whole put back together.

``poslin64x2-v1`` (``core.fingerprint``) is a sum over the bytes of a tensor, each keyed by its
global position, so the part that one box of the global tensor contributes is a value of its own:
a *share*. A rank that loads a slice of a parameter fingerprints exactly that slice (``ShareBatch``,
one pass over the bytes it holds), and the shares of boxes that tile the tensor add up to the
parameter's fingerprint, the value a conversion's ``manifest.json`` holds (``merge_shares``).

A share is recorded as ``hexdigest(partial=True)``: the lanes XOR the mask of the parameter's
dtype and global shape, so a share that covers the whole tensor *is* its fingerprint. Putting
shares together undoes the mask, adds the lanes and masks the sum again.

Ranks that hold the same box (replicas) count once; if their shares differ, the ranks loaded
different bytes and the parameter is reported as such, never merged. Boxes that overlap without
being equal, or disagree on dtype or shape, are reported too. A parameter whose distinct boxes do
not cover every element is incomplete (a load of some ranks only), and says how much is missing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from itertools import groupby
from operator import attrgetter
from math import prod
from typing import Iterable, NamedTuple, Sequence

import numpy as np

from reshard_job.core import dtypes
from reshard_job.core.boxes import Box, box_size, intersect
from reshard_job.core.fingerprint import ALGORITHM, LANES, _READS, Fingerprint, _column_dot, _dim_keys, _mask, _words

BATCHED = 64 << 10  # shares up to this size are computed in batches of one (dtype, shape, box)
_MASK64 = (1 << 64) - 1
MAX_PAIRWISE = 512  # distinct boxes of one parameter checked pairwise for overlap (more: by element count only)


class Share(NamedTuple):
    """What one loaded tensor contributes to its parameter's fingerprint."""

    name: str
    dtype: str  # MindSpore's dtype name
    shape: tuple[int, ...]  # the parameter's global shape
    box: Box  # the part of it held: (start, stop) per dim
    digest: str  # ``Fingerprint.hexdigest(partial=True)`` of that part
    algorithm: str = ALGORITHM
    rank: int | None = None  # the target rank that held it (for messages)


class ShareBatch:
    """The shares of many tensors, each with its global box; small ones computed a kind at a time.

    A rank's tensors are mostly small (biases, norms, their optimizer states) and alike: those of
    one dtype, global shape and box share every key, so k of them cost one matmul per lane. Larger
    ones are fingerprinted on their own. ``digests`` (name -> hex) is complete after ``flush``.
    The small arrays are held by reference until their batch is computed (no copy: a load returns
    them anyway), so they must not change before ``flush``."""

    LIMIT = 4 << 20  # bytes held per kind before its batch is computed

    def __init__(self):
        self.digests: dict[str, str] = {}
        self._groups: dict[tuple, tuple[list[str], list[np.ndarray]]] = {}
        self._held: dict[tuple, int] = {}

    def add(self, name: str, dtype: str, shape: Sequence[int], box: Box, array: np.ndarray) -> None:
        """`array`: the C-order data of `box` (start, stop per dim) of a parameter of global `shape`."""
        key = (dtype, tuple(shape), tuple(box))
        group = self._groups.get(key)
        if group is None:
            if not dtypes.BY_NAME[dtype].sliceable:  # an opaque dtype is only ever held whole
                fp = Fingerprint(dtype, key[1], nbytes=array.nbytes).add_run(0, array)
                self.digests[name] = fp.hexdigest(partial=True)
                return
            if array.nbytes > BATCHED:
                self.digests[name] = Fingerprint(dtype, key[1]).add_box(box, array).hexdigest(partial=True)
                return
            group = self._groups[key] = ([], [])
            self._held[key] = 0
        group[0].append(name)
        raw = array.reshape(-1) if array.flags.c_contiguous else np.ascontiguousarray(array).reshape(-1)
        group[1].append(raw.view(np.uint8))
        self._held[key] += raw.nbytes
        if self._held[key] >= self.LIMIT:
            self._compute(key)

    def flush(self) -> dict[str, str]:
        for key in list(self._groups):
            self._compute(key)
        return self.digests

    def _compute(self, key: tuple) -> None:
        dtype, shape, box = key
        names, blobs = self._groups.pop(key)
        self._held.pop(key, None)
        template = Fingerprint(dtype, shape)
        grid_box = template._grid_box(box)
        extents = tuple(hi - lo for lo, hi in grid_box)
        if any(b.size != prod(extents) for b in blobs):
            raise ValueError(f"{template!r}: a tensor of {names[0]!r}'s batch does not hold the bytes of box {box}")
        mask = _mask(template._header())
        if prod(extents) == 0:
            self.digests.update((n, mask.to_bytes(16, "little").hex()) for n in names)
            return
        raw = np.concatenate(blobs).reshape(-1, extents[-1])
        words = _words(raw, grid_box[-1][0])
        lanes = []
        for lane in range(LANES):
            y = _column_dot(words.view(_READS[lane]), grid_box[-1][0] // 8, lane)
            y = y.reshape((len(names),) + extents[:-1])
            for d in reversed(range(len(extents) - 1)):
                y = y @ _dim_keys(lane, d, *grid_box[d])
            lanes.append(y.tolist())
        for name, h1, h2 in zip(names, *lanes):
            self.digests[name] = ((h1 | h2 << 64) ^ mask).to_bytes(16, "little").hex()


@dataclass
class MergedFingerprints:
    """Whole-parameter fingerprints put together from the shares of several loads.

    ``fingerprints``: name -> hex, for every parameter whose shares cover it; ``incomplete``: name
    -> what is missing; ``conflicts``: name -> why its shares cannot be put together."""

    algorithm: str = ALGORITHM
    fingerprints: dict[str, str] = field(default_factory=dict)
    incomplete: dict[str, str] = field(default_factory=dict)
    conflicts: dict[str, str] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return not self.incomplete and not self.conflicts

    def to_json(self) -> dict:
        return {"algorithm": self.algorithm, "complete": self.complete,
                "fingerprints": dict(sorted(self.fingerprints.items())),
                "incomplete": dict(sorted(self.incomplete.items())), "conflicts": dict(sorted(self.conflicts.items()))}


def merge_shares(shares: Iterable[Share]) -> MergedFingerprints:
    """Put `shares` together per parameter. They must come grouped by name (sorted, as the lineage
    database reads them), so that one parameter's shares are held at a time."""
    merged = MergedFingerprints()
    seen: set[str] = set()
    for name, group in groupby(shares, key=attrgetter("name")):
        if name in seen:
            raise ValueError(f"shares of parameter {name!r} are not grouped by name")
        seen.add(name)
        problem, digest = _merge_one(list(group))
        if digest is not None:
            merged.fingerprints[name] = digest
        elif problem.startswith("incomplete: "):
            merged.incomplete[name] = problem.removeprefix("incomplete: ")
        else:
            merged.conflicts[name] = problem
    return merged


def _merge_one(shares: list[Share]) -> tuple[str, str | None]:
    """(why not, None) or ("", the parameter's fingerprint) from one parameter's shares."""
    first = shares[0]
    by_box: dict[Box, Share] = {}
    for s in shares:
        if s.algorithm != ALGORITHM:
            return f"recorded as {s.algorithm} (rank {s.rank}), merged here as {ALGORITHM}", None
        if s.dtype != first.dtype or s.shape != first.shape:
            return (f"loaded as {s.dtype}{list(s.shape)} by rank {s.rank} and as {first.dtype}{list(first.shape)} "
                    f"by rank {first.rank}"), None
        held = by_box.setdefault(s.box, s)
        if held.digest != s.digest:
            return f"ranks {held.rank} and {s.rank} loaded different bytes for its box {_show(s.box)}", None
    boxes = list(by_box)
    overlap = _overlapping(boxes) if len(boxes) > 1 else None
    if overlap:
        return f"boxes {_show(overlap[0])} and {_show(overlap[1])} overlap", None
    total, covered = _volume(first.shape), sum(_volume(b) for b in boxes)
    if covered < total:
        ranks = sorted({s.rank for s in shares if s.rank is not None})
        return f"incomplete: {covered} of its {total} elements loaded (by ranks {ranks})", None
    if len(boxes) == 1 or total == 0:
        return "", by_box[boxes[0]].digest
    return "", _sum([by_box[b].digest for b in boxes], first.dtype, first.shape)


def _overlapping(boxes: list[Box]) -> tuple[Box, Box] | None:
    if len(boxes) > MAX_PAIRWISE:
        return None
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            if intersect(a, b) is not None:
                return a, b
    return None


def _sum(digests: list[str], dtype: str, shape: tuple[int, ...]) -> str:
    mask = _share_mask(dtype, shape)
    lo = hi = 0
    for digest in digests:
        lanes = int.from_bytes(bytes.fromhex(digest), "little") ^ mask
        lo, hi = (lo + (lanes & _MASK64)) & _MASK64, (hi + (lanes >> 64)) & _MASK64
    return ((lo | hi << 64) ^ mask).to_bytes(16, "little").hex()


@lru_cache(maxsize=1 << 16)
def _volume(shape_or_box: tuple) -> int:
    """Elements of a shape or a box (cached: a model's parameters share a few of each)."""
    if shape_or_box and isinstance(shape_or_box[0], tuple):
        return box_size(shape_or_box)
    return prod(shape_or_box)


@lru_cache(maxsize=4096)
def _share_mask(dtype: str, shape: tuple[int, ...]) -> int:
    """The mask of a parameter's digests (its dtype and shape); parameters share a few of them."""
    return _mask(Fingerprint(dtype, shape)._header())


def _show(box: Box) -> str:
    return "[" + ", ".join(f"{lo}:{hi}" for lo, hi in box) + "]"
