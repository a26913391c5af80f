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

import hashlib
from array import array
from itertools import chain
import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from reshard_job.formats.ckpt.records import CRC_TRAILER_LEN
from reshard_job.storage import SourceChangedError, StorageOptions, storage_for
from reshard_job.storage.cache_files import write_cache_file
from reshard_job.sources.segment_crcs import Segments, SegmentTable, SegmentCrcs as _SegmentCrcs

BLOCK = 4 * 1024 * 1024
REMOTE_BLOCK = 32 * 1024 * 1024


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
    # fed every chunk read (``byte_taps.ByteTap``): work that rides on this read; not part of the digest
    tap: object = field(default=None, compare=False, hash=False)


def digest_file(path: str, *, segments: Segments | None = None, progress: Callable[[int], None] | None = None,
                storage_options: StorageOptions | None = None, expected_identity: tuple = (), tap=None) -> FileDigest:
    """sha256 of the whole file and the CRC32 of each of `segments`, in one sequential read, which
    also feeds `tap` (``byte_taps.ByteTap``) where given.

    The file's identity is taken before and after: a file that changes while it is read is a
    SourceChangedError, never a digest of a mix of old and new bytes; so is one whose identity
    is not `expected_identity` (when given) as it is opened.
    """
    storage = storage_for(path, storage_options)
    h = hashlib.sha256()
    crcs = _SegmentCrcs(segments or ())
    try:
        f = storage.open_read(path)
    except FileNotFoundError:  # indexed a moment ago: removed (or renamed away) since
        raise SourceChangedError(f"{path}: removed since the job indexed it; rerun once it is back") from None
    pos = 0
    try:
        if expected_identity and tuple(f.identity) != tuple(expected_identity):
            raise SourceChangedError(f"{path}: changed since the job indexed it; rerun once it is stable")
        # An object store answers a large read with several ranged GETs in flight: bigger blocks.
        # Never more than the file: a fresh 4 MiB block for each of 20,000 small strategy files
        # cost 80 GB of zeroed pages (most of a minute, in the kernel).
        buf = bytearray(min(BLOCK if storage.scheme == "file" else REMOTE_BLOCK, f.size))
        mv = memoryview(buf)
        while pos < f.size:
            n = f.pread_into(pos, mv[: min(len(buf), f.size - pos)])
            if n <= 0:
                break
            chunk = mv[:n]
            h.update(chunk)
            if segments:
                crcs.update(pos, chunk)
            if tap is not None:
                tap.update(pos, chunk)
            pos += n
            if progress:
                progress(n)
    finally:
        f.close()
    identity = f.identity
    after = storage.info(path)
    if pos != f.size or after is None or tuple(after.identity) != tuple(identity):
        raise SourceChangedError(f"{path}: changed while it was being hashed; rerun once it is stable")
    return FileDigest(path, pos, h.hexdigest(), tuple(crcs.crcs) if segments is not None else None, tuple(identity))


def digest_files(requests: Iterable[HashRequest], *, threads: int = 2, progress: Callable[[int], None] | None = None,
                 cache: "HashCache | None" = None, storage_options: StorageOptions | None = None,
                 known: "Mapping[str, StreamedDigest] | None" = None) -> list[FileDigest]:
    """Digest several files concurrently; results in request order. `known` (digests taken while
    indexing, see ``DigestingReader``) and then `cache` answer unchanged files."""
    reqs = list(requests)
    known = known or {}
    out: list[FileDigest | None] = [usable_digest(known.get(r.path), r) for r in reqs]
    fresh = [i for i, d in enumerate(out) if d is not None]  # cached for later jobs like computed ones
    if cache is not None:
        out = [d if d is not None else cache.get(r) for d, r in zip(out, reqs)]
    todo = [i for i, d in enumerate(out) if d is None]

    def one(i: int) -> FileDigest:
        return digest_file(reqs[i].path, segments=reqs[i].segments, progress=progress,
                           storage_options=storage_options, expected_identity=reqs[i].identity, tap=reqs[i].tap)

    if threads <= 1 or len(todo) <= 1:
        for i in todo:
            out[i] = one(i)
    else:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            futures = {i: pool.submit(one, i) for i in todo}
            for i, f in futures.items():
                out[i] = f.result()
    if cache is not None:
        for i in fresh + todo:
            cache.put(out[i], reqs[i])
    return out  # type: ignore[return-value]


