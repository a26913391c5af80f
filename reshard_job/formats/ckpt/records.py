"""The records of a `.ckpt` file: constants, the record header encoding and the TensorProto parser.

A `.ckpt` file is a sequence of protobuf records, each one ``Checkpoint`` message holding one
``Value`` (``tag`` + ``TensorProto``), optionally followed by a 17-byte CRC32 trailer. A tensor larger
than 512 MiB is spread over several consecutive records with the same tag, each repeating the full
dims. Both the reader and the writer encode and decode these records themselves, byte for byte as
MindSpore's ``save_checkpoint`` writes them, so that tensor bytes never pass through protobuf.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from reshard_job.formats import wire

SLICE_BYTES = 512 * 1024 * 1024  # MindSpore's SLICE_SIZE (512 * 1024 KiB)
CRC_MAGIC = b"crc_num"
CRC_TRAILER_LEN = 17
# A tensor's rank is small in practice (MindSpore tensors have at most 8 dims); a record claiming
# millions of dims is corrupt and would cost gigabytes to hold.
MAX_DIMS = 64
# MindSpore cuts a tensor into records of 512 MiB (or into ceil(size / 512 MiB) pieces): 4096 records
# are a 2 TiB tensor. A group of more is not a tensor but a file built to make indexing take hours.
MAX_RECORDS_PER_TENSOR = 4096


@dataclass(frozen=True, slots=True)
class Record:
    """One top-level record as found in the file."""

    offset: int  # file offset of the record's 0x0A key byte
    length: int  # total bytes of the record, key and length prefix included
    dims: tuple[int, ...]
    dtype: str
    content_offset: int
    content_len: int


def parse_tensor_proto(buf, pos: int, end: int, base: int = 0) -> tuple[list[int], str | None, int, int]:
    """Parse a TensorProto in buf[pos:end]; return dims, tensor_type, content offset (+ `base`), length."""
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
                if len(dims) > MAX_DIMS:
                    break
        elif field == 2 and wt == wire.LEN:
            n, pos = wire.decode_varint(buf, pos, end)
            if pos + n > end:
                raise wire.WireError("tensor_type runs past the tensor")
            if n > 64:
                raise wire.WireError(f"tensor_type of {n} bytes is not a dtype name")
            raw = bytes(buf[pos : pos + n])
            if len(raw) != n:
                raise IndexError(pos + n)  # beyond the bytes at hand: the caller fetches more
            try:
                dtype = raw.decode("ascii")
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
        if len(dims) > MAX_DIMS:
            raise wire.WireError(f"more than {MAX_DIMS} dims")
    return dims, dtype, c_off + base, c_len


_DTYPE_FIELDS: dict[str, bytes] = {}


def tensor_header(dims: Iterable[int], dtype: str, content_len: int) -> bytes:
    """TensorProto bytes up to (and including) the tensor_content length prefix."""
    t = _DTYPE_FIELDS.get(dtype)
    if t is None:
        raw = dtype.encode("ascii")
        t = _DTYPE_FIELDS.setdefault(dtype, wire.len_field(2, len(raw)) + raw)
    enc = wire.encode_varint
    return b"".join([b"\x08" + enc(int(d)) for d in dims] + [t, b"\x1a", enc(content_len)])


_TENSOR_FIELDS: dict[tuple, bytes] = {}  # (dims, dtype, content length) -> the Value's tensor field head


def tensor_field(dims: Iterable[int], dtype: str, content_len: int) -> bytes:
    """The part of a one-tensor record after its name, up to its tensor_content bytes (TensorProto
    key and length, dims, dtype, content length), kept per (dims, dtype, length): a model's many
    small tensors share a few of them."""
    try:
        return _TENSOR_FIELDS[dims, dtype, content_len]
    except (KeyError, TypeError):  # new, or dims given as a list
        dims = tuple(int(d) for d in dims)
        tensor_head = tensor_header(dims, dtype, content_len)
        field = wire.len_field(2, len(tensor_head) + content_len) + tensor_head
        if len(_TENSOR_FIELDS) < 10_000:
            _TENSOR_FIELDS[dims, dtype, content_len] = field
        return field


def record_header(name: str, dims: Iterable[int], dtype: str, content_len: int) -> bytes:
    """Everything of a one-tensor record that precedes its tensor_content bytes."""
    try:
        field = _TENSOR_FIELDS[dims, dtype, content_len]
    except (KeyError, TypeError):
        field = tensor_field(dims, dtype, content_len)
    tag = name.encode("utf-8")
    value = wire.len_field(1, len(tag)) + tag + field
    return wire.len_field(1, len(value) + content_len) + value


def records_alike(names: list[str], field: bytes, contents: list) -> bytes:
    """One-tensor records of these names and contents, all with the same `field` (``tensor_field``
    of their dims, dtype and content length, which every content has): their bytes as
    ``record_header`` + content each, made in two joins instead of a call per record."""
    tags = [name.encode("utf-8") for name in names]
    lengths = list(map(len, tags))
    frames = {}  # name length -> the record's frame up to its name (the same for every name that long)
    for n in set(lengths):
        value = len(wire.len_field(1, n)) + n + len(field) + len(contents[0])
        frames[n] = wire.len_field(1, value) + wire.len_field(1, n)
    parts = [field] * (4 * len(tags))
    parts[0::4] = map(frames.__getitem__, lengths)
    parts[1::4] = tags
    parts[3::4] = contents
    return b"".join(parts)


def map_record(name: str, parts: list[tuple[tuple[int, ...], str, bytes]]) -> bytes:
    """A whole map-tensor record (keys, values, status parts)."""
    tag = name.encode("utf-8")
    body = bytearray()
    for dims, dt, content in parts:
        tp = tensor_header(dims, dt, len(content)) + content
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

