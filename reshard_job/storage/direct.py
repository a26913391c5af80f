"""Writing a new file with ``O_DIRECT``: the sink ``AtomicFile(direct=True)`` writes through.

Large outputs (checkpoints) are written with ``O_DIRECT`` where the file system allows it. A
buffered write copies every byte into freshly allocated page-cache pages, and on virtual
machines that copy, not the disk, is the slowest part of writing a checkpoint; the dirty pages
must then be flushed by ``fsync`` anyway before the rename may expose the file. Writing straight
from two reused, block-aligned staging buffers costs almost no CPU, and a writer thread hashes and
writes one buffer while the caller fills the other; hashing and writing a buffer overlap (hash
threads work while the writer waits on the disk), so the write time is not the hash time plus the
disk time. The file's sha256 and the digests of byte ranges asked for with ``write_hashed`` (a
checkpoint's per-tensor digests) are fed by two threads side by side, so the caller's thread does
not hash at all and the two digests take the time of one. The last, partial block is written
padded and the file truncated to its real length. Where ``O_DIRECT`` is refused (tmpfs, some
network file systems) ``open_direct`` says so and the file is written buffered.

The size of a staging buffer (``atomic.DIRECT_CHUNK``) is chosen by the caller when it opens a file.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

DIRECT_ALIGN = 4096  # covers 512- and 4096-byte logical blocks


class _StagingPool:
    """Reuses staging buffers across files: a fresh mapping would page-fault (and zero) all its
    memory again for every output file."""

    def __init__(self) -> None:
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def take(self, size: int) -> mmap.mmap:
        with self._lock:
            for i, b in enumerate(self._free):
                if len(b) == size:
                    return self._free.pop(i)
        # private anonymous memory (the default, MAP_SHARED, is shmem: slower to fault in)
        return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)

    def give(self, buf: mmap.mmap) -> None:
        with self._lock:
            if len(self._free) < 4:
                self._free.append(buf)
                return
        buf.close()


_STAGING = _StagingPool()


class DirectFile:
    """File-like sink writing through O_DIRECT from two aligned staging buffers.

    ``write`` copies into the current buffer; a full buffer goes to a writer thread, which feeds it
    to the hash and to the file (both release the GIL) while the next one fills. Errors of the
    writer thread surface on the following ``write`` or on ``flush``.
    """

    def __init__(self, fd: int, hasher, chunk: int):
        self._fd = fd
        self._hash = hasher
        self._bufs = [_STAGING.take(chunk), _STAGING.take(chunk)]  # page-aligned, as O_DIRECT needs
        self._chunk = chunk
        self._cur = 0
        self._fill = 0
        self._size = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="direct-write")
        # the file's sha256 and the tensors' digests in two threads: each is as long as the write
        # itself, and one after the other they were what the writer (and the caller) waited for
        self._hash_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="direct-hash")
        self._pending: Future | None = None
        self._closed = False
        self._written = 0  # bytes passed to write so far
        self._taps: deque = deque()  # [start, end, hasher]: file ranges whose bytes feed hasher too
        # the caller extends the last range while a hash thread feeds and drops the first: the same
        # list can be both, and a range dropped as done while being extended lost its next bytes
        self._taps_lock = threading.Lock()

    def fileno(self) -> int:
        return self._fd

    def write(self, data, tap=None) -> int:
        mv = memoryview(data).cast("B")
        total = len(mv)
        self._account(total, tap)  # before the bytes are staged: a block handed over has all its taps listed
        while len(mv):
            buf = self._bufs[self._cur]
            n = min(self._chunk - self._fill, len(mv))
            buf[self._fill:self._fill + n] = mv[:n]
            self._fill += n
            mv = mv[n:]
            if self._fill == self._chunk:
                self._hand_over(self._chunk, self._chunk)
        return total

    def room(self) -> int:
        """Bytes that ``reserve`` can hand out now: what is left of the current staging block."""
        return self._chunk - self._fill

    def reserve(self, n: int) -> memoryview:
        """Writable staging space for the next `n` bytes (at most ``room()``), to be filled in place
        (a source read straight into it is one copy less than ``write``); ``commit_reserved`` takes it."""
        if not 0 < n <= self._chunk - self._fill:
            raise ValueError(f"cannot reserve {n} bytes: {self._chunk - self._fill} left in the block")
        return memoryview(self._bufs[self._cur])[self._fill:self._fill + n]

    def commit_reserved(self, n: int, tap=None) -> None:
        """The first `n` reserved bytes are filled: they follow what was written before."""
        if not 0 <= n <= self._chunk - self._fill:
            raise ValueError(f"cannot commit {n} bytes: {self._chunk - self._fill} left in the block")
        self._account(n, tap)
        self._fill += n
        if self._fill == self._chunk:
            self._hand_over(self._chunk, self._chunk)

    def _account(self, n: int, tap) -> None:
        """The next `n` bytes of the file, fed to `tap` too (if any): extend its last range or add one."""
        if tap is not None and n:
            with self._taps_lock:
                last = self._taps[-1] if self._taps else None
                if last is not None and last[2] is tap and last[1] == self._written:
                    last[1] += n
                else:
                    self._taps.append([self._written, self._written + n, tap])
        self._written += n

    def _hand_over(self, length: int, padded: int) -> None:
        self._wait()
        self._pending = self._pool.submit(self._write_block, self._cur, length, padded)
        self._cur ^= 1
        self._fill = 0

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def _write_block(self, index: int, length: int, padded: int) -> None:
        view = memoryview(self._bufs[index])
        # one buffer at a time (the hand-over waits), so the hash still sees the bytes in order
        hashed = [self._hash_pool.submit(self._hash.update, view[:length])]
        if self._taps and self._taps[0][0] < self._size + length:
            hashed.append(self._hash_pool.submit(self._hash_taps, view[:length], self._size))
        try:
            done = 0
            while done < padded:
                n = os.write(self._fd, view[done:padded])
                if n <= 0:
                    raise OSError(errno.EIO, "short write")
                done += n
        finally:
            for h in hashed:
                h.result()  # the buffer is refilled only after its digests have read it
        self._size += length

    def _hash_taps(self, view: memoryview, start: int) -> None:
        """Feed the block's bytes to the digests of the ranges that lie in it (blocks come one at a
        time, in order, so each digest still sees its bytes in order)."""
        end = start + len(view)
        taps = self._taps
        while True:
            with self._taps_lock:  # what is fed from here is decided at once: extended later, it is not dropped
                if not taps or taps[0][0] >= end:
                    return
                t0, t1, hasher = taps[0]
                lo, hi = max(t0, start), min(t1, end)
                done = t1 <= end
                if done:
                    taps.popleft()
            hasher.update(view[lo - start:hi - start])
            if not done:
                return  # continues in the next block

    def flush(self) -> None:
        """Write everything staged (the last block padded) and cut the file to its real length."""
        if self._fill:
            padded = -(-self._fill // DIRECT_ALIGN) * DIRECT_ALIGN
            self._bufs[self._cur][self._fill:padded] = bytes(padded - self._fill)
            self._hand_over(self._fill, padded)
        self._wait()
        os.ftruncate(self._fd, self._size)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._pending is not None:
                self._pending.exception()  # wait; its error (if any) was or will be reported elsewhere
        finally:
            self._pool.shutdown(wait=True)
            self._hash_pool.shutdown(wait=True)
            for b in self._bufs:
                try:
                    _STAGING.give(b)
                except BufferError:  # a reserved view still alive (an error mid-fill): left to the GC
                    pass
            self._bufs = []
            os.close(self._fd)


def open_direct(path: str) -> int | None:
    """An O_DIRECT descriptor for a new file, or None where the file system refuses O_DIRECT."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | flag | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
            return None
        raise
