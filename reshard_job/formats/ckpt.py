"""MindSpore `.ckpt` files: a record-by-record index for reading, and a streaming writer.

A `.ckpt` file is a sequence of protobuf records, each one ``Checkpoint`` message holding one
``Value`` (``tag`` + ``TensorProto``), optionally followed by a 17-byte CRC32 trailer. A tensor larger
than 512 MiB is spread over several consecutive records with the same tag, each repeating the full
dims. The reader walks the records once, noting where each tensor's bytes lie, and then serves
tensors or boxes of them with positioned reads: nothing is loaded that is not asked for, and files
over 2 GiB need no special protobuf backend. The writer encodes the same records byte for byte as
MindSpore's ``save_checkpoint`` does, streaming tensor bytes from the caller's buffers, hashing
the file as it goes, and renaming a temporary file into place only when everything is on disk.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import zlib
from dataclasses import dataclass
from math import prod
from typing import Iterable

import numpy as np

from ..errors import CheckpointFormatError, LayoutError
from . import dtypes, wire
from ..storage.atomic import AtomicFile
from .tensorfile import PositionedReader, TensorEntry

SLICE_BYTES = 512 * 1024 * 1024  # MindSpore's SLICE_SIZE (512 * 1024 KiB)
CRC_MAGIC = b"crc_num"
CRC_TRAILER_LEN = 17

KIND_TENSOR = "tensor"
KIND_STR = "str"
KIND_MAP = "map"


@dataclass(frozen=True)
class Record:
    """One top-level record as found in the file."""

    offset: int  # file offset of the record's 0x0A key byte
    length: int  # total bytes of the record, key and length prefix included
    dims: tuple[int, ...]
    dtype: str
    content_offset: int
    content_len: int


def _parse_tensor_proto(buf, pos: int, end: int) -> tuple[list[int], str | None, int, int]:
    """Parse a TensorProto in buf[pos:end]; return dims, tensor_type, content offset, content length."""
    dims: list[int] = []
    dtype = None
    c_off, c_len = pos, 0
    while pos < end:
        k, pos = wire.decode_varint(buf, pos, end)
        field, wt = k >> 3, k & 7
        if field == 1 and wt == wire.VARINT:
            v, pos = wire.decode_varint(buf, pos, end)
            dims.append(wire.as_signed64(v))
        elif field == 1 and wt == wire.LEN:  # packed dims, tolerated on read
            n, pos = wire.decode_varint(buf, pos, end)
            stop = pos + n
            if stop > end:
                raise wire.WireError("packed dims run past the tensor")
            while pos < stop:
                v, pos = wire.decode_varint(buf, pos, stop)
                dims.append(wire.as_signed64(v))
        elif field == 2 and wt == wire.LEN:
            n, pos = wire.decode_varint(buf, pos, end)
            if pos + n > end:
                raise wire.WireError("tensor_type runs past the tensor")
            try:
                dtype = bytes(buf[pos : pos + n]).decode("ascii")
            except UnicodeDecodeError:
                raise wire.WireError("tensor_type is not ASCII") from None
            pos += n
        elif field == 3 and wt == wire.LEN:
            n, pos = wire.decode_varint(buf, pos, end)
            if pos + n > end:
                raise wire.WireError("tensor_content runs past the tensor")
            c_off, c_len = pos, n
            pos += n
        else:
            pos = wire.skip_field(buf, pos, end, wt)
    return dims, dtype, c_off, c_len


class CheckpointReader(PositionedReader):
    """Index of a `.ckpt` file; serves tensors and boxes of tensors by positioned reads.

    ``entries`` maps each parameter name to its TensorEntry, in file order. Consecutive records with
    one tag are one tensor (their contents concatenated, dims and dtype of the last record), as in
    MindSpore's loader; a tag that appears again later replaces the earlier tensor, as there.
    ``groups`` keeps every group in file order (needed to rewrite a file exactly).
    """

    def __init__(self, path: str | os.PathLike, *, verify_crc: bool = True):
        super().__init__(path)
        self.groups: list[TensorEntry] = []
        self.crc_stored: int | None = None
        self.size = 0
        fd = self._open()
        try:
            self.size = os.fstat(fd).st_size
            self._index()
        except BaseException:
            self.close()
            raise
        if verify_crc and self.crc_stored is not None:
            self.verify_crc()

    def _error(self, problem: str) -> CheckpointFormatError:
        return CheckpointFormatError(self.path, problem)

    @property
    def has_crc(self) -> bool:
        return self.crc_stored is not None

    # --- indexing -----------------------------------------------------------------------------
    def _index(self) -> None:
        if self.size == 0:
            raise self._error("empty file (0 bytes), expected MindSpore checkpoint records")
        # The map is only used to parse record headers; it is closed before any tensor is read,
        # so the pages it touched do not stay charged to this process. MADV_RANDOM stops the kernel
        # from mapping (and charging) 64 KiB around every header it touches.
        with mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ) as mm:
            if hasattr(mm, "madvise") and hasattr(mmap, "MADV_RANDOM"):
                mm.madvise(mmap.MADV_RANDOM)
            records = self._walk(mm)
        self._group(records)

    def _walk(self, mm) -> list[tuple[str, str, Record, list]]:
        size = self.size
        pos = 0
        out = []
        while pos < size:
            if size - pos == CRC_TRAILER_LEN and mm[pos : pos + 7] == CRC_MAGIC and out:
                self.crc_stored = int.from_bytes(mm[pos + 7 : pos + 17], "big")
                break
            start = pos
            if mm[pos] != 0x0A:
                what = "wrong magic: not a MindSpore checkpoint" if pos == 0 else "corrupt record"
                raise self._error(f"{what} (byte 0x{mm[pos]:02x} at offset {pos}, expected 0x0a)")
            try:
                vlen, pos = wire.decode_varint(mm, pos + 1, size)
            except wire.WireError as e:
                raise self._error(f"record at offset {start}: {e} (file truncated?)") from None
            vend = pos + vlen
            if vend > size:
                raise self._error(
                    f"record at offset {start} needs {vlen} bytes but the file ends after {size - pos} "
                    "(file truncated?)"
                )
            try:
                out.append(self._parse_value(mm, start, pos, vend))
            except wire.WireError as e:
                raise self._error(f"record at offset {start}: {e}") from None
            pos = vend
        return out

    def _parse_value(self, mm, start: int, pos: int, end: int):
        tag = None
        tensor = None
        map_parts: list[Record] = []
        while pos < end:
            k, pos = wire.decode_varint(mm, pos, end)
            field, wt = k >> 3, k & 7
            if wt == wire.LEN:
                n, pos = wire.decode_varint(mm, pos, end)
                if pos + n > end:
                    raise wire.WireError(f"field {field} runs past the record")
                if field == 1:
                    try:
                        tag = bytes(mm[pos : pos + n]).decode("utf-8")
                    except UnicodeDecodeError:
                        raise wire.WireError("parameter name is not valid UTF-8") from None
                elif field == 2:
                    dims, dt, c_off, c_len = _parse_tensor_proto(mm, pos, pos + n)
                    tensor = Record(start, end - start, tuple(dims), dt or "", c_off, c_len)
                elif field == 3:
                    map_parts.extend(self._parse_map(mm, start, end, pos, pos + n))
                pos += n
            else:
                pos = wire.skip_field(mm, pos, end, wt)
        if tag is None:
            raise wire.WireError("record without a parameter name")
        if tensor is not None:
            kind = KIND_STR if tensor.dtype == dtypes.STR_TYPE else KIND_TENSOR
            return tag, kind, tensor, []
        return tag, KIND_MAP, None, map_parts

    def _parse_map(self, mm, start, rec_end, pos, end) -> list[Record]:
        parts = []
        while pos < end:
            k, pos = wire.decode_varint(mm, pos, end)
            field, wt = k >> 3, k & 7
            if field == 1 and wt == wire.LEN:
                n, pos = wire.decode_varint(mm, pos, end)
                if pos + n > end:
                    raise wire.WireError("map tensor part runs past the record")
                dims, dt, c_off, c_len = _parse_tensor_proto(mm, pos, pos + n)
                parts.append(Record(start, rec_end - start, tuple(dims), dt or "", c_off, c_len))
                pos += n
            else:
                pos = wire.skip_field(mm, pos, end, wt)
        return parts

    def _group(self, records) -> None:
        i = 0
        while i < len(records):
            tag, kind = records[i][0], records[i][1]
            j = i
            while j + 1 < len(records) and records[j + 1][0] == tag:
                j += 1
            group = records[i : j + 1]
            if any((g[1] == KIND_MAP) != (kind == KIND_MAP) for g in group):
                raise self._error(f"parameter {tag!r}: consecutive records mix tensor and map-tensor values")
            if kind == KIND_MAP:
                entry = self._map_entry(tag, group)
            else:
                entry = self._tensor_entry(tag, [g[2] for g in group])
            self.groups.append(entry)
            self.entries.pop(tag, None)  # a later group replaces an earlier one, at the end
            self.entries[tag] = entry
            i = j + 1

    def _tensor_entry(self, tag: str, recs: list[Record]) -> TensorEntry:
        last = recs[-1]
        stored = sum(r.content_len for r in recs)
        pieces = [(r.content_offset, r.content_len) for r in recs]
        extra = {
            "kind": KIND_TENSOR,
            "dims": last.dims,
            "records": recs,
        }
        if last.dtype == dtypes.STR_TYPE:
            if stored % 4:
                raise self._error(f"parameter {tag!r}: str content of {stored} bytes is not UTF-32")
            extra["kind"] = KIND_STR
            return TensorEntry(tag, dtypes.STR_TYPE, (), stored, pieces, extra=extra).finish()
        if last.dtype not in dtypes.BY_NAME:
            raise self._error(f"parameter {tag!r}: unknown dtype {last.dtype!r}")
        if any(d < 0 for d in last.dims):
            raise self._error(f"parameter {tag!r}: negative dimension in dims {list(last.dims)}")
        dt = dtypes.BY_NAME[last.dtype]
        shape = tuple(last.dims)
        if dt.storage is None:  # packed Int4: carried, not checked element-wise
            return TensorEntry(tag, last.dtype, shape, stored, pieces, extra=extra).finish()
        want = prod(shape) * dt.itemsize
        if shape == (0,) and stored == dt.itemsize:
            shape, want = (), dt.itemsize  # MindSpore reads dims [0] as a scalar
        if stored != want:
            raise self._error(
                f"parameter {tag!r}: {stored} bytes of data but dims {list(last.dims)} of {last.dtype} need {want}"
            )
        return TensorEntry(tag, last.dtype, shape, stored, pieces, extra=extra).finish()

    def _map_entry(self, tag: str, group) -> TensorEntry:
        per_record = [g[3] for g in group]
        if any(len(p) != 3 for p in per_record):
            raise self._error(f"map parameter {tag!r}: expected 3 parts (keys, values, status) per record")
        pieces = [(p.content_offset, p.content_len) for parts in per_record for p in parts]
        extra = {"kind": KIND_MAP, "map_records": per_record}
        return TensorEntry(tag, "map", (), sum(l for _, l in pieces), pieces, extra=extra).finish()

    # --- CRC ------------------------------------------------------------------------------------
    def verify_crc(self) -> None:
        """Check the CRC32 trailer against the records; raise naming the file on mismatch."""
        if self.crc_stored is None:
            return
        computed = crc_of_file(self, self.size - CRC_TRAILER_LEN)
        if computed != self.crc_stored:
            raise self._error(
                f"CRC32 mismatch: trailer says {self.crc_stored}, records give {computed} (file corrupted)"
            )

    # --- typed reads ----------------------------------------------------------------------------
    def kind(self, name: str) -> str:
        return self.entries[name].extra["kind"]

    def read_str(self, name: str) -> str:
        try:
            return self.read_raw(name).decode("utf-32-le")
        except UnicodeDecodeError:
            raise self._error(f"parameter {name!r}: str content is not valid UTF-32") from None

    def read_map(self, name: str) -> list[np.ndarray]:
        """A map tensor as [keys, values, status], concatenated over its records."""
        entry = self.entries[name]
        parts: list[list[np.ndarray]] = [[], [], []]
        for rec in entry.extra["map_records"]:
            for i, p in enumerate(rec):
                try:
                    dt = np.dtype(p.dtype)
                except (TypeError, ValueError, SyntaxError):  # numpy parses odd strings as struct specs
                    raise self._error(f"map parameter {name!r}: unknown part dtype {p.dtype!r}") from None
                raw = self.pread(p.content_offset, p.content_len)
                try:
                    parts[i].append(np.frombuffer(raw, dtype=dt).reshape(p.dims))
                except ValueError:
                    raise self._error(
                        f"map parameter {name!r}: {len(raw)} bytes of {p.dtype} do not fit dims {list(p.dims)}"
                    ) from None
        try:
            return [np.concatenate(ps) if ps else np.empty(0) for ps in parts]
        except ValueError:
            raise self._error(f"map parameter {name!r}: its records' parts have inconsistent shapes") from None

    def value(self, name: str):
        """A parameter as MindSpore's loader would hand it out: array, str, or map parts."""
        kind = self.kind(name)
        if kind == KIND_STR:
            return self.read_str(name)
        if kind == KIND_MAP:
            return self.read_map(name)
        return self.read(name)


