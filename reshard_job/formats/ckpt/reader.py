"""Reading a `.ckpt` file: a record-by-record index, then tensors and boxes by positioned reads.

The reader walks the records once, noting where each tensor's bytes lie, and then serves tensors or
boxes of them with positioned reads: nothing is loaded that is not asked for, and files over 2 GiB
need no special protobuf backend. Consecutive records with one tag are one tensor (their contents
concatenated, dims and dtype of the last record), as in MindSpore's loader; a tag that appears again
later replaces the earlier tensor, as there.

Walking reads the file through windows of a few MiB: small records (and a mixture-of-experts file
holds hundreds of thousands) are parsed straight from the window, while for a large record only its
head is fetched and the tensor bytes are skipped by length, so indexing reads about the headers'
bytes, locally or from an object store alike.
"""

from __future__ import annotations

import os
import zlib
from math import prod

import numpy as np

from ...errors import CheckpointFormatError
from .. import dtypes, wire
from ..tensorfile import KIND_MAP, KIND_STR, KIND_TENSOR, PositionedReader, TensorEntry
from .records import CRC_MAGIC, CRC_TRAILER_LEN, Record, parse_tensor_proto

WINDOW = 4 * 1024 * 1024  # bytes fetched per read while walking small records
HEAD = 64 * 1024  # bytes fetched at the start of a record larger than a window


class _Window:
    """The bytes of one file region, fetched on demand, indexed by absolute file offsets.

    Used only where a record is too large for a window and its fields are not where MindSpore
    puts them (e.g. dims after the tensor content): slow, but correct for any valid file.
    """

    def __init__(self, reader: "CheckpointReader"):
        self._reader = reader
        self._start = 0
        self._data = b""

    def _load(self, pos: int) -> None:
        n = min(HEAD, self._reader.size - pos)
        self._data = self._reader.pread(pos, n)
        self._start = pos

    def __getitem__(self, key):
        if isinstance(key, slice):
            return self._reader.pread(key.start, key.stop - key.start)
        rel = key - self._start
        if not 0 <= rel < len(self._data):
            self._load(key)
            rel = 0
        return self._data[rel]


