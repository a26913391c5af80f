"""Whole-file digests of source files: sha256 for lineage, and the CRC32 check of `.ckpt` trailers,
computed in one read.

Source checkpoints are hashed once per job so the manifest and the lineage record can name them
by content. That read is also the moment to verify a MindSpore CRC32 trailer, so a corrupt source
is refused before any output is written. ``hashlib`` and ``zlib`` release the GIL on large
buffers, so a few threads hash several files at disk speed.
"""

from __future__ import annotations

import hashlib
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable

BLOCK = 8 * 1024 * 1024


@dataclass(frozen=True)
class FileDigest:
    path: str
    size: int
    sha256: str
    crc32: int | None = None  # CRC32 of the first `crc_length` bytes, when asked for


def digest_file(path: str, *, crc_length: int | None = None,
                progress: Callable[[int], None] | None = None) -> FileDigest:
    """sha256 of the whole file and, if `crc_length` is given, CRC32 of its first `crc_length` bytes."""
    h = hashlib.sha256()
    crc = 0
    pos = 0
    buf = bytearray(BLOCK)
    mv = memoryview(buf)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        size = os.fstat(fd).st_size
        while True:
            n = os.readv(fd, [mv])
            if n <= 0:
                break
            chunk = mv[:n]
            h.update(chunk)
            if crc_length is not None and pos < crc_length:
                crc = zlib.crc32(chunk[: max(0, min(n, crc_length - pos))], crc)
            pos += n
            if progress:
                progress(n)
    finally:
        os.close(fd)
    if pos != size:
        size = pos  # the file changed while being read; report what was hashed
    return FileDigest(os.path.abspath(path), size, h.hexdigest(), crc if crc_length is not None else None)


def digest_files(requests: Iterable[tuple[str, int | None]], *, threads: int = 2,
                 progress: Callable[[int], None] | None = None) -> list[FileDigest]:
    """Digest several files concurrently; results in request order."""
    reqs = list(requests)
    if threads <= 1 or len(reqs) <= 1:
        return [digest_file(p, crc_length=c, progress=progress) for p, c in reqs]
    with ThreadPoolExecutor(max_workers=threads) as pool:
        futures = [pool.submit(digest_file, p, crc_length=c, progress=progress) for p, c in reqs]
        return [f.result() for f in futures]


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
