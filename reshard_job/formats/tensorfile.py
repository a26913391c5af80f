"""Positioned reads of tensor boxes from an indexed file, shared by the `.ckpt` and safetensors readers.

Why positioned reads (``os.preadv`` into the caller's buffer) and not a memory map: pages of a
mapped file count towards the process's resident set, so mapping a 100 GB checkpoint and touching
most of it looks, to a batch scheduler, like a 100 GB process. Reading a box straight into its
destination buffer keeps the resident set at the size of the buffers in flight, and costs no extra
copy in the common case where the box is one contiguous byte range.
"""

from __future__ import annotations

import bisect
import itertools
import os
import stat
from dataclasses import dataclass, field
from math import prod

import numpy as np

from ..errors import FormatError, LayoutError
from . import dtypes
from .boxes import Box, box_shape, full_box

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
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return self.get(n).view(dtype).reshape(shape)


_SPANS = Scratch()
_BLOCKS = Scratch()


@dataclass
class TensorEntry:
    """Where one tensor's bytes lie in a file: contiguous pieces in logical (C) order."""

    name: str
    dtype: str  # MindSpore tensor_type name ("Float16", "BFloat16", "str", ...)
    shape: tuple[int, ...]
    nbytes: int
    # (file offset, length) of each piece, in order; their concatenation is the tensor's bytes
    pieces: list[tuple[int, int]] = field(default_factory=list)
    # logical start of each piece, for bisecting; filled by finish()
    starts: list[int] = field(default_factory=list, repr=False)
    extra: dict = field(default_factory=dict, repr=False)  # format-specific details

    def finish(self) -> "TensorEntry":
        pos = 0
        self.starts = []
        for _, length in self.pieces:
            self.starts.append(pos)
            pos += length
        return self

    @property
    def stored_bytes(self) -> int:
        return sum(length for _, length in self.pieces)


class PositionedReader:
    """Base for readers that index a file once and then serve tensors and boxes by offset."""

    path: str

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._fd: int | None = None
        self.entries: dict[str, TensorEntry] = {}

    # --- file handle -------------------------------------------------------------------------
    def _open(self) -> int:
        try:
            # O_RDONLY: sources are never opened for writing.
            self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise self._error("file not found") from None
        except IsADirectoryError:
            raise self._error("is a directory, expected a file") from None
        except PermissionError:
            raise self._error("permission denied") from None
        if stat.S_ISDIR(os.fstat(self._fd).st_mode):  # Linux opens directories read-only without complaint
            self.close()
            raise self._error("is a directory, expected a file")
        return self._fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

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

    # --- raw reads ----------------------------------------------------------------------------
    def pread_into(self, offset: int, view: memoryview) -> None:
        """Fill `view` from the file at `offset`; a short file is a format error."""
        if self._fd is None:
            self._open()
        done = 0
        total = len(view)
        while done < total:
            n = os.preadv(self._fd, [view[done:]], offset + done)
            if n <= 0:
                raise self._error(f"unexpected end of file at byte {offset + done} (file truncated?)")
            done += n

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
        entry = self.entries[name]
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
