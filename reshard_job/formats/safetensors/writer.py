"""Writing safetensors files: declare every tensor, then stream each one in file order (see the
package docstring for the layout rules and how ``crc_num`` gets into a header that precedes the data)."""

from __future__ import annotations

import hashlib
import operator
import os
import zlib
from math import prod
from typing import Sequence

import numpy as np

from reshard_job.errors import LayoutError
from reshard_job.text import listed
import reshard_job.core.dtypes as dtypes
from reshard_job.formats.base import TensorDecl, WrittenFile
from reshard_job.formats.crc32 import chain_crc, hashed_as_count, scalar_crc_part
from reshard_job.formats.safetensors.header import (CRC_KEY, CRC_WIDTH, DTYPE_RANK, INT4_MARK, MAX_HEADER_BYTES,
                                                    METADATA_KEY, DeclaredTensor, header_json, header_metadata,
                                                    resolve_dtype)


class TensorSink:
    """Accepts one tensor's bytes in order, in pieces of any size."""

    def __init__(self, writer: "SafetensorsWriter", decl: DeclaredTensor):
        self._w = writer
        self.name = decl.name
        self.total = decl.nbytes
        self.written = 0
        self._hash = hashlib.sha256()
        # the fingerprint tap (``SafetensorsWriter.fingerprint_tap``) sees what the digest sees
        tap = writer.fingerprint_tap
        self._feed = tap.feed(decl.name) if tap is not None else None
        self._crc = 0
        # a 0-d integer enters crc_num by its value (formats.crc32): keep its few bytes
        self._scalar = bytearray() if hashed_as_count(decl.code, decl.shape) else None

    def write(self, data) -> None:
        if self._w._open_sink is not self:
            # bytes written now would land in another tensor's place
            raise RuntimeError(f"parameter {self.name!r}: this sink is closed")
        mv = _byte_view(data, self.name)
        if self.written + len(mv) > self.total:
            raise ValueError(f"parameter {self.name!r}: more bytes than its shape and dtype hold ({self.total})")
        self._hash.update(mv)
        if self._feed is not None:
            self._feed.update(mv)
        if self._w._track_crc:
            self._crc = zlib.crc32(mv, self._crc)
            if self._scalar is not None:
                self._scalar += mv
        self._w._file.write(mv)
        self.written += len(mv)

    def close(self) -> str:
        if self._w._open_sink is not self:
            raise RuntimeError(f"parameter {self.name!r}: this sink is closed")
        if self.written != self.total:
            raise ValueError(f"parameter {self.name!r}: got {self.written} of {self.total} bytes")
        digest = self._hash.hexdigest()
        self._w._tensor_done(self.name, digest, self._crc, self._scalar)
        return digest


