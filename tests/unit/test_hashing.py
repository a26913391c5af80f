"""Source digests and their cache: a cached digest is only reused for an unchanged file."""

from __future__ import annotations

import hashlib
import os
import zlib

from reshard_job.hashing import HashCache, digest_file, digest_files


def test_digest_gives_sha256_and_crc_of_a_prefix(tmp_path):
    p = tmp_path / "f.bin"
    data = os.urandom(3 * 1024 * 1024 + 17)
    p.write_bytes(data)
    d = digest_file(str(p), crc_length=len(data) - 17)
    assert d.sha256 == hashlib.sha256(data).hexdigest() and d.size == len(data)
    assert d.crc32 == zlib.crc32(data[:-17])


def test_cache_hits_only_while_the_file_is_unchanged(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(b"a" * 1000)
    cache = HashCache(str(tmp_path / "cache.json"))
    first = digest_files([(str(p), None)], cache=cache)[0]
    cache.save()
    again = HashCache(str(tmp_path / "cache.json"))  # as a later job would load it
    assert again.get(str(p), None) == first
    assert again.get(str(p), 10) is None  # a CRC it never computed is not made up
    p.write_bytes(b"b" * 1000)  # same size; the change time moves on
    os.utime(p, ns=(os.stat(p).st_atime_ns, 0))  # even a forged modification time does not fool it
    assert again.get(str(p), None) is None
    fresh = digest_files([(str(p), None)], cache=again)[0]
    assert fresh.sha256 == hashlib.sha256(b"b" * 1000).hexdigest() != first.sha256


def test_unwritable_cache_only_costs_time(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(b"x")
    cache = HashCache("/proc/1/no/cache.json")
    assert digest_files([(str(p), None)], cache=cache)[0].sha256 == hashlib.sha256(b"x").hexdigest()
    cache.save()  # no error