class CheckpointReader(PositionedReader):
    """Index of a `.ckpt` file; serves tensors and boxes of tensors by positioned reads.

    ``entries`` maps each parameter name to its TensorEntry, in file order; ``groups`` keeps every
    group of records in file order (needed to rewrite a file exactly). `source` is a path or an open
    ``storage.RandomAccess``.
    """

    def __init__(self, source, *, verify_crc: bool = True):
        super().__init__(source)
        self.groups: list[TensorEntry] = []
        self.crc_stored: int | None = None
        try:
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
        self._group(self._walk())

    def _walk(self) -> list[tuple]:
        size = self.size
        pos = 0
        wstart, window = 0, b""
        out = []
        # An object store asks for small windows: bytes of skipped tensors would cross the network.
        fetch = getattr(self._file, "index_window", WINDOW)
        self._head = min(HEAD, fetch // 2)  # a record's head then lies in the window just read
        while pos < size:
            if pos + self._head > wstart + len(window) and wstart + len(window) < size:
                wstart, window = pos, self.pread(pos, min(fetch, size - pos))
            rel = pos - wstart
            if size - pos == CRC_TRAILER_LEN and window[rel : rel + 7] == CRC_MAGIC and out:
                self.crc_stored = int.from_bytes(window[rel + 7 : rel + 17], "big")
                break
            if window[rel] != 0x0A:
                what = "wrong magic: not a MindSpore checkpoint" if pos == 0 else "corrupt record"
                raise self._error(f"{what} (byte 0x{window[rel]:02x} at offset {pos}, expected 0x0a)")
            try:
                vlen, vpos = wire.decode_varint(window, rel + 1, len(window))
            except wire.WireError as e:
                raise self._error(f"record at offset {pos}: {e} (file truncated?)") from None
            vstart = wstart + vpos
            vend = vstart + vlen
            if vend > size:
                raise self._error(f"record at offset {pos} needs {vlen} bytes but the file ends after "
                                  f"{size - vstart} (file truncated?)")
            try:
                if vend <= wstart + len(window):  # the whole record is in the window
                    out.append(self._parse_value(window, wstart, pos, vpos, vend - wstart))
                else:
                    out.append(self._parse_large(pos, vstart, vend))
            except wire.WireError as e:
                raise self._error(f"record at offset {pos}: {e}") from None
            pos = vend
        return out

    def _parse_large(self, start: int, vstart: int, vend: int):
        """A record larger than a window: parse its head; fall back to fetching on demand."""
        head = self.pread(vstart, min(self._head, vend - vstart))
        try:
            return self._parse_value(head, vstart, start, 0, vend - vstart)
        except IndexError:  # a field the head does not hold: fetch as the parser goes
            return self._parse_value(_Window(self), 0, start, vstart, vend)

    def _parse_value(self, buf, base: int, start: int, pos: int, end: int):
        """Parse a Value message in buf[pos:end]; buf[i] is the file's byte base + i."""
        tag = None
        tensor = None
        map_parts: list[Record] = []
        while pos < end:
            k, pos = wire.decode_varint(buf, pos, end)
            field, wt = k >> 3, k & 7
            if wt != wire.LEN:
                pos = wire.skip_field(buf, pos, end, wt)
                continue
            n, pos = wire.decode_varint(buf, pos, end)
            if pos + n > end:
                raise wire.WireError(f"field {field} runs past the record")
            if field == 1:
                raw = bytes(buf[pos : pos + n])
                if len(raw) != n:
                    raise IndexError(pos + n)  # beyond a record head: refetch
                try:
                    tag = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise wire.WireError("parameter name is not valid UTF-8") from None
            elif field == 2:
                dims, dt, c_off, c_len = parse_tensor_proto(buf, pos, pos + n, base)
                tensor = Record(start, base + end - start, tuple(dims), dt or "", c_off, c_len)
            elif field == 3:
                map_parts.extend(self._parse_map(buf, base, start, end, pos, pos + n))
            pos += n
        if tag is None:
            raise wire.WireError("record without a parameter name")
        if tensor is not None:
            kind = KIND_STR if tensor.dtype == dtypes.STR_TYPE else KIND_TENSOR
            return tag, kind, tensor, []
        return tag, KIND_MAP, None, map_parts

    def _parse_map(self, buf, base, start, rec_end, pos, end) -> list[Record]:
        parts = []
        while pos < end:
            k, pos = wire.decode_varint(buf, pos, end)
            field, wt = k >> 3, k & 7
            if field == 1 and wt == wire.LEN:
                n, pos = wire.decode_varint(buf, pos, end)
                if pos + n > end:
                    raise wire.WireError("map tensor part runs past the record")
                dims, dt, c_off, c_len = parse_tensor_proto(buf, pos, pos + n, base)
                parts.append(Record(start, base + rec_end - start, tuple(dims), dt or "", c_off, c_len))
                pos += n
            else:
                pos = wire.skip_field(buf, pos, end, wt)
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
        extra = tuple(recs)  # kept to rewrite the file exactly (per-record dims and dtype)
        if last.dtype == dtypes.STR_TYPE:
            if stored % 4:
                raise self._error(f"parameter {tag!r}: str content of {stored} bytes is not UTF-32")
            return TensorEntry(tag, dtypes.STR_TYPE, (), stored, pieces, KIND_STR, extra=extra).finish()
        if last.dtype not in dtypes.BY_NAME:
            raise self._error(f"parameter {tag!r}: unknown dtype {last.dtype!r}")
        if any(d < 0 for d in last.dims):
            raise self._error(f"parameter {tag!r}: negative dimension in dims {list(last.dims)}")
        dt = dtypes.BY_NAME[last.dtype]
        shape = tuple(last.dims)
        if dt.storage is None:  # packed Int4: carried, not checked element-wise
            return TensorEntry(tag, last.dtype, shape, stored, pieces, KIND_TENSOR, extra=extra).finish()
        want = prod(shape) * dt.itemsize
        if shape == (0,) and stored == dt.itemsize:
            shape, want = (), dt.itemsize  # MindSpore reads dims [0] as a scalar
        if stored != want:
            raise self._error(
                f"parameter {tag!r}: {stored} bytes of data but dims {list(last.dims)} of {last.dtype} need {want}"
            )
        return TensorEntry(tag, last.dtype, shape, stored, pieces, KIND_TENSOR, extra=extra).finish()

    def _map_entry(self, tag: str, group) -> TensorEntry:
        per_record = [g[3] for g in group]
        if any(len(p) != 3 for p in per_record):
            raise self._error(f"map parameter {tag!r}: expected 3 parts (keys, values, status) per record")
        pieces = [(p.content_offset, p.content_len) for parts in per_record for p in parts]
        extra = tuple(per_record)  # per record: its keys, values and status parts
        return TensorEntry(tag, "map", (), sum(n for _, n in pieces), pieces, KIND_MAP, extra=extra).finish()

    @staticmethod
    def records_of(entry: TensorEntry) -> tuple[Record, ...]:
        """The records a tensor or str entry was read from, in file order (for exact rewrites)."""
        if entry.kind == KIND_MAP:
            raise ValueError(f"parameter {entry.name!r} is a map tensor: see map_parts_of")
        return entry.extra

    @staticmethod
    def map_parts_of(entry: TensorEntry) -> tuple[list[Record], ...]:
        """A map tensor's records, each as its (keys, values, status) parts."""
        if entry.kind != KIND_MAP:
            raise ValueError(f"parameter {entry.name!r} is not a map tensor")
        return entry.extra

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
        return self.entries[name].kind

    def read_str(self, name: str) -> str:
        if self.entries[name].kind != KIND_STR:
            return super().read_str(name)
        try:
            return self.read_raw(name).decode("utf-32-le")
        except UnicodeDecodeError:
            raise self._error(f"parameter {name!r}: str content is not valid UTF-32") from None

    def map_records(self, name: str) -> list[list[tuple[tuple[int, ...], str, bytes]]]:
        """A map tensor's records as (dims, dtype, raw bytes) of its keys, values and status parts."""
        entry = self.entries[name]
        if entry.kind != KIND_MAP:
            return super().map_records(name)
        return [[(p.dims, p.dtype, self.pread(p.content_offset, p.content_len)) for p in rec]
                for rec in self.map_parts_of(entry)]

    def read_map(self, name: str) -> list[np.ndarray]:
        """A map tensor as [keys, values, status], concatenated over its records."""
        parts: list[list[np.ndarray]] = [[], [], []]
        for rec in self.map_records(name):
            for i, (dims, dtype, raw) in enumerate(rec):
                try:
                    dt = np.dtype(dtype)
                except (TypeError, ValueError, SyntaxError):  # numpy parses odd strings as struct specs
                    raise self._error(f"map parameter {name!r}: unknown part dtype {dtype!r}") from None
                try:
                    parts[i].append(np.frombuffer(raw, dtype=dt).reshape(dims))
                except ValueError:
                    raise self._error(
                        f"map parameter {name!r}: {len(raw)} bytes of {dtype} do not fit dims {list(dims)}"
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