def crc_of_file(reader: CheckpointReader, length: int) -> int:
    crc = 0
    buf = bytearray(8 * 1024 * 1024)
    mv = memoryview(buf)
    pos = 0
    while pos < length:
        n = min(len(buf), length - pos)
        reader.pread_into(pos, mv[:n])
        crc = zlib.crc32(mv[:n], crc)
        pos += n
    return crc


# ======================================================================================== writer


def _tensor_header(dims: Iterable[int], dtype: str, content_len: int) -> bytes:
    """TensorProto bytes up to (and including) the tensor_content length prefix."""
    out = bytearray()
    for d in dims:
        out += b"\x08" + wire.encode_varint(int(d))
    t = dtype.encode("ascii")
    out += wire.len_field(2, len(t)) + t
    out += wire.len_field(3, content_len)
    return bytes(out)


def record_header(name: str, dims: Iterable[int], dtype: str, content_len: int) -> bytes:
    """Everything of a one-tensor record that precedes its tensor_content bytes."""
    tag = name.encode("utf-8")
    tensor_head = _tensor_header(dims, dtype, content_len)
    tensor_len = len(tensor_head) + content_len
    value = wire.len_field(1, len(tag)) + tag + wire.len_field(2, tensor_len) + tensor_head
    value_len = len(value) + content_len
    return wire.len_field(1, value_len) + value


