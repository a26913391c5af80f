"""Writing a `.ckpt` file: records streamed into an atomic output, hashed on the way.

The writer encodes the records byte for byte as MindSpore's ``save_checkpoint`` does, streaming
tensor bytes from the caller's buffers, hashing the file and every tensor as it goes, and
publishing the file (rename, or completing an upload) only when everything is written.
"""

from __future__ import annotations

import hashlib
import os
import zlib
from math import prod
from typing import Sequence

import numpy as np

from reshard_job.errors import LayoutError
import reshard_job.core.dtypes as dtypes
from reshard_job.storage.base import TeeHasher, write_hashed
from reshard_job.formats.base import TensorDecl, WrittenFile
from reshard_job.formats.tensor_digests import TensorDigests
from reshard_job.formats.ckpt.records import (CRC_MAGIC, SLICE_BYTES, default_chunks, map_record, record_header,
                                             records_alike, tensor_field)


class RecordSink:
    """Accepts one tensor's bytes in order, in pieces of any size, and frames them into records.

    `records` lists (dims, dtype, content length) of each record the tensor is stored in: one
    record per 512 MiB chunk with the same dims and dtype when writing anew, or the exact records
    of a file being rewritten.
    """

    def __init__(self, writer: "CheckpointWriter", name: str, records: list[tuple[tuple[int, ...], str, int]],
                 defer_hash: bool = True):
        self._w = writer
        self._defer = defer_hash  # hashed by the output's writer thread (digest known at commit)
        self.name = name
        self._records = list(records)
        self._next = 0
        self._left = 0
        feed = writer.fingerprint_tap.feed(name) if writer.fingerprint_tap is not None else None
        # the fingerprint tap sees what the tensor's digest sees, where it sees it
        self._hash = hashlib.sha256() if feed is None else TeeHasher(hashlib.sha256(), feed)
        self.total = sum(n for _, _, n in self._records)
        self.written = 0
        self._reserved: memoryview | None = None
        self._advance()

    def _advance(self) -> None:
        while self._left == 0 and self._next < len(self._records):
            dims, dtype, size = self._records[self._next]
            self._next += 1
            self._w._emit(record_header(self.name, dims, dtype, size), record=True)
            self._left = size

    def write(self, data) -> None:
        mv = memoryview(data).cast("B")
        if self.written + len(mv) > self.total:
            raise ValueError(f"parameter {self.name!r}: more bytes than its dims and dtype hold")
        if not self._defer:
            self._hash.update(mv)
        tap = self._hash if self._defer else None
        while len(mv):
            take = min(self._left, len(mv))
            self._w._emit(mv[:take], record=True, tap=tap)
            mv = mv[take:]
            self._left -= take
            self.written += take
            self._advance()

    def room(self) -> int:
        """Bytes ``reserve`` can hand out now: 0 where the output takes bytes through ``write`` only."""
        room = getattr(self._w._file, "room", None)
        return min(room(), self._left) if room is not None else 0

    def reserve(self, n: int) -> memoryview:
        """Writable space in the output for this tensor's next `n` bytes (at most ``room()``), to be
        filled in place and taken by ``commit``: the bytes are not copied on their way to the file."""
        if n > self.room():
            raise ValueError(f"parameter {self.name!r}: cannot reserve {n} bytes, {self.room()} available")
        self._reserved = self._w._file.reserve(n)
        return self._reserved

    def commit(self, n: int) -> None:
        """The first `n` bytes of the space from ``reserve`` hold the tensor's next bytes."""
        view, self._reserved = self._reserved[:n], None
        if not self._defer:
            self._hash.update(view)
        if self._w.crc:
            self._w._crc = zlib.crc32(view, self._w._crc)
        del view  # the staging buffer must not stay exported once handed over
        self._w._file.commit_reserved(n, self._hash if self._defer else None)
        self._left -= n
        self.written += n
        self._advance()

    def close(self) -> str | None:
        """The tensor is complete: its sha256, or None where the output hashes it in its writer
        thread (known once the file is committed: ``CheckpointWriter.commit`` returns it in ``tensors``)."""
        self._advance()  # records of zero bytes after the last data
        if self.written != self.total:
            raise ValueError(f"parameter {self.name!r}: got {self.written} of {self.total} bytes")
        if self._defer:
            self._w._tensor_done(self.name, self._hash)
            return None
        digest = self._hash.digest()
        self._w._tensor_done(self.name, digest)
        return digest.hex()


_JOIN_BELOW = 64 * 1024  # tensors up to this size are gathered with their header into batches
_BATCH = 256 * 1024  # bytes of small records handed to the file at once
_PLAIN: set[tuple] = set()  # (dims, dtype, content length) found to be a plain one-record tensor


def _plain_tensor(dims, dtype: str, n: int) -> bool:
    """Whether `n` bytes are exactly what dims and dtype say (a str entry is not a tensor);
    remembered per (dims, dtype, length): a model's many small tensors share a few of them."""
    try:
        if (dims, dtype, n) in _PLAIN:
            return True
    except TypeError:  # dims given as a list
        pass
    dt = dtypes.BY_NAME.get(dtype)
    dims = tuple(int(d) for d in dims)
    if dt is None or dtype == dtypes.STR_TYPE or prod(dims) * dt.itemsize != n:
        return False
    if len(_PLAIN) < 10_000:
        _PLAIN.add((dims, dtype, n))
    return True


