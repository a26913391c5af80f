"""Fingerprints of many small whole tensors at once (``poslin64x2-v1``, as ``fingerprint`` defines it).

A model of many parameters is mostly small tensors (biases, norms, experts' small states), and one
``Fingerprint`` each costs tens of microseconds of numpy calls whatever its size. Tensors of one
dtype and shape share every key, so k of them are one (k * rows, words) matmul per lane and one
contraction per leading dim: the per-call cost is paid per batch, not per tensor.
"""

from __future__ import annotations

from math import prod
from typing import Sequence

import numpy as np

from reshard_job.core.fingerprint import Fingerprint, _dim_keys, _mask, _row_sums


class WholeTensorBatch:
    """Fingerprints of many small whole tensors, computed a shape at a time.

    A model of many parameters is mostly small tensors (biases, norms, experts' small states), and
    one ``Fingerprint`` each costs tens of microseconds of numpy calls whatever its size. Tensors
    of one dtype and shape share every key, so k of them are one (k * rows, words) matmul per lane
    and one contraction per leading dim: the per-call cost is paid per batch. Results, equal to
    ``Fingerprint(dtype, shape).add_run(0, data)``'s, go into `digests` (name -> hex)."""

    LIMIT = 4 << 20  # bytes held per shape before its batch is computed

    def __init__(self, digests: dict[str, str]):
        self.digests = digests
        self._groups: dict[tuple, tuple[list[str], list[bytes]]] = {}
        self._held: dict[tuple, int] = {}

    def add(self, name: str, dtype: str, shape: Sequence[int], data) -> None:
        key = (dtype, tuple(int(n) for n in shape))
        names, blobs = self._groups.setdefault(key, ([], []))
        names.append(name)
        blobs.append(bytes(data))  # the caller's buffer (a read window) is reused
        self._held[key] = self._held.get(key, 0) + len(blobs[-1])
        if self._held[key] >= self.LIMIT:
            self._compute(key)

    def flush(self) -> None:
        for key in list(self._groups):
            self._compute(key)

    def _compute(self, key: tuple) -> None:
        names, blobs = self._groups.pop(key)
        self._held.pop(key, None)
        template = Fingerprint(*key)
        if any(len(b) != template.nbytes for b in blobs):
            raise ValueError(f"{template!r}: a tensor of {names[0]!r}'s batch is not {template.nbytes} bytes")
        if template.nbytes == 0:
            for name in names:
                self.digests[name] = template.hexdigest()
            return
        grid, k = template._grid, len(names)
        raw = np.frombuffer(b"".join(blobs), dtype=np.uint8).reshape(k * prod(grid[:-1]), grid[-1])
        lanes = []
        for lane, y in enumerate(_row_sums(raw, 0)):
            y = y.reshape((k,) + tuple(grid[:-1]))
            for d in reversed(range(len(grid) - 1)):
                y = y @ _dim_keys(lane, d, 0, grid[d])
            lanes.append(y)
        mask = _mask(template._header())
        for name, h1, h2 in zip(names, lanes[0].tolist(), lanes[1].tolist()):
            self.digests[name] = ((h1 | h2 << 64) ^ mask).to_bytes(16, "little").hex()
