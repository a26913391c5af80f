"""Positioned reads of tensor boxes from an indexed file, shared by the `.ckpt` and safetensors readers.

Why positioned reads (``os.preadv`` into the caller's buffer) and not a memory map: pages of a
mapped file count towards the process's resident set, so mapping a 100 GB checkpoint and touching
most of it looks, to a batch scheduler, like a 100 GB process. Reading a box straight into its
destination buffer keeps the resident set at the size of the buffers in flight, and costs no extra
copy in the common case where the box is one contiguous byte range.
"""

from __future__ import annotations

import bisect
import codecs
import itertools
import os
from dataclasses import dataclass, field
from math import prod
from typing import TYPE_CHECKING

import numpy as np

from reshard_job.errors import FormatError, LayoutError
import reshard_job.core.dtypes as dtypes
from reshard_job.core.boxes import Box, box_shape, full_box

if TYPE_CHECKING:
    from reshard_job.storage import RandomAccess

# A run of at least this many contiguous bytes is read on its own; shorter runs are read as part
# of a larger enclosing span and cut out in memory (fewer system calls, some bytes read twice).
MIN_DIRECT_RUN = 8 * 1024
# Bound on the enclosing-span buffer used for short runs.
SPAN_BUFFER = 4 * 1024 * 1024