CACHE_DIR_ENV = "RESHARD_JOB_CACHE_DIR"


def default_cache_folder() -> str:
    """The user's cache folder: $RESHARD_JOB_CACHE_DIR, else $XDG_CACHE_HOME/reshard_job, else
    ~/.cache/reshard_job (shared by all of a user's jobs, wherever they are launched)."""
    return os.environ.get(CACHE_DIR_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "reshard_job")


def default_cache_path() -> str:
    """The user's digest cache, in ``default_cache_folder()``."""
    return os.path.join(default_cache_folder(), "source-digests.json")


def _segments_key(segments) -> str | None:
    if segments is None:
        return None
    # the ranges as 64-bit integers: millions of them (one per compared tensor) hash in milliseconds
    table = segments if isinstance(segments, SegmentTable) else array("q", chain.from_iterable(segments))
    raw = table.tobytes()
    return hashlib.sha256(raw).hexdigest()[:32]


class HashCache:
    """Digests of files keyed by path and file identity (see the module docstring).

    Kept as small JSON files, one per folder of checkpoints (the folder above a file's rank folder),
    next to `path`: a job loads only the digests of its own sources, however many checkpoints the
    user has converted before. Several jobs may share the files: saving merges with what is on disk
    and replaces it atomically; at worst a concurrent job's new entries are lost, which only costs a
    re-hash later.
    """

    MAX_ENTRIES = 100_000  # per folder

    def __init__(self, path: str, storage_options: StorageOptions | None = None):
        root, _ = os.path.splitext(path)
        self.folder = root + ".d"
        self.storage_options = storage_options
        self._shards: dict[str, dict[str, dict]] = {}
        self._new: dict[str, dict[str, dict]] = {}

    def _shard(self, path: str) -> str:
        group = os.path.dirname(os.path.dirname(path.rstrip("/")))
        return os.path.join(self.folder, hashlib.sha256(group.encode("utf-8", "surrogateescape")).hexdigest()[:24]
                            + ".json")

    def _load(self, shard: str) -> dict[str, dict]:
        try:
            with open(shard, encoding="utf-8") as f:
                data = json.load(f)
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def _entries(self, shard: str) -> dict[str, dict]:
        if shard not in self._shards:
            self._shards[shard] = self._load(shard)
        return self._shards[shard]

    def _identity(self, path: str) -> list | None:
        try:
            info = storage_for(path, self.storage_options).info(path)
        except Exception:  # a cache must never fail a job: no answer means "hash it"
            return None
        return list(info.identity) if info is not None and info.identity else None

    def get(self, request: HashRequest) -> FileDigest | None:
        shard = self._shard(request.path)
        e = self._new.get(shard, {}).get(request.path) or self._entries(shard).get(request.path)
        if not isinstance(e, dict) or not isinstance(e.get("sha256"), str) or not isinstance(e.get("size"), int):
            return None
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
        return FileDigest(request.path, int(e["size"]), e["sha256"], crcs, tuple(identity))

    def knows(self, path: str) -> bool:
        """Whether a digest of `path` as it is now is cached (for any CRC ranges)."""
        e = self._new.get(self._shard(path), {}).get(path) or self._entries(self._shard(path)).get(path)
        return isinstance(e, dict) and isinstance(e.get("sha256"), str) and e.get("identity") == self._identity(path)

    def put(self, digest: FileDigest, request: HashRequest) -> None:
        if not digest.identity:
            return
        self._new.setdefault(self._shard(digest.path), {})[digest.path] = {
            "identity": list(digest.identity), "sha256": digest.sha256, "size": digest.size,
            "segments": _segments_key(request.segments),
            "crcs": list(digest.crcs) if digest.crcs is not None else None}

    def save(self) -> None:
        for shard, new in self._new.items():
            merged = self._load(shard)
            merged.update(new)
            if len(merged) > self.MAX_ENTRIES:
                merged = dict(list(merged.items())[-self.MAX_ENTRIES:])
            write_cache_file(shard, json.dumps(merged).encode())
            self._shards[shard] = merged
        self._new = {}


