"""An object opened for positioned reads through ranged GETs (the remote ``RandomAccess``).

Two access patterns matter, and they want opposite things:

- Indexing a ``.ckpt`` walks record headers: thousands of reads of a few bytes, mostly one
  after the other. One GET each would cost a round trip per header, so small reads are served
  from a read-ahead window. The window starts small (64 KiB) and doubles (up to 4 MiB) while
  reads keep landing just past it (within a few KiB), and falls back to small after a jump:
  walking small tensors then costs a request per few MiB, walking large ones a request of
  64 KiB per header (``index_window`` asks format readers for windows that small), never a
  download of the tensors skipped. Reading whole tensors one after the other, as a rank task
  does, is sequential too and goes by 4 MiB requests.
- Reading slices for a target rank asks for many ranges at once (``read_ranges``) or a few big
  ones. Neighbouring ranges are merged into requests of up to 8 MiB (``ranges.plan_requests``),
  up to 8 requests are in flight on the store's event loop, and each response is streamed
  straight into the caller's buffers in 1 MiB pieces: memory stays the caller's buffers plus a
  few MiB, however large the request.
- A rank task reads its boxes one at a time, but announces them first (``expect``, from
  ``read_ahead``): a read inside the announced ranges that misses fetches the announced ranges
  from there on, up to a byte budget, as one such coalesced, parallel batch; later reads are
  served from it. Dozens of small tensors scattered through a file then cost a request or two,
  and nothing outside the announced ranges is fetched but the gaps worth reading.

Every GET carries ``If-Match`` with the ETag seen at open, so an object replaced while the job
reads it fails with ``SourceChangedError`` instead of mixing two versions' bytes. A response
cut off mid-stream is requested again (the bytes are the same: the ETag still matches).
"""

from __future__ import annotations

import asyncio
import bisect
import threading
from typing import TYPE_CHECKING

from reshard_job.storage.base import SourceChangedError
from reshard_job.storage.ranges import Request, clip_ranges, plan_requests
from reshard_job.storage.s3errors import is_absent, storage_error

if TYPE_CHECKING:
    from reshard_job.storage.s3calls import S3Calls

MIN_READAHEAD = 64 * 1024
MAX_READAHEAD = 4 * 1024 * 1024
MAX_GAP = 1024 * 1024  # bytes of gap worth reading to save a round trip
# A read starting at most this far past the window continues it (record headers lie between
# tensors); a longer jump skipped data, and reading ahead would likely fetch more to skip.
SEQUENTIAL_GAP = 4096
MAX_REQUEST = 8 * 1024 * 1024
STREAM_CHUNK = 1024 * 1024
STREAM_ATTEMPTS = 3  # a body cut off mid-stream is fetched again this many times in all
INDEX_WINDOW = MAX_GAP  # a header walk reads through records smaller than this (RandomAccess.index_window)
# ... unless the caller reads only part of each file (``lean_index``: a load of one rank), for whom
# fetching the records it skips costs more bytes than the round trips per record head save
LEAN_INDEX_WINDOW = 8192
LEAN_READAHEAD = 4096  # ... and a small read after a jump (a record head) fetches a page, not 64 KiB
_lean = [0]


class lean_index:
    """While active (in any thread), objects index with windows of LEAN_INDEX_WINDOW (record heads
    only, but for records smaller than that), read no gap longer than that between the ranges
    asked for, and start their read-ahead at LEAN_READAHEAD."""

    def __enter__(self):
        _lean[0] += 1
        return self

    def __exit__(self, *exc):
        _lean[0] -= 1
SMALL_CONTENT = 64 * 1024  # tensors up to this size whose bytes the index walk fetched are kept (note_content)
KEPT_LIMIT = 4 * 1024 * 1024  # bytes of small tensors kept per object


def _stream_errors() -> tuple[type[BaseException], ...]:
    from botocore.exceptions import HTTPClientError

    errors: tuple[type[BaseException], ...] = (HTTPClientError, asyncio.TimeoutError, ConnectionError)
    try:
        import aiohttp

        errors += (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError)
    except ImportError:  # pragma: no cover - aiobotocore's httpx flavour
        pass
    return errors


