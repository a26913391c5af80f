"""The record walk of a `.ckpt` file: one pass over its records that builds a reader's index.

Consecutive records with one tag are one tensor (their contents concatenated, dims and dtype of the
last record), as in MindSpore's loader; a tag that appears again later replaces the earlier tensor,
as there.

Walking reads the file through windows of a few MiB: small records (and a mixture-of-experts file
holds hundreds of thousands) are parsed straight from the window, while for a large record only its
head is fetched and the tensor bytes are skipped by length, so indexing reads about the headers'
bytes, locally or from an object store alike.
"""

from __future__ import annotations

import sys

from reshard_job.errors import CheckpointFormatError
from reshard_job.formats import wire
import reshard_job.core.dtypes as dtypes
from reshard_job.formats.tensorfile import KIND_MAP, KIND_STR, KIND_TENSOR
from reshard_job.formats.ckpt.records import (CRC_MAGIC, CRC_TRAILER_LEN, MAX_RECORDS_PER_TENSOR, Record,
                                             parse_tensor_proto)
from reshard_job.formats.ckpt.runs import take_run
from reshard_job.text import quoted

WINDOW = 4 * 1024 * 1024  # bytes fetched per read while walking small records
# MindSpore's encrypted files (crypto.h) start each block with a little-endian int32 magic, one per
# mode; a plain checkpoint starts with a record's 0x0a, so the two never meet.
ENCRYPTED_MAGICS = {0x7F3A5ED8: "AES-GCM", 0x7F3A5ED9: "AES-CBC", 0x7F3A5EDA: "SM4-CBC"}
HEAD = 64 * 1024  # bytes fetched at the start of a record larger than a window
# Where records run larger than this, the walk fetches only the first SMALL_HEAD bytes of each
# record instead of whole windows: reading every byte of a file of 250 KiB tensors to find their
# headers cost more than the rest of opening it (page-cache copies are not free either).
LARGE_RECORD = 32 * 1024
SMALL_HEAD = 4096
RUN_AFTER = 16  # records alike checked one by one before the rest of a run is taken at once (``runs``)

_DTYPES: dict[bytes, str] = {}  # tensor_type bytes -> interned name
_SHAPES: dict[tuple, tuple] = {}  # interned shapes
KINDS = (KIND_TENSOR, KIND_STR, KIND_MAP)  # a group's kind, by its code in the kind column


def positions(names: list[str]) -> dict[str, int]:
    """Name -> its group's place in `names`, in the order of each name's last group: a name given
    again later is that later group (MindSpore's loader keeps the last), placed at the end."""
    pos = dict(zip(names, range(len(names))))
    if len(pos) != len(names):  # a name given twice: its later group, at the end
        pos = {}
        for i, name in enumerate(names):
            pos.pop(name, None)
            pos[name] = i
    return pos


def intern_shape(dims: tuple) -> tuple:
    return _SHAPES.setdefault(dims, dims) if len(_SHAPES) < 100_000 else dims


def _ascii(raw: bytes) -> str:
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError:
        raise wire.WireError("tensor_type is not ASCII") from None


class _Window:
    """The bytes of one file region, fetched on demand, indexed by absolute file offsets.

    Used only where a record is too large for a window and its fields are not where MindSpore
    puts them (e.g. dims after the tensor content): slow, but correct for any valid file.
    """

    def __init__(self, reader: "RecordWalk"):
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


def _fast_value(b, p: int, end: int):
    """The common record form, straight from bytes: tag, then a TensorProto of dims, dtype, content.

    Returns (tag bytes, dims tuple, dtype bytes, content offset, content length) or None when the
    record is of another form (the general parser then handles it)."""
    if end - p < 2 or b[p] != 0x0A or b[p + 1] >= 0x80:  # every index below stays under `end`
        return None
    n = b[p + 1]
    tag = b[p + 2:p + 2 + n]
    p += 2 + n
    if p >= end or b[p] != 0x12:
        return None
    tlen, p = wire.decode_varint(b, p + 1, end)
    if p + tlen != end:
        return None
    dims = []
    while p < end and b[p] == 0x08:
        if p + 1 >= end:
            return None
        v = b[p + 1]
        if v < 0x80:
            dims.append(v)
            p += 2
        else:
            v, p = wire.decode_varint(b, p + 1, end)
            dims.append(wire.as_signed64(v))
        if len(dims) > 64:
            return None
    if p + 1 >= end or b[p] != 0x12 or b[p + 1] >= 0x80:
        return None
    n = b[p + 1]
    dtype = bytes(b[p + 2:p + 2 + n])  # hashable: names are looked up by these bytes
    p += 2 + n
    if p >= end or b[p] != 0x1A:
        return None
    clen, p = wire.decode_varint(b, p + 1, end)
    if p + clen != end:
        return None
    return tag, tuple(dims), dtype, p, clen


