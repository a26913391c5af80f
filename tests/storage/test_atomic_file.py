"""AtomicFile: the file's sha256 and the digests of tapped ranges (per-tensor digests), fed from the
writer's hash thread on the O_DIRECT path and at once on the buffered one, must equal the sha256
of exactly those bytes, however the ranges fall across staging blocks."""

from __future__ import annotations

import hashlib
import os
import random

import pytest

from reshard_job.storage.atomic import AtomicFile
from reshard_job.storage.base import write_hashed


def _write_pieces(f: AtomicFile, pieces):
    """pieces: [(bytes, tensor index or None)]; returns one sha256 hasher per tensor index."""
    hashers = {}
    for data, t in pieces:
        if t is None:
            f.write(data)
        else:
            write_hashed(f, data, hashers.setdefault(t, hashlib.sha256()))
    return hashers


def _pieces(seed: int, total: int):
    rng = random.Random(seed)
    out, size, t = [], 0, 0
    while size < total:
        header = rng.randbytes(rng.randint(1, 300))  # a record header: not part of any tensor
        out.append((header, None))
        for _ in range(rng.randint(1, 3)):  # a tensor written in one or more pieces
            n = rng.choice([0, 1, 17, 4096, 65536, rng.randint(1, 3 << 20), rng.randint(8 << 20, 11 << 20)])
            out.append((rng.randbytes(n), t))
        size += sum(len(d) for d, _ in out[-4:])
        t += 1
    return out


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("seed", [1, 2])
def test_tapped_ranges_hash_exactly_their_bytes(tmp_path, direct, seed):
    pieces = _pieces(seed, 40 << 20)
    f = AtomicFile(tmp_path / "out.bin", direct=direct)
    hashers = _write_pieces(f, pieces)
    size, digest = f.commit()
    data = b"".join(d for d, _ in pieces)
    assert size == len(data) == os.path.getsize(tmp_path / "out.bin")
    assert digest == hashlib.sha256(data).hexdigest() == hashlib.sha256((tmp_path / "out.bin").read_bytes()).hexdigest()
    for t, h in hashers.items():
        expected = hashlib.sha256(b"".join(d for d, i in pieces if i == t)).hexdigest()
        assert h.hexdigest() == expected, f"tensor {t}"


def test_a_writer_without_its_own_write_hashed_hashes_at_once():
    class Plain:
        def __init__(self):
            self.data = bytearray()

        def write(self, data):
            self.data += data

    w, h = Plain(), hashlib.sha256()
    write_hashed(w, b"abc", h)
    assert bytes(w.data) == b"abc" and h.hexdigest() == hashlib.sha256(b"abc").hexdigest()