class SafetensorsWriter:
    """Write a safetensors file: ``declare`` every tensor, then stream each one in ``data_order()``.

    ``metadata``: extra ``__metadata__`` entries (str -> str). ``mindspore=True`` adds
    ``"format": "ms"`` as MindSpore does (when there is at least one tensor; an explicit ``format``
    in ``metadata`` wins) and an ``"Int4"`` marker for each Int4 tensor. ``crc``: False, True
    (compute ``crc_num``) or an int (the known ``crc_num``, checked on commit); see the module
    docstring for how the CRC gets into a header that precedes the data. With no tensors, neither
    ``format`` nor ``crc_num`` is added (MindSpore saves an empty dict without metadata).

    Used as a context manager it commits on success and removes the temporary file on error.
    """

    # ``execute.writer_tap.WriterTap`` (or None): tensors it expects are fed to it as they are hashed
    fingerprint_tap = None

    def __init__(
        self,
        target,
        *,
        metadata: dict[str, str] | None = None,
        mindspore: bool = True,
        crc: bool | int = False,
        mode: int = 0o444,
        storage=None,  # StorageOptions reaching the object store of a URL `target`
    ):
        if metadata is not None:
            if not isinstance(metadata, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
            ):
                raise ValueError("metadata must be a dict of str to str")
            for k, v in metadata.items():
                _check_utf8(k, "metadata key")
                _check_utf8(v, f"metadata value of {k!r}")
            if CRC_KEY in metadata:
                # a copied crc_num would not match the new content (MindSpore's unified_safetensors
                # writes such stale values); the writer computes it or leaves it out
                raise ValueError(f"metadata key {CRC_KEY!r} is set by the writer: pass crc=True instead")
        if crc is not True and crc is not False:
            if not isinstance(crc, int) or not 0 <= crc <= 0xFFFFFFFF:
                raise ValueError(f"crc must be True, False or a CRC32 value, not {crc!r}")
        self.user_metadata = None if metadata is None else dict(metadata)
        self.mindspore = mindspore
        self.crc = crc
        self._decls: dict[str, DeclaredTensor] = {}
        self._pending: dict[str, tuple[bytes | memoryview, str]] = {}  # added before the header
        self._order: list[str] | None = None  # set when the header is written
        self._next = 0
        self._open_sink: TensorSink | None = None
        self._crcs: dict[str, tuple[int, int]] = {}
        self._track_crc = crc is not False
        self._reserved: int | None = None  # header length reserved for a CRC not yet known
        self.tensors: dict[str, str] = {}
        self.header_len: int | None = None
        if isinstance(target, (str, os.PathLike)):
            from reshard_job.storage import absolute, storage_for

            path = absolute(target)
            # A CRC known only at the end is patched into the header afterwards, which needs a
            # buffered local file (O_DIRECT writes and uploads cannot go back).
            target = storage_for(path, storage).create(path, mode=mode, large=crc is not True)
        self._file = target
        self.path = target.path

    # --- declaring ------------------------------------------------------------------------------
    def arrange(self, tensors: Sequence[TensorDecl]) -> list[str]:
        """Declare every tensor (the header comes first); return them in file order."""
        for t in tensors:
            if t.kind != "tensor":
                raise LayoutError(f"parameter {t.name!r}: {t.kind} entries cannot be stored in safetensors; use ckpt")
            self.declare(t.name, t.dtype, t.dims)
        return self.data_order()

    def declare(self, name: str, dtype: str, shape) -> int:
        """Announce a tensor (any order); returns its byte count. All must come before the first ``begin``."""
        if self._order is not None:
            raise RuntimeError(
                f"parameter {name!r}: cannot declare after data writing started; declare every tensor first"
            )
        if not isinstance(name, str):
            raise ValueError(f"tensor names must be str, not {type(name).__name__}")
        if name == METADATA_KEY:
            raise ValueError(f"{METADATA_KEY!r} is reserved by the format and cannot name a tensor")
        _check_utf8(name, "tensor name")
        ms_name, code, itemsize = resolve_dtype(name, dtype)
        try:
            shape = tuple(operator.index(d) for d in shape)  # ints only: 2.5 is not a dimension
        except TypeError:
            raise LayoutError(f"parameter {name!r}: shape {shape!r} is not a sequence of integers") from None
        if any(d < 0 for d in shape):
            raise LayoutError(f"parameter {name!r}: negative dimension in shape {list(shape)}")
        decl = DeclaredTensor(name, ms_name, code, shape, prod(shape) * itemsize)
        old = self._decls.get(name)
        if old is not None:
            if (old.dtype, old.shape) != (decl.dtype, decl.shape):
                raise ValueError(
                    f"parameter {name!r} declared twice, as {old.dtype} {list(old.shape)} "
                    f"and as {decl.dtype} {list(decl.shape)}"
                )
            return old.nbytes
        self._decls[name] = decl
        return decl.nbytes

    def data_order(self) -> list[str]:
        """Declared names in file order (descending dtype alignment, then name), as the library lays them out."""
        if self._order is not None:
            return list(self._order)
        return sorted(self._decls, key=lambda n: (-DTYPE_RANK[self._decls[n].code], n))

    # --- header ---------------------------------------------------------------------------------
    def _header(self, order: list[str], crc_text: str | None) -> bytes:
        meta = header_metadata(self.user_metadata, self._decls, mindspore=self.mindspore, crc_text=crc_text)
        return header_json(meta, self._decls, order)

    def _start_data(self) -> None:
        """Fix the layout and write the length prefix and header; from here on only data follows."""
        order = self.data_order()
        if self.crc is False or not self._decls:
            header = self._header(order, None)
            crc_mode = "none"
        elif self.crc is not True:
            header = self._header(order, str(self.crc))
            crc_mode = "given"
        elif len(self._pending) == len(self._decls):
            # everything is in memory: the CRC can be computed before the header is written
            for name, (data, _) in self._pending.items():
                self._crcs[name] = self._crc_part(name, zlib.crc32(data), data)
            header = self._header(order, str(chain_crc(self._crcs)))
            self._crcs.clear()  # recomputed while the data is written, like any other tensor
            crc_mode = "exact"
        else:
            # the widest CRC; the real one is written over this header on commit
            if not self._file.can_rewrite:
                raise LayoutError(f"{self.path}: crc_num of streamed tensors needs an output that can be rewritten "
                                  "(a local file): write without crc, or to a local directory")
            header = self._header(order, "9" * CRC_WIDTH)
            crc_mode = "deferred"
        header += b" " * (-len(header) % 8)
        if len(header) > MAX_HEADER_BYTES:
            raise LayoutError(
                f"{self.path}: header of {len(header)} bytes exceeds the {MAX_HEADER_BYTES}-byte limit readers enforce"
            )
        self._crc_mode = crc_mode
        self._order = order
        self.header_len = len(header)
        if crc_mode == "deferred":
            self._reserved = len(header)
        self._file.write(len(header).to_bytes(8, "little"))
        self._file.write(header)

    # --- tensors --------------------------------------------------------------------------------
    def _crc_part(self, name: str, crc: int, data) -> tuple[int, int]:
        """(crc32, length) of what MindSpore's crc_num hashes for this tensor: its bytes, or the
        value of a 0-d integer as a count of zero bytes (formats.crc32)."""
        decl = self._decls[name]
        if not hashed_as_count(decl.code, decl.shape):
            return crc, decl.nbytes
        try:
            return scalar_crc_part(decl.code, bytes(data))
        except ValueError as e:
            raise LayoutError(f"{self.path}: parameter {name!r}: cannot write {CRC_KEY}: {e}; "
                              f"write without crc") from None

    def _tensor_done(self, name: str, digest: str, crc: int, scalar) -> None:
        self.tensors[name] = digest
        if self._track_crc:
            self._crcs[name] = self._crc_part(name, crc, scalar)
        self._open_sink = None
        self._next += 1

    def _advance_to(self, name: str | None) -> None:
        """Write buffered tensors that precede `name` in file order (all of them for None)."""
        while self._next < len(self._order):
            nxt = self._order[self._next]
            if nxt == name:
                return
            if nxt not in self._pending:
                if name is None:
                    return
                raise RuntimeError(
                    f"parameter {name!r} cannot be written yet: tensors are stored in data_order() "
                    f"and {nxt!r} comes before it"
                )
            data, digest = self._pending.pop(nxt)
            sink = self._open_sink = TensorSink(self, self._decls[nxt])
            sink.write(data)
            sink.close()

    def begin(self, name: str, dtype: str | None = None, dims=None) -> TensorSink:
        """Start writing a declared tensor; pass its bytes to the sink's ``write``, then ``close``.

        `dtype` and `dims` are optional (the declaration has them); when given, as by callers that
        drive `.ckpt` and safetensors writers alike, they must match the declaration.
        """
        if self._open_sink is not None:
            raise RuntimeError(f"parameter {self._open_sink.name!r} is still being written")
        if name not in self._decls:
            raise RuntimeError(f"parameter {name!r} was not declared")
        decl = self._decls[name]
        if dtype is not None and dtype not in (decl.dtype, decl.code):
            raise RuntimeError(f"parameter {name!r} was declared {decl.dtype}, not {dtype}")
        if dims is not None and tuple(int(d) for d in dims) != decl.shape:
            raise RuntimeError(f"parameter {name!r} was declared with shape {list(decl.shape)}, not {list(dims)}")
        if name in self.tensors or name in self._pending:
            raise RuntimeError(f"parameter {name!r} was already written")
        if self._order is None:
            self._start_data()
        self._advance_to(name)
        self._open_sink = TensorSink(self, self._decls[name])
        return self._open_sink

    def add(self, name: str, array: np.ndarray, dtype: str | None = None) -> str:
        """Declare and write a whole tensor from a numpy array (dtype from the array; uint16 stays UInt16).

        Before data writing started the array is copied and written on its turn; afterwards it
        must be a declared tensor and is written at once (so it must be next in ``data_order()``).
        Returns the tensor's sha256.
        """
        array = np.asarray(array)
        if dtype is None:
            try:
                dtype = dtypes.from_numpy(array.dtype).name
            except KeyError:
                raise LayoutError(f"parameter {name!r}: numpy dtype {array.dtype} has no safetensors dtype") from None
        ms_name, _, itemsize = resolve_dtype(name, dtype)
        if ms_name != INT4_MARK and array.dtype.itemsize != itemsize:
            raise ValueError(f"parameter {name!r}: array of {array.dtype} cannot hold {ms_name}")
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        if ms_name == INT4_MARK and data.nbytes != prod(array.shape):
            raise ValueError(f"parameter {name!r}: Int4 data must be given as one byte per element of its shape")
        return self.add_bytes(name, ms_name, array.shape, data)

    def add_bytes(self, name: str, dtype: str, shape, data) -> str:
        """Like ``add``, from raw bytes in C order."""
        if self._order is None:
            nbytes = self.declare(name, dtype, shape)
            if name in self._pending:
                raise RuntimeError(f"parameter {name!r} was already added")
            mv = memoryview(bytes(_byte_view(data, name)))  # our own copy: the caller may reuse its buffer
            if len(mv) != nbytes:
                raise ValueError(f"parameter {name!r}: got {len(mv)} bytes, shape and dtype need {nbytes}")
            digest = hashlib.sha256(mv).hexdigest()
            self._pending[name] = (mv, digest)
            return digest
        d = self._decls.get(name)
        if d is None:
            raise RuntimeError(f"parameter {name!r}: cannot add an undeclared tensor after data writing started")
        if (d.dtype, d.shape) != (resolve_dtype(name, dtype)[0], tuple(operator.index(x) for x in shape)):
            raise ValueError(f"parameter {name!r} was declared as {d.dtype} {list(d.shape)}")
        sink = self.begin(name)
        sink.write(data)
        return sink.close()

    # --- finishing ------------------------------------------------------------------------------
    def commit(self) -> WrittenFile:
        if self._open_sink is not None:
            raise RuntimeError(f"parameter {self._open_sink.name!r} was not finished")
        if self._order is None:
            self._start_data()
        self._advance_to(None)
        missing = [n for n in self._order if n not in self.tensors]
        if missing:
            raise RuntimeError(f"{self.path}: declared tensors not written: {listed(missing, 5, repr)}")
        if self._crc_mode in ("given", "deferred"):
            crc = chain_crc(self._crcs)
            if self._crc_mode == "given" and crc != self.crc:
                self.abort()
                raise ValueError(f"{self.path}: crc={self.crc} was given, but the data written give {crc}")
            if self._crc_mode == "deferred":
                self._rewrite_header(crc)
        size, digest = self._file.commit()  # re-hashes a file whose header was rewritten
        return WrittenFile(self.path, size, digest, dict(self.tensors))

    def _rewrite_header(self, crc: int) -> None:
        """Put the real CRC into the reserved header."""
        header = self._header(self._order, str(crc))
        header += b" " * (self._reserved - len(header))  # same length: the data does not move
        self._file.rewrite_at(8, header)

    def abort(self) -> None:
        self._file.abort()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            try:
                self.result = self.commit()
            except BaseException:
                self.abort()  # a failed commit (unwritten tensor, CRC mismatch) leaves no temp file
                raise
        else:
            self.abort()
        return False


