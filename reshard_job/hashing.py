"""Whole-file digests: the sha256 that names a file in lineage, and the CRC32s its format carries,
computed in one read.

Source checkpoints are hashed once per job so the manifest and the lineage record can name them by
content. That read is also the moment to check the CRCs a format carries (a `.ckpt` trailer,
MindSpore safetensors' ``crc_num``), so a corrupt source is refused before any output is written:
the caller passes the byte ranges (``segments``) whose CRC32 it needs, and gets one CRC per range.
``hashlib`` and ``zlib`` release the GIL on large buffers, so a few threads hash several files at
disk speed. Files are read through ``reshard_job.storage``, so objects in a bucket hash the same way.

Re-hashing hundreds of gigabytes of unchanged sources for every conversion (every point of a
sweep) would dominate the job, so digests are cached by file identity, as git and DVC do: the
device, inode, size, modification and *change* times (an object's size, ETag and version). Any
write to a file changes its ctime, which no user can set back, so a cache hit means the bytes are
the ones hashed. ``audit verify`` never uses the cache.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from .storage import SourceChangedError, StorageOptions, storage_for

BLOCK = 4 * 1024 * 1024
REMOTE_BLOCK = 32 * 1024 * 1024
Segments = Sequence[tuple[int, int]]  # (offset, length) ranges, sorted by offset, not overlapping


@dataclass(frozen=True)
class FileDigest:
    path: str
    size: int
    sha256: str
    crcs: tuple[int, ...] | None = None  # CRC32 of each requested segment
    identity: tuple = ()  # the file's storage identity while it was hashed


@dataclass(frozen=True)
class HashRequest:
    path: str
    segments: tuple[tuple[int, int], ...] | None = None
    # the identity the caller saw (when it indexed the file): a file that differs now changed
    # since, and is refused rather than hashed
    identity: tuple = ()


def digest_file(path: str, *, segments: Segments | None = None, progress: Callable[[int], None] | None = None,
                storage_options: StorageOptions | None = None, expected_identity: tuple = ()) -> FileDigest:
    """sha256 of the whole file and the CRC32 of each of `segments`, in one sequential read.

    The file's identity is taken before and after: a file that changes while it is read is a
    SourceChangedError, never a digest of a mix of old and new bytes; so is one whose identity
    is not `expected_identity` (when given) as it is opened.
    """
    storage = storage_for(path, storage_options)
    h = hashlib.sha256()
    crcs = [0] * len(segments or ())
    f = storage.open_read(path)
    # An object store answers a large read with several ranged GETs in flight: bigger blocks.
    buf = bytearray(BLOCK if storage.scheme == "file" else REMOTE_BLOCK)
    mv = memoryview(buf)
    pos = 0
    try:
        if expected_identity and tuple(f.identity) != tuple(expected_identity):
            raise SourceChangedError(f"{path}: changed since the job indexed it; rerun once it is stable")
        while pos < f.size:
            n = f.pread_into(pos, mv[: min(BLOCK, f.size - pos)])
            if n <= 0:
                break
            chunk = mv[:n]
            h.update(chunk)
            if segments:
                _update_crcs(crcs, segments, pos, chunk)
            pos += n
            if progress:
                progress(n)
    finally:
        f.close()
    identity = f.identity
    after = storage.info(path)
    if pos != f.size or after is None or tuple(after.identity) != tuple(identity):
        raise SourceChangedError(f"{path}: changed while it was being hashed; rerun once it is stable")
    return FileDigest(path, pos, h.hexdigest(), tuple(crcs) if segments is not None else None, tuple(identity))


def _update_crcs(crcs: list[int], segments: Segments, pos: int, chunk: memoryview) -> None:
    """Feed the part of `chunk` (file bytes from `pos`) that falls in each segment to its CRC.

    Segments are sorted by offset and do not overlap, so the ones a chunk meets are found by
    bisection: a file of a hundred thousand tensors costs no more per chunk than one of ten."""
    end = pos + len(chunk)
    i = max(0, bisect.bisect_right(segments, (pos, float("inf"))) - 1)
    while i < len(segments) and segments[i][0] < end:
        off, length = segments[i]
        lo, hi = max(off, pos), min(off + length, end)
        if lo < hi:
            crcs[i] = zlib.crc32(chunk[lo - pos : hi - pos], crcs[i])
        i += 1


def digest_files(requests: Iterable[HashRequest], *, threads: int = 2, progress: Callable[[int], None] | None = None,
                 cache: "HashCache | None" = None,
                 storage_options: StorageOptions | None = None) -> list[FileDigest]:
    """Digest several files concurrently; results in request order. `cache` answers unchanged files."""
    reqs = list(requests)
    out: list[FileDigest | None] = [cache.get(r) if cache is not None else None for r in reqs]
    todo = [i for i, d in enumerate(out) if d is None]

    def one(i: int) -> FileDigest:
        return digest_file(reqs[i].path, segments=reqs[i].segments, progress=progress,
                           storage_options=storage_options, expected_identity=reqs[i].identity)

    if threads <= 1 or len(todo) <= 1:
        for i in todo:
            out[i] = one(i)
    else:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            futures = {i: pool.submit(one, i) for i in todo}
            for i, f in futures.items():
                out[i] = f.result()
    if cache is not None:
        for i in todo:
            cache.put(out[i], reqs[i])
    return out  # type: ignore[return-value]


CACHE_DIR_ENV = "RESHARD_JOB_CACHE_DIR"


def default_cache_path() -> str:
    """The user's digest cache: $RESHARD_JOB_CACHE_DIR, else $XDG_CACHE_HOME/reshard_job, else
    ~/.cache/reshard_job (shared by all of a user's jobs, wherever they are launched)."""
    base = os.environ.get(CACHE_DIR_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "reshard_job")
    return os.path.join(base, "source-digests.json")


def _segments_key(segments) -> str | None:
    if segments is None:
        return None
    return hashlib.sha256(json.dumps([list(s) for s in segments]).encode()).hexdigest()[:32]


class HashCache:
    """Digests of files keyed by path and file identity (see the module docstring), kept in a JSON file.

    Several jobs may share the file: saving merges with what is on disk and replaces it atomically;
    at worst a concurrent job's new entries are lost, which only costs a re-hash later.
    """

    MAX_ENTRIES = 100_000

    def __init__(self, path: str, storage_options: StorageOptions | None = None):
        self.path = path
        self.storage_options = storage_options
        self._entries: dict[str, dict] = self._load()
        self._new: dict[str, dict] = {}

    def _load(self) -> dict[str, dict]:
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def _identity(self, path: str) -> list | None:
        try:
            info = storage_for(path, self.storage_options).info(path)
        except Exception:  # a cache must never fail a job: no answer means "hash it"
            return None
        return list(info.identity) if info is not None and info.identity else None

    def get(self, request: HashRequest) -> FileDigest | None:
        e = self._new.get(request.path) or self._entries.get(request.path)
        if not isinstance(e, dict) or not isinstance(e.get("sha256"), str) or not isinstance(e.get("size"), int):
            return None  # (entries of older versions lack the size: hashed again)
        identity = self._identity(request.path)
        if identity is None or e.get("identity") != identity:
            return None
        if request.identity and list(request.identity) != identity:
            return None  # changed since the caller saw it: digest_file refuses it
        key = _segments_key(request.segments)
        if key is not None and e.get("segments") != key:
            return None
        crcs = tuple(e["crcs"]) if key is not None and isinstance(e.get("crcs"), list) else None
        if key is not None and crcs is None:
            return None
        return FileDigest(request.path, int(e.get("size", 0)), e["sha256"], crcs, tuple(identity))

    def put(self, digest: FileDigest, request: HashRequest) -> None:
        if not digest.identity:
            return
        self._new[digest.path] = {"identity": list(digest.identity), "sha256": digest.sha256, "size": digest.size,
                                  "segments": _segments_key(request.segments),
                                  "crcs": list(digest.crcs) if digest.crcs is not None else None}

    def save(self) -> None:
        if not self._new:
            return
        merged = self._load()
        merged.update(self._new)
        if len(merged) > self.MAX_ENTRIES:
            merged = dict(list(merged.items())[-self.MAX_ENTRIES:])
        try:
            os.makedirs(os.path.dirname(self.path) or ".", mode=0o700, exist_ok=True)
            tmp = f"{self.path}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(merged, f)
            os.replace(tmp, self.path)
        except OSError:
            pass  # a cache that cannot be written only costs time
        self._entries, self._new = merged, {}