class RecordWalk:
    """The walk that fills ``CheckpointReader``'s index columns (``_names``, ``_kind``, ``_dtype``,
    ``_shape``, ``_off``, ``_len``, ``_rec``, ``_rlen``, ``_multi``, ``crc_stored``), reading the
    file through the reader's positioned reads. Where each name's group lies (``_pos``) follows
    from ``_names`` alone, and is made from it once the walk is done (``positions``)."""

    _no_runs_before = 0  # file offset before which records alike are taken one by one
    _run_after = 0  # records alike before the rest of a run is asked for (0: RUN_AFTER; ``runs.take_run``)

    def _walk(self) -> None:
        """Index every record, front to back, through windows of the file (module docstring).

        A record's frame (key, length) is read here rather than in a function of its own: one more
        call per record cost about 3% of indexing a file of small records of varied shapes."""
        size = self.size
        buffer, head_buffer, large = self._walk_buffers()
        pos = 0
        wstart, window = 0, b""
        typical = 0  # moving average of record lengths (large weights often alternate with tiny biases)
        tail = None  # the last common record's tail (see ``_walk_repeats``)
        first = self._first_window_buffer()
        while pos < size:
            if pos + self._head > wstart + len(window) and wstart + len(window) < size:
                # the next record is likely large too where `typical` is: its head is enough
                window = self._walk_window(pos, first if pos == 0 and first is not None else
                                           head_buffer if typical >= large else buffer)
                wstart = pos
            rel = pos - wstart
            if size - pos == CRC_TRAILER_LEN and window[rel : rel + 7] == CRC_MAGIC and self._names:
                self.crc_stored = int.from_bytes(window[rel + 7 : rel + 17], "big")
                break
            if window[rel] != 0x0A:
                raise self._not_a_record(pos, window[rel])
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
                common = self._add(pos, window, wstart, vpos, vend)
            except wire.WireError as e:
                raise self._error(f"record at offset {pos}: {e}") from None
            if common is not None:
                coff, tail_start = common
                tail = (bytes(window[tail_start:coff]), self._len[-1], self._dtype[-1], self._shape[-1])
            typical = (3 * typical + vend - pos) >> 2
            pos = vend
            if tail is not None:
                pos, typical = self._walk_repeats(window, wstart, pos, typical, tail)
        self._multi = {i: tuple(recs) for i, recs in self._multi.items()}

    def _walk_buffers(self) -> tuple[bytearray, bytearray, int]:
        """The buffers a walk reads windows and record heads into, and the typical record length
        from which it reads only record heads; sets the head fetched of a record larger than a window."""
        # An object store asks for small windows: bytes of skipped tensors would cross the network.
        fetch = getattr(self._file, "index_window", None)
        # Local files: a short read per record once records are large (a request is cheap);
        # an object store keeps its windows (a request costs a round trip).
        large = LARGE_RECORD if fetch is None else fetch
        fetch = fetch or WINDOW
        self._head = min(HEAD, fetch // 2)  # a record's head then lies in the window just read
        # One window buffer, refilled in place: a fresh one per window is a fresh mapping (large
        # buffers are mmapped, see job/run/memory.py) whose pages the kernel must zero on first touch,
        # which cost more than the reads themselves.
        return bytearray(min(fetch, self.size)), bytearray(min(SMALL_HEAD, self.size)), large

    def _first_window_buffer(self) -> bytearray | None:
        """An object store's first window is one record head (HEAD bytes), not a full window: a file
        that starts with a large tensor would otherwise fetch the first MiB of it only to skip it."""
        if getattr(self._file, "index_window", None) is None:
            return None
        return bytearray(min(HEAD, self.size))

    def _walk_window(self, pos: int, buffer: bytearray) -> bytearray:
        """The file's bytes from `pos` on, as many as `buffer` holds (in it, unless the file ends first)."""
        n = min(len(buffer), self.size - pos)
        window = buffer if n == len(buffer) else bytearray(n)
        self.pread_into(pos, memoryview(window))
        return window

    def _not_a_record(self, pos: int, byte: int) -> CheckpointFormatError:
        """The error for a byte at `pos` that should start a record but does not."""
        if pos == 0 and self.size >= 4:
            first = bytearray(4)
            self.pread_into(0, memoryview(first))
            mode = ENCRYPTED_MAGICS.get(int.from_bytes(first, "little"))
            if mode is not None:
                return self._error(f"an encrypted checkpoint ({mode}, MindSpore's save_checkpoint(enc_key=...)), which "
                                   "cannot be read: decrypt it with MindSpore first (load_checkpoint(dec_key=...), then "
                                   "save_checkpoint without enc_key)")
        what = "wrong magic: not a MindSpore checkpoint" if pos == 0 else "corrupt record"
        return self._error(f"{what} (byte 0x{byte:02x} at offset {pos}, expected 0x0a)")

    def _walk_repeats(self, window, wstart: int, pos: int, typical: int, tail: tuple) -> tuple[int, int]:
        """Index the records from `pos` on that lie whole in `window` and repeat the last common
        record but for their names; return the position and `typical` after them.

        Many small tensors alike (experts, their optimizer states) differ only in their names: the
        bytes after a record's name (dims, dtype, content length) repeat. A record whose bytes
        there equal the last common record's (`tail`: those bytes from its TensorProto key to its
        content, its content length, dtype and shape), and whose length says nothing follows its
        content, is added without parsing those fields again."""
        run, alike, tail_len = tail, 0, len(tail[0])  # a long run is taken at once (``runs``)
        tail, tail_clen, tail_dtype, tail_shape = tail
        names = None  # the columns, fetched at the first repeat (most calls find none)
        while True:
            alike += 1
            if alike > (self._run_after or RUN_AFTER) and pos >= self._no_runs_before:  # the run at once
                alike = 0
                pos, typical = take_run(self, window, wstart, pos, typical, run) or (pos, typical)
            rel = pos - wstart
            if rel + 3 >= len(window) or window[rel] != 0x0A:
                return pos, typical
            vlen = window[rel + 1]
            if vlen < 0x80:  # records under 128 bytes
                v = rel + 2
            elif window[rel + 2] < 0x80:  # under 16 KiB
                vlen = (vlen & 0x7F) | window[rel + 2] << 7
                v = rel + 3
            else:
                return pos, typical  # larger: the full path
            rel_end = v + vlen
            if rel_end > len(window) or window[v] != 0x0A or window[v + 1] >= 0x80:
                return pos, typical
            q = v + 2 + window[v + 1]
            if q + tail_len + tail_clen != rel_end or window[q:q + tail_len] != tail:
                return pos, typical
            try:
                name = sys.intern(window[v + 2:q].decode("utf-8"))
            except UnicodeDecodeError:
                raise self._error(f"record at offset {pos}: parameter name is not valid UTF-8") from None
            if names is None:
                names, kinds, dtype_col, shape_col = self._names, self._kind, self._dtype, self._shape
                off_col, len_col, rec_col, rlen_col = self._off, self._len, self._rec, self._rlen
                note = self._note
            if names and names[-1] == name:  # the same name again is a chunk: the full path
                return pos, typical
            vend = wstart + rel_end
            names.append(name)
            kinds.append(0)
            dtype_col.append(tail_dtype)
            shape_col.append(tail_shape)
            off_col.append(wstart + q + tail_len)
            len_col.append(tail_clen)
            if note is not None:
                note(wstart + q + tail_len, tail_clen, name, tail_dtype, tail_shape)
            rec_col.append(pos)
            rlen_col.append(vend - pos)
            typical = (3 * typical + vend - pos) >> 2
            pos = vend

    def _add(self, pos: int, window, wstart: int, vpos: int, vend: int):
        """Index one record. For a new one-record tensor of the common form, returns (its content's
        offset in `window`, where its TensorProto field starts there); else None."""
        rel_end = vend - wstart
        fast = _fast_value(window, vpos, rel_end) if rel_end <= len(window) else None
        if fast is None:
            if rel_end <= len(window):
                tag, kind, rec, parts = self._parse_value(window, wstart, pos, vpos, rel_end)
            else:
                tag, kind, rec, parts = self._parse_large(pos, wstart + vpos, vend, window, wstart)
            self._record(sys.intern(tag), kind, rec, parts)
            return
        raw_tag, dims, dtype, coff, clen = fast
        name = _DTYPES.get(dtype) or _DTYPES.setdefault(dtype, _ascii(dtype))
        try:
            tag = sys.intern(raw_tag.decode("utf-8"))
        except UnicodeDecodeError:
            raise wire.WireError("parameter name is not valid UTF-8") from None
        names = self._names
        if names and names[-1] == tag or name == dtypes.STR_TYPE:  # a chunk of a large tensor; a str entry
            kind = KIND_STR if name == dtypes.STR_TYPE else KIND_TENSOR
            self._record(tag, kind, Record(pos, vend - pos, dims, name, wstart + coff, clen), None)
            return None
        names.append(tag)  # the common case, inline: a new one-record tensor
        self._kind.append(0)
        self._dtype.append(name)
        self._shape.append(_SHAPES.setdefault(dims, dims) if len(_SHAPES) < 100_000 else dims)
        self._off.append(wstart + coff)
        self._len.append(clen)
        if self._note is not None:
            self._note(wstart + coff, clen, tag, name, dims)
        self._rec.append(pos)
        self._rlen.append(vend - pos)
        return coff, vpos + 2 + len(raw_tag)

    def _record(self, tag: str, kind: str, rec: Record | None, parts: list | None) -> None:
        """Add a record: to the current group when it continues the same tag, else as a new group."""
        if self._note is not None:
            if kind == KIND_TENSOR and rec is not None:
                self._note(rec.content_offset, rec.content_len, tag, rec.dtype, rec.dims)
            for r in (parts or ()) if kind == KIND_MAP else (rec,) if kind != KIND_TENSOR and rec is not None else ():
                self._note(r.content_offset, r.content_len)
        last = len(self._names) - 1
        if last >= 0 and self._names[last] == tag:
            if (kind == KIND_MAP) != (KINDS[self._kind[last]] == KIND_MAP):
                raise self._error(f"parameter {quoted(tag)}: consecutive records mix tensor and map-tensor values")
            if kind == KIND_MAP:
                self._multi[last].append(parts)  # lists while walking (appends, not copies), tuples after
                self._len[last] += sum(p.content_len for p in parts)
                return
            recs = self._multi.get(last)
            if recs is None:
                recs = self._multi[last] = [self._first_record(last)]
            recs.append(rec)
            if len(recs) > MAX_RECORDS_PER_TENSOR:
                raise self._error(f"parameter {quoted(tag)}: stored in more than {MAX_RECORDS_PER_TENSOR} consecutive "
                                  f"records (MindSpore writes one per 512 MiB of a tensor)")
            self._len[last] += rec.content_len
            self._kind[last] = KINDS.index(kind)
            self._dtype[last] = rec.dtype
            self._shape[last] = intern_shape(rec.dims)
            return
        i = len(self._names)
        self._names.append(tag)
        self._kind.append(KINDS.index(kind))
        if kind == KIND_MAP:
            self._multi[i] = [parts]
            self._dtype.append("map")
            self._shape.append(())
            self._off.append(parts[0].content_offset if parts else 0)
            self._len.append(sum(p.content_len for p in parts))
            self._rec.append(parts[0].offset if parts else 0)
            self._rlen.append(parts[0].length if parts else 0)
        else:
            self._dtype.append(rec.dtype)
            self._shape.append(intern_shape(rec.dims))
            self._off.append(rec.content_offset)
            self._len.append(rec.content_len)
            self._rec.append(rec.offset)
            self._rlen.append(rec.length)

    def _first_record(self, i: int) -> Record:
        return Record(self._rec[i], self._rlen[i], self._shape[i], self._dtype[i], self._off[i], self._len[i])

    def _parse_large(self, start: int, vstart: int, vend: int, window=None, wstart: int = 0):
        """A record larger than a window: parse its head (from `window` where that holds it, which
        then began at file offset `wstart`); fall back to fetching on demand."""
        want = min(self._head, vend - vstart)
        if window is not None and wstart <= vstart and vstart + min(want, SMALL_HEAD // 2) <= wstart + len(window):
            head = memoryview(window)[vstart - wstart:]
        else:
            head = self.pread(vstart, want)
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
                map_parts.append(self._parse_map(buf, base, start, end, pos, pos + n))
            pos += n
        if tag is None:
            raise wire.WireError("record without a parameter name")
        if tensor is not None:
            kind = KIND_STR if tensor.dtype == dtypes.STR_TYPE else KIND_TENSOR
            return tag, kind, tensor, None
        if len(map_parts) != 1 or len(map_parts[0]) != 3:
            raise wire.WireError(f"map parameter {quoted(tag)}: expected 3 parts (keys, values, status) per record")
        return tag, KIND_MAP, None, map_parts[0]

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
                if len(parts) > 3:  # said at the fourth (a million parts took 14 s to be refused)
                    raise wire.WireError("map parameter: more than 3 parts (keys, values, status) in one record")
                pos += n
            else:
                pos = wire.skip_field(buf, pos, end, wt)
        return parts