class Scratch:
    """A reusable byte buffer that grows to the largest size asked for.

    Fresh allocations of tens of MiB are returned to the system when freed, so every new one
    page-faults all its memory in again, which on a virtual machine costs more than the copy
    itself. Reusing one buffer per purpose keeps the resident set flat and the copies fast.
    """

    def __init__(self) -> None:
        self._buf = np.empty(0, dtype=np.uint8)

    def get(self, nbytes: int) -> np.ndarray:
        if nbytes > self._buf.size:
            self._buf = np.empty(max(nbytes, min(2 * self._buf.size, SPAN_BUFFER * 8)), dtype=np.uint8)
        return self._buf[:nbytes]

    def array(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        return self.get(prod(shape) * dtype.itemsize).view(dtype).reshape(shape)


NEAR_WINDOW = 1 << 20  # the most bytes ``read_near`` reads at once
NEAR_MIN = 16 << 10  # ... and the fewest (where reads do not follow each other)

_SPANS = Scratch()
_BLOCKS = Scratch()


KIND_TENSOR = "tensor"
KIND_STR = "str"
KIND_MAP = "map"


@dataclass(slots=True)
class TensorEntry:
    """Where one tensor's bytes lie in a file: contiguous pieces in logical (C) order.

    Slotted and without per-entry dictionaries unless a format needs them: a mixture-of-experts
    checkpoint holds hundreds of thousands of entries per file.
    """

    name: str
    dtype: str  # MindSpore tensor_type name ("Float16", "BFloat16", "str", ...)
    shape: tuple[int, ...]
    nbytes: int
    # (file offset, length) of each piece, in order; their concatenation is the tensor's bytes
    pieces: list[tuple[int, int]] = field(default_factory=list)
    kind: str = KIND_TENSOR  # tensor | str | map
    # logical start of each piece, for bisecting; filled by finish()
    starts: list[int] | None = field(default=None, repr=False)
    extra: object = field(default=None, repr=False)  # format-specific details

    def finish(self) -> "TensorEntry":
        pos = 0
        starts = []
        for _, length in self.pieces:
            starts.append(pos)
            pos += length
        self.starts = starts
        return self

    @property
    def stored_bytes(self) -> int:
        return sum(length for _, length in self.pieces)


class PositionedReader:
    """Base for readers that index a file once and then serve tensors and boxes by offset.

    `source` is a path (opened read-only through ``reshard_job.storage``) or an already open
    ``storage.RandomAccess``, which the reader then closes with itself.
    """

    path: str

    def __init__(self, source: "str | os.PathLike | RandomAccess"):
        self.entries: dict[str, TensorEntry] = {}
        self._file: RandomAccess | None = None
        if isinstance(source, (str, os.PathLike)):
            self.path = os.fspath(source)
            self._file = self._open(self.path)
        else:
            self.path = source.path
            self._file = source
        self.size = self._file.size
        self.identity = self._file.identity
        self._near: memoryview | None = None  # the window of ``read_near``
        self._near_start = self._near_len = 0
        self._near_want = NEAR_MIN  # bytes the next refill reads

    # --- file handle -------------------------------------------------------------------------
    def _open(self, path: str) -> "RandomAccess":
        from reshard_job.storage import StorageError, storage_for

        try:
            return storage_for(path).open_read(path)
        except FileNotFoundError:
            raise self._error("file not found") from None
        except StorageError as e:  # the format's own error type, naming the file once
            text = str(e)
            raise self._error(text[len(path) + 2:] if text.startswith(path + ": ") else text) from None

    def close(self) -> None:
        self._near = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def _error(self, problem: str) -> FormatError:
        raise NotImplementedError

    # --- mapping ------------------------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def __getitem__(self, name: str) -> TensorEntry:
        return self.entries[name]

    def __iter__(self):
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def names(self) -> list[str]:
        return list(self.entries)

    def describe(self, name: str) -> tuple[str, tuple[int, ...], str, int]:
        """(dtype, shape, kind, nbytes) of an entry, without building more than needed."""
        e = self.entries[name]
        return e.dtype, tuple(e.shape), e.kind, e.nbytes

    # --- raw reads ----------------------------------------------------------------------------
    @property
    def wants_read_ahead(self) -> bool:
        """Whether announced reads help this file (an object store batches them; a local file does not)."""
        return getattr(self._file, "expect", None) is not None

    def expect_reads(self, ranges: list[tuple[int, int]], budget: int) -> None:
        """Tell the file which (offset, length) ranges are about to be read; an object store
        fetches them in coalesced batches of up to `budget` bytes, a local file ignores it."""
        expect = getattr(self._file, "expect", None)
        if expect is not None:
            expect(ranges, budget)

    def pread_into(self, offset: int, view: memoryview) -> None:
        """Fill `view` from the file at `offset`; a short file is a format error."""
        if self._file is None:
            raise self._error("read after close")
        n = self._file.pread_into(offset, view)
        if n < len(view):
            raise self._error(f"unexpected end of file at byte {offset + n} (file truncated?)")

    def read_near(self, offset: int, nbytes: int) -> memoryview:
        """Bytes [offset, offset+nbytes) as a view that stays valid until the next call.

        For the many small tensors of a large model, read in file order: one positioned read of a
        window serves the tensors that follow it, instead of a system call each. An object store
        gets one exact read per call (its announced ranges are fetched in batches already)."""
        rel = offset - self._near_start
        if self._near is not None and rel >= 0 and rel + nbytes <= self._near_len:
            return self._near[rel:rel + nbytes]
        if nbytes > NEAR_WINDOW // 4 or self.wants_read_ahead:
            view = memoryview(bytearray(nbytes))
            self.pread_into(offset, view)
            return view
        if self._near is None:
            self._near = memoryview(bytearray(NEAR_WINDOW))
        # Read ahead as far as reads keep coming in order: a window that grows while each miss
        # lands just past the last one, and starts small again elsewhere (a bias before a large
        # weight would otherwise pull a megabyte of the weight through the window).
        gap = offset - (self._near_start + self._near_len)
        self._near_want = min(2 * self._near_want, NEAR_WINDOW) if 0 <= gap < NEAR_MIN else NEAR_MIN
        n = max(nbytes, min(self._near_want, self.size - offset))
        self._near_len = 0  # the window is being refilled: nothing in it is valid until it is
        self.pread_into(offset, self._near[:n])
        self._near_start, self._near_len = offset, n
        return self._near[:nbytes]

    def read_spans(self, offsets: list[int], nbytes: int) -> list[bytes]:
        """The `nbytes` bytes at each offset (a run of small tensors): one read of the range they
        lie in where it is not much larger than they are, else ``read_near`` each."""
        if not offsets:
            return []
        lo, hi = min(offsets), max(offsets) + nbytes
        if self.wants_read_ahead or hi - lo > max(NEAR_WINDOW, 4 * nbytes * len(offsets)):
            return [bytes(self.read_near(offset, nbytes)) for offset in offsets]
        block = self.pread(lo, hi - lo)
        return [block[start:start + nbytes] for start in (offset - lo for offset in offsets)]

    def pread(self, offset: int, nbytes: int) -> bytes:
        buf = bytearray(nbytes)
        self.pread_into(offset, memoryview(buf))
        return bytes(buf)

    def read_logical(self, entry: TensorEntry, offset: int, view: memoryview) -> None:
        """Read bytes [offset, offset+len(view)) of a tensor's content, across its pieces."""
        need = len(view)
        if need == 0:
            return
        i = bisect.bisect_right(entry.starts, offset) - 1
        done = 0
        while done < need:
            if i >= len(entry.pieces):
                raise self._error(f"parameter {entry.name!r}: read past the end of its data")
            file_off, length = entry.pieces[i]
            within = offset + done - entry.starts[i]
            take = min(length - within, need - done)
            self.pread_into(file_off + within, view[done : done + take])
            done += take
            i += 1

    def iter_content(self, name: str, block: int = 8 * 1024 * 1024):
        """Yield a tensor's raw bytes in blocks (for hashing or copying without holding it all)."""
        return self.iter_entry(self.entries[name], block)

    def iter_entry(self, entry: TensorEntry, block: int = 8 * 1024 * 1024):
        """Like iter_content; the yielded views share one buffer, valid until the next one."""
        mv = memoryview(_BLOCKS.get(min(block, max(entry.stored_bytes, 1))))
        pos = 0
        total = entry.stored_bytes
        while pos < total:
            n = min(len(mv), total - pos)
            self.read_logical(entry, pos, mv[:n])
            yield mv[:n]
            pos += n

    def read_raw(self, name: str | TensorEntry) -> bytes:
        entry = name if isinstance(name, TensorEntry) else self.entries[name]
        buf = bytearray(entry.stored_bytes)
        self.read_logical(entry, 0, memoryview(buf))
        return bytes(buf)

    # --- entries that are not arrays -----------------------------------------------------------
    def read_str(self, name: str) -> str:
        raise self._error(f"parameter {name!r} is not a str entry")

    def iter_str_bytes(self, name: str, block: int):
        """A str entry's UTF-32LE bytes a block at a time, checked as ``read_str`` checks them (a
        string of hundreds of MB is not held); views valid until the next one."""
        entry = self.entries[name]
        if entry.kind != KIND_STR:
            raise self._error(f"parameter {name!r} is not a str entry")
        decoder = codecs.getincrementaldecoder("utf-32-le")()
        try:
            for view in self.iter_entry(entry, block):
                decoder.decode(view)
                yield view
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise self._error(f"parameter {name!r}: str content is not valid UTF-32") from None

    def map_records(self, name: str) -> list:
        raise self._error(f"parameter {name!r} is not a map tensor")

    # --- typed reads --------------------------------------------------------------------------
    def _storage(self, entry: TensorEntry) -> np.dtype:
        dt = dtypes.BY_NAME.get(entry.dtype)
        if dt is None or dt.storage is None:
            raise LayoutError(
                f"{self.path}: parameter {entry.name!r} has dtype {entry.dtype}, which cannot be read as an array"
            )
        return dt.storage

    def read(self, name: str) -> np.ndarray:
        """The whole tensor as a numpy array of its storage dtype (BFloat16 as uint16 words)."""
        entry = self.entries[name]
        return self.read_box(name, full_box(entry.shape))

    def read_box(self, name: str, box: Box, out: np.ndarray | None = None) -> np.ndarray:
        """Read one box of a tensor, touching only the bytes it needs (plus short-run spans)."""
        return self.read_entry_box(self.entries[name], box, out)

    def read_entry_box(self, entry: TensorEntry, box: Box, out: np.ndarray | None = None) -> np.ndarray:
        """``read_box`` for an entry already looked up (callers reading many boxes of one tensor)."""
        name = entry.name
        storage = self._storage(entry)
        shape = entry.shape
        box = tuple((int(a), int(b)) for a, b in box)
        if len(box) != len(shape) or any(not (0 <= a <= b <= n) for (a, b), n in zip(box, shape)):
            raise LayoutError(f"{self.path}: box {list(box)} is outside parameter {name!r} of shape {list(shape)}")
        want = box_shape(box)
        if out is None:
            out = np.empty(want, dtype=storage)
        elif out.shape != want or out.dtype != storage or not out.flags.c_contiguous:
            raise ValueError(f"output buffer must be C-contiguous {storage} of shape {want}")
        if out.size == 0:
            return out
        flat = memoryview(out.reshape(-1).view(np.uint8))
        itemsize = storage.itemsize
        nd = len(shape)
        # j: the innermost dimension the box does not cover whole; dims after it are full.
        j = nd - 1
        while j >= 0 and box[j] == (0, shape[j]):
            j -= 1
        if j < 0:
            self.read_logical(entry, 0, flat)
            return out
        strides = [prod(shape[d + 1 :]) * itemsize for d in range(nd)]
        run = (box[j][1] - box[j][0]) * strides[j]
        row_full = shape[j] * strides[j]  # bytes of one whole index of dim j-1
        if run >= MIN_DIRECT_RUN or j == 0 or row_full > SPAN_BUFFER:
            self._read_runs(entry, box, j, strides, run, flat)
        else:
            self._read_spans(entry, box, j, strides, out)
        return out

    def _read_runs(self, entry, box, j, strides, run, flat) -> None:
        base = box[j][0] * strides[j]
        pos = 0
        for idx in itertools.product(*(range(a, b) for a, b in box[:j])):
            off = base + sum(i * s for i, s in zip(idx, strides))
            self.read_logical(entry, off, flat[pos : pos + run])
            pos += run

    def _read_spans(self, entry, box, j, strides, out) -> None:
        """Short runs: read whole index ranges of dim j-1 at once and cut the box out in memory."""
        shape = entry.shape
        storage = out.dtype
        span_dim = j - 1
        per_index = strides[span_dim]  # bytes of one index of span_dim (covers dims >= j whole)
        batch = max(1, SPAN_BUFFER // per_index)
        buf = _SPANS.get(batch * per_index)
        inner_shape = shape[j:]
        sel_inner = tuple(slice(a, b) for a, b in box[j:])
        a0, b0 = box[span_dim]
        for outer in itertools.product(*(range(a, b) for a, b in box[:span_dim])):
            off0 = sum(i * s for i, s in zip(outer, strides))
            out_sub = out[tuple(i - box[d][0] for d, i in enumerate(outer))]
            for lo in range(a0, b0, batch):
                hi = min(b0, lo + batch)
                nbytes = (hi - lo) * per_index
                self.read_logical(entry, off0 + lo * per_index, memoryview(buf)[:nbytes])
                block = buf[:nbytes].view(storage).reshape((hi - lo,) + tuple(inner_shape))
                out_sub[lo - a0 : hi - a0] = block[(slice(None),) + sel_inner]