class CheckpointWriter:
    """Write a `.ckpt` file record by record; ``commit`` publishes it.

    `target` is a path or URL (written through ``reshard_job.storage``, atomically, reaching an
    object store with the ``StorageOptions`` `storage`) or an open ``storage.AtomicWriter``. Used as a context manager it commits on success and drops the
    unfinished output on error, so a reader never sees a partial file under the final name.
    """

    def __init__(self, target, *, crc: bool = False, chunk_bytes: int = SLICE_BYTES, mode: int = 0o444,
                 storage=None):
        if isinstance(target, (str, os.PathLike)):
            from reshard_job.storage import absolute, storage_for

            path = absolute(target)  # `storage`: the StorageOptions reaching a URL's store
            target = storage_for(path, storage).create(path, mode=mode, large=True)
        self._file = target
        self.path = target.path
        self.crc = crc
        self.chunk_bytes = chunk_bytes
        self._crc = 0
        self._open_sink: RecordSink | None = None
        self._batch = bytearray()  # small records not yet handed to the file (one write per _BATCH bytes)
        self.tensors = TensorDigests()  # name -> sha256 (hashers of deferred ones complete at commit)

    # --- low level ------------------------------------------------------------------------------
    def _emit(self, data, *, record: bool, tap=None) -> None:
        if self._batch:
            self._flush_batch()
        if tap is None:
            self._file.write(data)
        else:
            write_hashed(self._file, data, tap)
        if record and self.crc:
            self._crc = zlib.crc32(data, self._crc)

    def _flush_batch(self) -> None:
        batch = self._batch
        self._file.write(batch)  # copied (staged or written) before it returns
        if self.crc:
            self._crc = zlib.crc32(batch, self._crc)
        batch.clear()

    def _tensor_done(self, name: str, digest) -> None:
        """`digest`: the 32 bytes, or a hasher still being fed until the file is committed."""
        if isinstance(digest, bytes):
            self.tensors.add(name, digest)
        else:
            self.tensors.add_later(name, digest)
        self._open_sink = None

    # --- tensors --------------------------------------------------------------------------------
    writes_in_given_order = True  # ``arrange`` is the identity: callers may skip it
    # ``execute.writer_tap.WriterTap`` (or None): tensors it expects are fed to it as they are hashed
    fingerprint_tap = None

    def arrange(self, tensors: Sequence[TensorDecl]) -> list[str]:
        """Records go in the order given."""
        return [t.name for t in tensors]

    def begin(self, name: str, dtype: str, dims, chunk_sizes: list[int] | None = None, *,
              defer_hash: bool = True) -> RecordSink:
        """Start a tensor whose bytes will be passed to the returned sink's ``write``."""
        dims = tuple(int(d) for d in dims)
        if dtype == dtypes.STR_TYPE:
            raise ValueError("use add_str for str entries")
        dt = dtypes.BY_NAME.get(dtype)
        if dt is None:
            raise LayoutError(f"parameter {name!r}: unknown dtype {dtype!r}")
        if chunk_sizes is None:
            chunk_sizes = default_chunks(prod(dims) * dt.itemsize, self.chunk_bytes)
        return self.begin_records(name, [(dims, dtype, n) for n in chunk_sizes], defer_hash=defer_hash)

    def begin_records(self, name: str, records: list[tuple[tuple[int, ...], str, int]], *,
                      defer_hash: bool = True) -> RecordSink:
        """Start a tensor stored in exactly these records (dims, dtype, content length each)."""
        if self._open_sink is not None:
            raise RuntimeError(f"parameter {self._open_sink.name!r} is still being written")
        if self._batch:  # the sink may write to the file's staging space directly
            self._flush_batch()
        self._open_sink = RecordSink(self, name, records, defer_hash)
        return self._open_sink

    def add(self, name: str, array: np.ndarray, dtype: str | None = None, dims=None) -> str:
        """Write a whole tensor from a numpy array (dtype defaults from the array; uint16 stays UInt16)."""
        array = np.asarray(array)
        if dtype is None:
            dtype = dtypes.from_numpy(array.dtype).name
        dt = dtypes.lookup(dtype)
        if dt.storage is not None and array.dtype.itemsize != dt.itemsize:
            raise ValueError(f"parameter {name!r}: array of {array.dtype} cannot hold {dtype}")
        sink = self.begin(name, dtype, array.shape if dims is None else dims, defer_hash=False)
        sink.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
        return sink.close()

    def add_bytes(self, name: str, dtype: str, dims, data, chunk_sizes: list[int] | None = None) -> str:
        mv = memoryview(data).cast("B")
        n = len(mv)
        if chunk_sizes is None and 0 < n <= self.chunk_bytes and self._open_sink is None:
            # one record, header and bytes at once: the common case of the many small tensors
            if _plain_tensor(dims, dtype, n):
                head = record_header(name, dims, dtype, n)
                if n <= _JOIN_BELOW:  # gathered with its neighbours: one write per _BATCH bytes
                    batch = self._batch
                    batch += head
                    batch += mv
                    if len(batch) >= _BATCH:
                        self._flush_batch()
                else:
                    self._emit(head, record=True)
                    self._emit(mv, record=True)
                digest = hashlib.sha256(mv).digest()
                self.tensors.add(name, digest)
                feed = self.fingerprint_tap.feed(name) if self.fingerprint_tap is not None else None
                if feed is not None:
                    feed.update(mv)
                return digest.hex()
        sink = self.begin(name, dtype, dims, chunk_sizes, defer_hash=False)  # its digest is returned
        sink.write(mv)
        return sink.close()

    def add_alike(self, names: list[str], dtype: str, dims: tuple, contents: list[bytes],
                  counted: list | None = None) -> None:
        """Whole tensors of one dtype and dims, each of the bytes `contents` holds for it: what
        ``add_bytes`` of each does, with the per-record work done for all at once (their records
        made in two joins, their digests kept in one call). A model of many small tensors is a
        model of many such runs. `counted`: each one's ``WriterTap.spec_for`` (None: not counted),
        given instead of an ``expect`` each."""
        tap = self.fingerprint_tap
        n = len(contents[0]) if contents else 0
        if not (0 < n <= _JOIN_BELOW and self._open_sink is None and _plain_tensor(dims, dtype, n)
                and len(names) == len(contents) and sum(map(len, contents)) == n * len(contents)):
            for i, (name, data) in enumerate(zip(names, contents)):
                if counted is not None and tap is not None:
                    tap.expect_spec(name, counted[i])
                self.add_bytes(name, dtype, dims, data)
            return
        self._batch += records_alike(names, tensor_field(dims, dtype, n), contents)
        if len(self._batch) >= _BATCH:
            self._flush_batch()
        self.tensors.add_all(names, [hashlib.sha256(data).digest() for data in contents])
        if tap is not None:
            if counted is not None:
                tap.take_many(names, contents, counted)
            else:
                tap.feed_many(names, contents)

    def add_str(self, name: str, text: str, dims=(0,)) -> str:
        """A string entry as MindSpore writes append_dict strings: dims [0], UTF-32LE content."""
        content = text.encode("utf-32-le")
        self._emit(record_header(name, dims, dtypes.STR_TYPE, len(content)), record=True)
        self._emit(content, record=True)
        digest = hashlib.sha256(content).digest()
        self.tensors.add(name, digest)
        return digest.hex()

    def add_str_blocks(self, name: str, blocks, nbytes: int, dims=(0,)) -> str:
        """``add_str`` of a string given as its `nbytes` UTF-32LE bytes in blocks (as a reader's
        ``iter_str_bytes`` checks them): a string of 300 MB is not held, decoded and encoded again."""
        digest, written = hashlib.sha256(), 0
        self._emit(record_header(name, dims, dtypes.STR_TYPE, nbytes), record=True)
        for block in blocks:
            self._emit(block, record=True)
            digest.update(block)
            written += len(block)
        if written != nbytes:
            raise ValueError(f"str entry {name!r}: {written} bytes given, {nbytes} announced")
        self.tensors.add(name, digest.digest())
        return digest.hexdigest()

    def add_map(self, name: str, records: list[list[tuple[tuple[int, ...], str, bytes]]]) -> None:
        """Map-tensor records (keys, values, status per record). Not covered by the CRC, as in MindSpore."""
        h = hashlib.sha256()
        for parts in records:
            self._emit(map_record(name, parts), record=False)
            for _, _, content in parts:
                h.update(content)
        self.tensors.add(name, h.digest())

    # --- finishing ------------------------------------------------------------------------------
    def commit(self) -> WrittenFile:
        return self._finish(publish_now=True)[0]

    def seal(self):
        """Finish the file without publishing it: (WrittenFile, handle). ``handle.publish()`` makes it
        durable and visible, ``handle.abort()`` drops it; handle is None where the output cannot
        wait (it was published here already: an object-store upload, for one)."""
        return self._finish(publish_now=False)

    def _finish(self, *, publish_now: bool):
        handle = None
        try:
            if self._open_sink is not None:
                raise RuntimeError(f"parameter {self._open_sink.name!r} was not finished")
            if self._batch:
                self._flush_batch()
            if self.crc:
                self._emit(CRC_MAGIC + self._crc.to_bytes(10, "big"), record=False)
            if publish_now or not hasattr(self._file, "seal"):
                size, digest = self._file.commit()
            else:
                size, digest = self._file.seal()
                handle = self._file.sealed()
        except BaseException:
            self._file.abort()  # never leave the temporary file behind
            raise
        return WrittenFile(self.path, size, digest, self.tensors.complete()), handle

    def abort(self) -> None:
        self._file.abort()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.result = self.commit()
        else:
            self.abort()
        return False