def _byte_view(data, name: str) -> memoryview:
    """A flat byte view of a numpy array or any buffer, without copying when it is contiguous."""
    if isinstance(data, np.ndarray):
        if data.dtype.byteorder == ">":
            raise ValueError(f"parameter {name!r}: data must be little-endian (safetensors stores little-endian)")
        if not data.flags.c_contiguous:
            raise ValueError(f"parameter {name!r}: data must be C-contiguous")
        # through numpy: memoryview.cast refuses formats such as complex 'Zf'
        return memoryview(data.reshape(-1).view(np.uint8))
    mv = memoryview(data)
    if not mv.c_contiguous:
        raise ValueError(f"parameter {name!r}: data must be C-contiguous")
    if mv.format == "B" and mv.ndim == 1:
        return mv
    try:
        return mv.cast("B")
    except TypeError:  # a non-native struct format: copy its bytes
        return memoryview(mv.tobytes())


def _check_utf8(s: str, what: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} {s!r} cannot be encoded as UTF-8") from None


def save_file(
    path: str | os.PathLike,
    tensors: dict[str, np.ndarray],
    *,
    metadata: dict[str, str] | None = None,
    mindspore: bool = True,
    crc: bool = False,
    dtype_overrides: dict[str, str] | None = None,
    mode: int = 0o444,
) -> WrittenFile:
    """Write small in-memory tensors in one go (``dtype_overrides`` maps names to e.g. "BFloat16" for uint16 words)."""
    overrides = dtype_overrides or {}
    with SafetensorsWriter(path, metadata=metadata, mindspore=mindspore, crc=crc, mode=mode) as w:
        for name, array in tensors.items():
            w.add(name, array, overrides.get(name))
    return w.result
