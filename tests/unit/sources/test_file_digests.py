"""Source digests and their cache: a cached digest is only reused for an unchanged file."""

from __future__ import annotations

import hashlib
import os
import threading
import zlib

import pytest

from reshard_job.sources.file_digests import HashCache, HashRequest, digest_file, digest_files
from reshard_job.storage import SourceChangedError


def test_digest_gives_sha256_and_crcs_of_segments(tmp_path):
    p = tmp_path / "f.bin"
    data = os.urandom(9 * 1024 * 1024 + 17)
    p.write_bytes(data)
    d = digest_file(str(p), segments=[(0, len(data) - 17)])
    assert d.sha256 == hashlib.sha256(data).hexdigest() and d.size == len(data)
    assert d.crcs == (zlib.crc32(data[:-17]),) and d.identity
    # ranges in any order, overlapping, some straddling the 4 MiB read blocks
    segments = [(4 * 1024 * 1024 + 10, 5 * 1024 * 1024), (5, 100), (0, len(data)), (4 * 1024 * 1024 - 10, 20),
                (len(data) - 5, 5), (50, 10)]
    d = digest_file(str(p), segments=segments)
    assert d.crcs == tuple(zlib.crc32(data[o:o + n]) for o, n in segments)


def test_cache_hits_only_while_the_file_is_unchanged(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(b"a" * 1000)
    cache = HashCache(str(tmp_path / "cache.json"))
    first = digest_files([HashRequest(str(p))], cache=cache)[0]
    cache.save()
    again = HashCache(str(tmp_path / "cache.json"))  # as a later job would load it
    assert again.get(HashRequest(str(p))) == first
    assert again.get(HashRequest(str(p), ((0, 10),))) is None  # a CRC it never computed is not made up
    p.write_bytes(b"b" * 1000)  # same size; the change time moves on
    os.utime(p, ns=(os.stat(p).st_atime_ns, 0))  # even a forged modification time does not fool it
    assert again.get(HashRequest(str(p))) is None
    fresh = digest_files([HashRequest(str(p))], cache=again)[0]
    assert fresh.sha256 == hashlib.sha256(b"b" * 1000).hexdigest() != first.sha256


def test_cached_crcs_are_reused_for_the_same_segments(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(b"0123456789" * 100)
    cache = HashCache(str(tmp_path / "cache.json"))
    req = HashRequest(str(p), ((0, 990),))
    first = digest_files([req], cache=cache)[0]
    assert cache.get(req) == first and first.crcs == (zlib.crc32(b"0123456789" * 99),)


def test_unwritable_cache_only_costs_time(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(b"x")
    cache = HashCache("/proc/1/no/cache.json")
    assert digest_files([HashRequest(str(p))], cache=cache)[0].sha256 == hashlib.sha256(b"x").hexdigest()
    cache.save()  # no error


def test_a_file_changed_while_hashed_is_refused(tmp_path, monkeypatch):
    p = tmp_path / "f.bin"
    p.write_bytes(os.urandom(12 * 1024 * 1024))
    import reshard_job.sources.file_digests as hashing

    real = hashing._SegmentCrcs.update
    touched = threading.Event()

    def change_once(self, *args):
        if not touched.is_set():
            touched.set()
            with open(p, "r+b") as f:  # another process appending to the file mid-read
                f.seek(0, 2)
                f.write(b"more")
        return real(self, *args)

    monkeypatch.setattr(hashing._SegmentCrcs, "update", change_once)
    with pytest.raises(SourceChangedError, match="changed while it was being hashed"):
        digest_file(str(p), segments=[(0, 10)])


def test_a_file_changed_since_it_was_indexed_is_refused_not_hashed(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(b"indexed content")
    from reshard_job.storage import storage_for

    seen = storage_for(str(p)).info(str(p)).identity
    cache = HashCache(str(tmp_path / "cache.json"))
    assert digest_files([HashRequest(str(p), identity=seen)], cache=cache)[0].identity == seen
    cache.save()
    p.write_bytes(b"replaced content, longer")  # replaced after the job indexed the file
    request = HashRequest(str(p), identity=seen)
    assert HashCache(str(tmp_path / "cache.json")).get(request) is None
    digest_files([HashRequest(str(p))], cache=cache)  # the new content is cached under its own identity
    assert cache.get(request) is None
    with pytest.raises(SourceChangedError, match="changed since the job indexed it"):
        digest_files([request], cache=cache)


def test_a_file_removed_since_it_was_indexed_is_one_source_changed_error(tmp_path):
    """Removed between indexing and hashing (another job's overwrite of the folder, a user's rm): the
    job's one line naming it, not a FileNotFoundError traceback."""
    path = tmp_path / "rank_0.ckpt"
    path.write_bytes(b"x" * 100)
    identity = tuple(os.stat(path)[i] for i in (1, 2))  # whatever it was: the file is gone now
    path.unlink()
    with pytest.raises(SourceChangedError, match=f"{path}: removed since the job indexed it"):
        digest_files([HashRequest(str(path), None, identity)], threads=1)


def test_a_small_file_is_read_into_a_buffer_of_its_size(tmp_path):
    """20,000 small stage files each got a fresh 4 MiB read block: 80 GB of zeroed pages, a minute."""
    import tracemalloc

    p = tmp_path / "small.json"
    p.write_bytes(b"{}" * 50)
    tracemalloc.start()
    try:
        d = digest_file(str(p))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert d.sha256 == hashlib.sha256(b"{}" * 50).hexdigest()
    assert peak < 64 * 1024