def _map_record(name: str, parts: list[tuple[tuple[int, ...], str, bytes]]) -> bytes:
    tag = name.encode("utf-8")
    body = bytearray()
    for dims, dt, content in parts:
        tp = _tensor_header(dims, dt, len(content)) + content
        body += wire.len_field(1, len(tp)) + tp
    value = wire.len_field(1, len(tag)) + tag + wire.len_field(3, len(body)) + bytes(body)
    return wire.len_field(1, len(value)) + value


def default_chunks(nbytes: int, chunk_bytes: int = SLICE_BYTES) -> list[int]:
    """MindSpore's raw-byte chunking: full 512 MiB pieces and a remainder; one empty piece if empty."""
    if nbytes == 0:
        return [0]
    sizes = [chunk_bytes] * (nbytes // chunk_bytes)
    if nbytes % chunk_bytes:
        sizes.append(nbytes % chunk_bytes)
    return sizes


@dataclass(frozen=True)
class WrittenFile:
    path: str
    size: int
    sha256: str
    tensors: dict[str, str]  # parameter name -> sha256 of its bytes


class TensorSink:
    """Accepts one tensor's bytes in order, in pieces of any size, and frames them into records."""

    def __init__(self, writer: "CheckpointWriter", name: str, dtype: str, dims, chunk_sizes: list[int]):
        self._w = writer
        self.name = name
        self.dtype = dtype
        self.dims = tuple(int(d) for d in dims)
        self._chunks = list(chunk_sizes)
        self._left_in_chunk = 0
        self._hash = hashlib.sha256()
        self.total = sum(self._chunks)
        self.written = 0
        self._next_chunk()

    def _next_chunk(self) -> None:
        while self._chunks and self._left_in_chunk == 0:
            size = self._chunks.pop(0)
            self._w._emit(record_header(self.name, self.dims, self.dtype, size), record=True)
            self._left_in_chunk = size
            if size == 0 and not self._chunks:
                break

    def write(self, data) -> None:
        mv = memoryview(data).cast("B")
        if self.written + len(mv) > self.total:
            raise ValueError(f"parameter {self.name!r}: more bytes than its dims and dtype hold")
        self._hash.update(mv)
        while len(mv):
            take = min(self._left_in_chunk, len(mv))
            self._w._emit(mv[:take], record=True)
            mv = mv[take:]
            self._left_in_chunk -= take
            self.written += take
            if self._left_in_chunk == 0:
                self._next_chunk()

    def close(self) -> str:
        if self.written != self.total:
            raise ValueError(f"parameter {self.name!r}: got {self.written} of {self.total} bytes")
        digest = self._hash.hexdigest()
        self._w._tensor_done(self.name, digest)
        return digest


class CheckpointWriter:
    """Write a `.ckpt` file record by record into a temporary file; ``commit`` renames it into place.

    Used as a context manager it commits on success and removes the temporary file on error, so a
    reader never sees a partial file under the final name.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        crc: bool = False,
        chunk_bytes: int = SLICE_BYTES,
        mode: int = 0o444,
        overwrite: bool = True,
    ):
        self.path = os.fspath(path)
        self.crc = crc
        self.chunk_bytes = chunk_bytes
        self._file = AtomicFile(self.path, mode=mode, overwrite=overwrite, direct=True)
        self._crc = 0
        self._open_sink: TensorSink | None = None
        self.tensors: dict[str, str] = {}

    # --- low level ------------------------------------------------------------------------------
    def _emit(self, data, *, record: bool) -> None:
        self._file.write(data)
        if record and self.crc:
            self._crc = zlib.crc32(data, self._crc)

    def _tensor_done(self, name: str, digest: str) -> None:
        self.tensors[name] = digest
        self._open_sink = None

    # --- tensors --------------------------------------------------------------------------------
    def begin(self, name: str, dtype: str, dims, chunk_sizes: list[int] | None = None) -> TensorSink:
        """Start a tensor whose bytes will be passed to the returned sink's ``write``."""
        if self._open_sink is not None:
            raise RuntimeError(f"parameter {self._open_sink.name!r} is still being written")
        dims = tuple(int(d) for d in dims)
        if dtype == dtypes.STR_TYPE:
            raise ValueError("use add_str for str entries")
        dt = dtypes.BY_NAME.get(dtype)
        if dt is None:
            raise LayoutError(f"parameter {name!r}: unknown dtype {dtype!r}")
        if chunk_sizes is None:
            nbytes = prod(dims) * dt.itemsize
            chunk_sizes = default_chunks(nbytes, self.chunk_bytes)
        self._open_sink = TensorSink(self, name, dtype, dims, chunk_sizes)
        return self._open_sink

    def add(self, name: str, array: np.ndarray, dtype: str | None = None, dims=None) -> str:
        """Write a whole tensor from a numpy array (dtype defaults from the array; uint16 stays UInt16)."""
        array = np.asarray(array)
        if dtype is None:
            dtype = dtypes.from_numpy(array.dtype).name
        dt = dtypes.lookup(dtype)
        if dt.storage is not None and array.dtype.itemsize != dt.itemsize:
            raise ValueError(f"parameter {name!r}: array of {array.dtype} cannot hold {dtype}")
        if dims is None:
            dims = array.shape
        sink = self.begin(name, dtype, dims)
        sink.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
        return sink.close()

    def add_bytes(self, name: str, dtype: str, dims, data: bytes, chunk_sizes: list[int] | None = None) -> str:
        sink = self.begin(name, dtype, dims, chunk_sizes)
        sink.write(data)
        return sink.close()

    def add_str(self, name: str, text: str, dims=(0,)) -> str:
        """A string entry as MindSpore writes append_dict strings: dims [0], UTF-32LE content."""
        content = text.encode("utf-32-le")
        self._emit(record_header(name, dims, dtypes.STR_TYPE, len(content)), record=True)
        self._emit(content, record=True)
        digest = hashlib.sha256(content).hexdigest()
        self.tensors[name] = digest
        return digest

    def add_map(self, name: str, records: list[list[tuple[tuple[int, ...], str, bytes]]]) -> None:
        """Map-tensor records (keys, values, status per record). Not covered by the CRC, as in MindSpore."""
        h = hashlib.sha256()
        for parts in records:
            self._emit(_map_record(name, parts), record=False)
            for _, _, content in parts:
                h.update(content)
        self.tensors[name] = h.hexdigest()

    # --- finishing ------------------------------------------------------------------------------
    def commit(self) -> WrittenFile:
        try:
            if self._open_sink is not None:
                raise RuntimeError(f"parameter {self._open_sink.name!r} was not finished")
            if self.crc:
                self._emit(CRC_MAGIC + self._crc.to_bytes(10, "big"), record=False)
            size, digest = self._file.commit()
        except BaseException:
            self._file.abort()  # never leave the temporary file behind
            raise
        return WrittenFile(self.path, size, digest, dict(self.tensors))

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


def copy_checkpoint(reader: CheckpointReader, path: str | os.PathLike, *, crc: bool | None = None) -> WrittenFile:
    """Rewrite a checkpoint record for record (same chunking, same order): the round-trip path."""
    with CheckpointWriter(path, crc=reader.has_crc if crc is None else crc) as w:
        for entry in reader.groups:
            kind = entry.extra["kind"]
            if kind == KIND_MAP:
                recs = [
                    [(p.dims, p.dtype, reader.pread(p.content_offset, p.content_len)) for p in parts]
                    for parts in entry.extra["map_records"]
                ]
                w.add_map(entry.name, recs)
                continue
            # tensors and str entries alike: same records, same dims and dtype per record
            sink = _GroupSink(w, entry.name, entry.extra["records"])
            for block in reader.iter_entry(entry):
                sink.write(block)
            sink.close()
    return w.result


class _GroupSink:
    """A sink that reproduces a group's records exactly, including per-record dims and dtype."""

    def __init__(self, writer: CheckpointWriter, name: str, recs: list[Record]):
        self.w = writer
        self.name = name
        self.recs = list(recs)
        self.left = 0
        self.h = hashlib.sha256()
        self._advance()

    def _advance(self):
        while self.left == 0 and self.recs:
            r = self.recs.pop(0)
            self.w._emit(record_header(self.name, r.dims, r.dtype, r.content_len), record=True)
            self.left = r.content_len

    def write(self, data):
        mv = memoryview(data).cast("B")
        self.h.update(mv)
        while len(mv):
            take = min(self.left, len(mv))
            self.w._emit(mv[:take], record=True)
            mv = mv[take:]
            self.left -= take
            self._advance()

    def close(self):
        self._advance()
        self.w.tensors[self.name] = self.h.hexdigest()
