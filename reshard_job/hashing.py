"""Whole-file digests of source files: sha256 for lineage, and the CRC32 check of `.ckpt` trailers,
computed in one read.

Source checkpoints are hashed once per job so the manifest and the lineage record can name them
by content. That read is also the moment to verify a MindSpore CRC32 trailer, so a corrupt source
is refused before any output is written. ``hashlib`` and ``zlib`` release the GIL on large
buffers, so a few threads hash several files at disk speed.

Re-hashing hundreds of gigabytes of unchanged sources for every conversion (every point of a
sweep) would dominate the job, so digests are cached by file identity, as git and DVC do: the
device, inode, size, modification and *change* times. Any write to a file changes its ctime,
which no user can set back, so a cache hit means the bytes are the ones hashed. ``audit verify``
never uses the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable

BLOCK = 4 * 1024 * 1024


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
                 progress: Callable[[int], None] | None = None, cache: "HashCache | None" = None) -> list[FileDigest]:
    """Digest several files concurrently; results in request order. `cache` answers unchanged files."""
    reqs = list(requests)
    out: list[FileDigest | None] = [cache.get(p, c) if cache is not None else None for p, c in reqs]
    todo = [i for i, d in enumerate(out) if d is None]
    if threads <= 1 or len(todo) <= 1:
        for i in todo:
            out[i] = digest_file(reqs[i][0], crc_length=reqs[i][1], progress=progress)
    else:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            futures = {i: pool.submit(digest_file, reqs[i][0], crc_length=reqs[i][1], progress=progress) for i in todo}
            for i, f in futures.items():
                out[i] = f.result()
    if cache is not None:
        for i in todo:
            cache.put(out[i], reqs[i][1])
    return out  # type: ignore[return-value]


CACHE_DIR_ENV = "RESHARD_JOB_CACHE_DIR"


def default_cache_path() -> str:
    """The user's digest cache: $RESHARD_JOB_CACHE_DIR, else $XDG_CACHE_HOME/reshard_job, else
    ~/.cache/reshard_job (shared by all of a user's jobs, wherever they are launched)."""
    base = os.environ.get(CACHE_DIR_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "reshard_job")
    return os.path.join(base, "source-digests.json")


def _identity(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


class HashCache:
    """Digests of files keyed by path and file identity (see the module docstring), kept in a JSON file.

    Several jobs may share the file: saving merges with what is on disk and replaces it atomically;
    at worst a concurrent job's new entries are lost, which only costs a re-hash later.
    """

    MAX_ENTRIES = 100_000

    def __init__(self, path: str):
        self.path = path
        self._entries: dict[str, dict] = self._load()
        self._new: dict[str, dict] = {}

    def _load(self) -> dict[str, dict]:
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def get(self, path: str, crc_length: int | None) -> FileDigest | None:
        path = os.path.abspath(path)
        e = self._new.get(path) or self._entries.get(path)
        if not isinstance(e, dict):
            return None
        try:
            st = os.stat(path)
        except OSError:
            return None
        if e.get("identity") != _identity(st) or not isinstance(e.get("sha256"), str):
            return None
        if crc_length is not None and e.get("crc_length") != crc_length:
            return None
        return FileDigest(path, st.st_size, e["sha256"], e.get("crc32") if crc_length is not None else None)

    def put(self, digest: FileDigest, crc_length: int | None) -> None:
        try:
            st = os.stat(digest.path)
        except OSError:
            return
        if st.st_size != digest.size:
            return  # changed while being hashed
        self._new[digest.path] = {"identity": _identity(st), "sha256": digest.sha256,
                                  "crc_length": crc_length, "crc32": digest.crc32}

    def save(self) -> None:
        if not self._new:
            return
        merged = self._load()
        merged.update(self._new)
        if len(merged) > self.MAX_ENTRIES:
            merged = dict(list(merged.items())[-self.MAX_ENTRIES:])
        try:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            tmp = f"{self.path}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(merged, f)
            os.replace(tmp, self.path)
        except OSError:
            pass  # a cache that cannot be written only costs time
        self._entries, self._new = merged, {}


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