class ObjectReader:
    """``RandomAccess`` over one object version (see the module docstring)."""

    @property
    def index_window(self) -> int:
        return LEAN_INDEX_WINDOW if _lean[0] else INDEX_WINDOW

    def __init__(self, store: "S3Calls", url: str, bucket: str, key: str, size: int, etag: str,
                 identity: tuple, *, concurrency: int = 8):
        self.path = url
        self.size = size
        self.identity = identity
        self.etag = etag
        self.requests = 0  # GETs issued: what tests and benchmarks count
        self.bytes_fetched = 0
        self._store = store
        self._bucket = bucket
        self._key = key
        self._concurrency = max(1, concurrency)
        self._lock = threading.Lock()
        self._window_offset = 0
        self._window = b""
        self._readahead = MIN_READAHEAD
        self._closed = False
        self._expected: list[tuple[int, int]] = []  # announced reads, sorted and merged (expect)
        self._expected_starts: list[int] = []
        self._budget = 0
        self._batch: list[tuple[int, memoryview]] = []  # fetched expected ranges, by offset
        self._batch_buffer = bytearray()  # what the batch's views are of (reused, see _fetch_batch)
        self._batch_starts: list[int] = []
        self._kept: list[bytes] = []  # small tensors' bytes fetched by the index walk (keep)
        self._kept_starts: list[int] = []
        self._kept_bytes = 0

    # -- RandomAccess --------------------------------------------------------------------------
    def pread_into(self, offset: int, view: memoryview) -> int:
        self._check_open()
        view = memoryview(view)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        ((offset, n),) = clip_ranges([(offset, len(view))], self.size)
        if n == 0:
            return 0
        with self._lock:
            w_off, window = self._window_offset, self._window
            if w_off <= offset and offset + n <= w_off + len(window):
                view[:n] = memoryview(window)[offset - w_off:offset - w_off + n]
                return n
            if self._from_kept(offset, view[:n]) or self._from_batch(offset, view[:n]):
                return n
            if n >= MAX_READAHEAD:
                self._fetch([(offset, n)], [view[:n]])
                return n
            if self._fetch_batch(offset, n) and self._from_batch(offset, view[:n]):
                return n
            sequential = bool(window) and w_off <= offset <= w_off + len(window) + SEQUENTIAL_GAP
            self._readahead = min(2 * self._readahead, MAX_READAHEAD) if sequential else \
                LEAN_READAHEAD if _lean[0] else MIN_READAHEAD
            length = min(max(n, self._readahead), self.size - offset)
            # The window's buffer is reused while its size stays (a header walk refills it hundreds
            # of times): a fresh one per fill costs zeroing and page faults of megabytes each time.
            # It holds nothing valid while it is being refilled, in case the fetch fails.
            buf = window if isinstance(window, bytearray) and len(window) == length else bytearray(length)
            self._window = b""
            self._fetch([(offset, length)], [memoryview(buf)])
            self._window_offset, self._window = offset, buf
            view[:n] = memoryview(buf)[:n]
            return n

    def read_into(self, offset: int, view: memoryview) -> int:
        """Fill `view` from `offset` with requests of its own: bytes read once, front to back
        (``sources.file_digests.DigestingReader``), keep no read-ahead window alive after the read."""
        self._check_open()
        ((offset, n),) = clip_ranges([(offset, len(view))], self.size)
        if n:
            self._fetch([(offset, n)], [memoryview(view)[:n]])
        return n

    def read_ranges(self, ranges: list[tuple[int, int]]) -> list[bytes]:
        self._check_open()
        clipped = clip_ranges(list(ranges), self.size)
        buffers = [bytearray(length) for _, length in clipped]
        self._fetch(clipped, [memoryview(b) for b in buffers])
        out = []
        for i in range(len(buffers)):
            out.append(bytes(buffers[i]))
            buffers[i] = bytearray()  # drop each buffer once copied: peak = total + one range
        return out

    def expect(self, ranges: list[tuple[int, int]], budget: int) -> None:
        """Reads about to come (``read_ahead.announce``): a later read inside them that misses
        fetches them from that point on, up to `budget` bytes, as coalesced parallel requests."""
        merged: list[tuple[int, int]] = []
        wanted = (r for r in clip_ranges(list(ranges), self.size) if r[1] > 0 and not self._is_kept(*r))
        for offset, length in sorted(wanted):
            if merged and offset <= merged[-1][0] + merged[-1][1]:
                last_offset, last_length = merged[-1]
                merged[-1] = (last_offset, max(last_length, offset + length - last_offset))
            else:
                merged.append((offset, length))
        with self._lock:
            self._expected, self._expected_starts = merged, [o for o, _ in merged]
            self._budget = max(MIN_READAHEAD, budget)
            self._batch, self._batch_starts = [], []
            self._window = b""  # the header walk's last window: reads come from batches now

    # -- small tensors met while indexing -------------------------------------------------------
    # The layer norms and biases that optimizer parallelism spreads over every rank are wanted by
    # every target rank, a few hundred bytes each between large records: fetching them again for
    # each target costs either a request each or, merged, the large records between them. Their
    # bytes passed through the index walk once; up to KEPT_LIMIT of them stay (forked workers
    # inherit them) and reads of them, announced or not, are answered from memory.
    def note_content(self, offset: int, length: int, *tensor) -> None:
        """A format reader walking the object found a tensor's bytes here (``DigestingReader`` and
        the ``.ckpt`` and safetensors readers call this, with the tensor's name, dtype and dims):
        a small one in the window is kept."""
        w_off, window = self._window_offset, self._window
        if 0 < length <= SMALL_CONTENT and w_off <= offset and offset + length <= w_off + len(window):
            self.keep(offset, memoryview(window)[offset - w_off:offset - w_off + length])

    def keep(self, offset: int, data) -> None:
        """Keep `data`, the object's bytes at `offset`, if it is a small tensor's (up to
        SMALL_CONTENT) and within KEPT_LIMIT; in increasing offsets, others are ignored."""
        if not 0 < len(data) <= SMALL_CONTENT or self._kept_bytes + len(data) > KEPT_LIMIT or (
                self._kept_starts and offset < self._kept_starts[-1] + len(self._kept[-1])):
            return
        self._kept.append(bytes(data))
        self._kept_starts.append(offset)
        self._kept_bytes += len(data)

    def _kept_at(self, offset: int, n: int) -> int:
        """Index of the kept bytes holding [offset, offset + n), or -1."""
        i = bisect.bisect_right(self._kept_starts, offset) - 1
        return i if i >= 0 and offset + n <= self._kept_starts[i] + len(self._kept[i]) else -1

    def _is_kept(self, offset: int, n: int) -> bool:
        return self._kept_at(offset, n) >= 0

    def _from_kept(self, offset: int, view: memoryview) -> bool:
        i = self._kept_at(offset, len(view))
        if i < 0:
            return False
        start = self._kept_starts[i]
        view[:] = memoryview(self._kept[i])[offset - start:offset - start + len(view)]
        return True

    def _from_batch(self, offset: int, view: memoryview) -> bool:
        i = bisect.bisect_right(self._batch_starts, offset) - 1
        if i < 0:
            return False
        start, data = self._batch[i]
        if offset + len(view) > start + len(data):
            return False
        view[:] = data[offset - start:offset - start + len(view)]
        return True

    def _fetch_batch(self, offset: int, n: int) -> bool:
        """Fetch the expected ranges from `offset` on, up to the budget; False if it is not expected."""
        i = bisect.bisect_right(self._expected_starts, offset) - 1
        if i < 0 or offset + n > sum(self._expected[i]):
            return False
        wanted, total = [], 0
        for start, length in self._expected[i:]:
            start, length = max(start, offset), length - (max(start, offset) - start)
            take = min(length, self._budget - total)
            if take <= 0 or (wanted and take < length):
                break  # whole ranges only, but the first, which may be longer than the budget
            wanted.append((start, take))
            total += take
        if wanted[0][1] < n:
            return False
        self._batch = []  # the previous batch goes before the next one is fetched
        # One buffer for the batch, kept for the next one while it is large enough: a rank task
        # fetches batch after batch, and fresh megabytes each time cost zeroing and page faults.
        total = sum(length for _, length in wanted)
        if len(self._batch_buffer) < total:
            self._batch_buffer = bytearray(total)
        whole, buffers, at = memoryview(self._batch_buffer), [], 0
        for _, length in wanted:
            buffers.append(whole[at:at + length])
            at += length
        self._fetch(wanted, buffers)
        self._batch = [(start, b) for (start, _), b in zip(wanted, buffers)]
        self._batch_starts = [start for start, _ in wanted]
        return True

    def close(self) -> None:
        self._closed = True
        self._window = b""
        self._batch, self._expected, self._batch_buffer = [], [], bytearray()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- fetching ------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"{self.path}: reader is closed")

    def _fetch(self, ranges: list[tuple[int, int]], sinks: list[memoryview], *, max_gap: int | None = None,
               max_request: int = MAX_REQUEST) -> None:
        """Fill sinks[i] with the bytes of ranges[i] (already clipped to the object)."""
        if max_gap is None:
            max_gap = LEAN_INDEX_WINDOW if _lean[0] else MAX_GAP
        requests = plan_requests(ranges, max_gap=max_gap, max_request=max_request)
        if requests:
            self._store.run(self._run_requests, requests, ranges, sinks,
                            transfer=sum(r.end - r.offset for r in requests))

    async def _run_requests(self, requests: list[Request], ranges, sinks) -> None:
        client = await self._store.client()
        gate = asyncio.Semaphore(self._concurrency)

        async def one(request: Request) -> None:
            async with gate:
                await self._stream(client, request, ranges, sinks)

        tasks = [asyncio.ensure_future(one(r)) for r in requests]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _stream(self, client, request: Request, ranges, sinks) -> None:
        retryable = _stream_errors()
        for attempt in range(STREAM_ATTEMPTS):
            try:
                response = await client.get_object(Bucket=self._bucket, Key=self._key, IfMatch=self.etag,
                                                   Range=f"bytes={request.offset}-{request.end - 1}")
            except Exception as e:  # noqa: BLE001 - every store failure becomes one line
                raise self._error(e) from None
            self.requests += 1
            body = response["Body"]
            try:
                await self._copy_body(body, request, ranges, sinks)
                return
            except retryable as e:
                if attempt + 1 == STREAM_ATTEMPTS:
                    raise self._error(e) from None
            finally:
                body.close()

    async def _copy_body(self, body, request: Request, ranges, sinks) -> None:
        pieces = request.pieces
        pos, first = request.offset, 0
        while pos < request.end:
            chunk = await body.read(min(STREAM_CHUNK, request.end - pos))
            if not chunk:
                raise SourceChangedError(f"{self.path}: the store sent {pos - request.offset} of "
                                         f"{request.length} bytes asked for; the object changed or is damaged")
            data = memoryview(chunk)
            chunk_end = pos + len(chunk)
            while first < len(pieces) and pieces[first].end <= pos:
                first += 1
            i = first
            while i < len(pieces) and pieces[i].offset < chunk_end:
                piece = pieces[i]
                lo, hi = max(piece.offset, pos), min(piece.end, chunk_end)
                if lo < hi:
                    base = ranges[piece.index][0]
                    sinks[piece.index][lo - base:hi - base] = data[lo - pos:hi - pos]
                i += 1
            self.bytes_fetched += len(chunk)
            pos = chunk_end

    def _error(self, e: BaseException) -> Exception:
        if is_absent(e):
            return SourceChangedError(f"{self.path}: was deleted while the job was reading it")
        return storage_error(e, self.path, "reading it", endpoint=self._store.endpoint, bucket=self._bucket)