STREAM_BLOCK = 8 * 1024 * 1024  # one ranged GET per block when several objects stream at once
STREAM_BUDGET = 64 * 1024 * 1024  # bytes in flight over all the objects streamed at once


def stream_block(streams: int) -> int:
    """Block size for `streams` objects read front to back at once: the bytes in flight stay about
    ``STREAM_BUDGET`` (a lone object gets blocks of several requests in flight, as the hash pass
    had), never below one request's worth."""
    return max(STREAM_BLOCK, min(REMOTE_BLOCK, STREAM_BUDGET // max(1, streams)))


MAX_NOTED = 50_000  # content ranges whose CRC a streamed file keeps (beyond: the hash pass reads it again)


@dataclass(frozen=True)
class StreamedDigest:
    """What one front-to-back read of a file gave (``DigestingReader.finish``)."""

    digest: FileDigest  # sha256, size, identity; crcs None
    trailer_crc: int | None  # CRC32 of the bytes before a `.ckpt` CRC trailer
    content_crcs: dict[tuple[int, int], int]  # (offset, length) of a tensor's bytes -> CRC32
    all_noted: bool  # False when some content ranges came too late or were too many to keep
    records: object = None  # what a record tap took on the way (``proof.stream_taps.StreamedRecords``)


class DigestingReader:
    """A remote source opened for its index and its digest in one front-to-back read.

    Indexing a ``.ckpt`` in a bucket walks its record headers with ranged reads; where records are
    small (layer norms, biases and their optimizer states) the walk reads through most of the
    object, and the hash pass then reads all of it again. Wrapped in this reader, the walk is served
    from blocks fetched in file order, each hashed (sha256, and the CRC32 a `.ckpt` trailer
    records, over the bytes before the trailer) as it arrives; ``finish`` fetches what the walk did
    not reach. A read behind the blocks goes to the object itself and hashes nothing.

    The hash pass also takes the CRC32 of tensors that several ranks must hold identically. The
    format reader tells where tensor bytes lie as it finds them (``note_content``); a block's
    bytes go into those CRCs when it leaves memory, which is two blocks later: the walk reads at
    most a window (smaller than a block) ahead of what it has parsed, so every range in a block is
    known by then. Memory: two blocks. After ``finish`` every read goes to the object
    (``__getattr__`` hands it everything else: announced reads, request counters).
    """

    index_window = None  # blocks are in memory: walk them like a local file (no read-through sizing)

    def __init__(self, raw, *, crc_end: int | None = None, block: int = STREAM_BLOCK,
                 progress: Callable[[int], None] | None = None, tap=None):
        self._raw = raw
        self._tap = tap  # fed the tensor records noted and the bytes retired (``proof.stream_taps.StreamTap``)
        self.path, self.size, self.identity = raw.path, raw.size, raw.identity
        self._sha = hashlib.sha256()
        self._crc, self._crc_end = 0, crc_end
        self._block = max(1, min(block, self.size))
        self._blocks: list[tuple[int, bytearray, int]] = []  # (start, buffer, length): previous, current
        self._end = 0  # bytes fetched so far
        self._content = _SegmentCrcs(())  # tensor bytes noted by the format reader, fed as blocks retire
        self._all_noted = True
        self._progress = progress
        self._spare: bytearray | None = None  # the buffer of the last block retired, filled next
        self._finished = False

    def __getattr__(self, name):
        if name.startswith("_"):  # never the wrapper's own state (not set yet while unpickling)
            raise AttributeError(name)
        return getattr(self._raw, name)

    def note_content(self, offset: int, length: int, name: str | None = None, dtype: str | None = None,
                     dims: tuple = ()) -> None:
        """Bytes [offset, offset + length) hold a tensor (`name`, stored as `dtype` with `dims`,
        where it is one): take their CRC32 on the way, and their partial fingerprint."""
        if self._finished:
            return
        if self._tap is not None and name is not None:
            self._tap.note(offset, length, name, dtype, dims)
        if self._all_noted and (len(self._content.segments) >= MAX_NOTED or not self._content.add(offset, length)):
            self._all_noted = False
        keep = getattr(self._raw, "keep", None)  # the object keeps small tensors' bytes for the rank tasks
        if keep is not None and length > 0:
            for start, buffer, n in self._blocks:
                if start <= offset and offset + length <= start + n:
                    keep(offset, memoryview(buffer)[offset - start:offset - start + length])
                    break

    def pread_into(self, offset: int, view) -> int:
        view = memoryview(view)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        n = max(0, min(len(view), self.size - offset))
        got = 0
        while got < n:
            pos = offset + got
            for start, buffer, length in self._blocks:
                if start <= pos < start + length:
                    take = min(n - got, start + length - pos)
                    view[got:got + take] = memoryview(buffer)[pos - start:pos - start + take]
                    got += take
                    break
            else:
                if pos >= self._end and not self._finished:
                    self._next_block()
                else:  # behind the blocks, or after the stream: the object itself
                    return got + self._raw.pread_into(pos, view[got:n])
        return n

    def read_ranges(self, ranges):
        return self._raw.read_ranges(ranges)

    def _next_block(self) -> None:
        start = self._end
        length = min(self._block, self.size - start)
        if len(self._blocks) == 2:
            self._retire(*self._blocks.pop(0))
        buffer = self._spare if self._spare is not None else bytearray(self._block)
        self._spare = None
        block = memoryview(buffer)[:length]
        read = getattr(self._raw, "read_into", None) or self._raw.pread_into
        if read(start, block) != length:
            raise SourceChangedError(f"{self.path}: ended before its {self.size} bytes; rerun once it is stable")
        self._sha.update(block)
        if self._crc_end is not None and start < self._crc_end:
            self._crc = zlib.crc32(block[:self._crc_end - start], self._crc)
        self._blocks.append((start, buffer, length))
        self._end = start + length
        if self._progress is not None:
            self._progress(length)

    def _retire(self, start: int, buffer: bytearray, length: int) -> None:
        """A block leaves memory: its bytes go into the CRCs of the content ranges it meets."""
        self._content.update(start, memoryview(buffer)[:length])
        if self._tap is not None:
            self._tap.update(start, memoryview(buffer)[:length])
        self._spare = buffer

    def finish(self) -> StreamedDigest:
        """Read what the walk left; the file's digests."""
        while self._end < self.size:
            self._next_block()
        for blk in self._blocks:
            self._retire(*blk)
        self._finished = True
        self._blocks, self._spare = [], None
        digest = FileDigest(self.path, self.size, self._sha.hexdigest(), None, tuple(self.identity))
        content = dict(zip(self._content.segments, self._content.crcs)) if self._all_noted else {}
        records = self._tap.finish() if self._tap is not None else None
        self._tap = None
        return StreamedDigest(digest, self._crc if self._crc_end is not None else None, content, self._all_noted,
                              records)

    def close(self) -> None:
        self._blocks, self._spare = [], None
        self._raw.close()


def usable_digest(streamed: StreamedDigest | None, request: HashRequest) -> FileDigest | None:
    """The digest of `request`'s file from `streamed` (taken while indexing), if it answers the
    request: same identity, and every CRC asked for is one it took."""
    if streamed is None:
        return None
    d = streamed.digest
    if request.identity and tuple(request.identity) != tuple(d.identity):
        return None
    if request.segments is None:
        return d
    crcs = []
    for segment in request.segments:
        segment = tuple(segment)
        if streamed.trailer_crc is not None and segment == (0, d.size - CRC_TRAILER_LEN):
            crcs.append(streamed.trailer_crc)
        elif segment in streamed.content_crcs:
            crcs.append(streamed.content_crcs[segment])
        else:
            return None
    return FileDigest(d.path, d.size, d.sha256, tuple(crcs), d.identity)
