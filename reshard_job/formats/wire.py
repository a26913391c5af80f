"""Protobuf wire-format primitives (varints, keys, length-delimited fields).

The `.ckpt` reader walks records itself instead of calling ``ParseFromString`` on the whole file:
that way it learns where each tensor's bytes lie without reading them, and files over 2 GiB work
with any protobuf backend. The writer encodes record headers itself so that tensor bytes can be
streamed straight from a buffer to disk. Both follow the encoding rules protobuf's serializer uses
(fields in number order, unpacked proto2 repeated scalars, two's-complement 10-byte negatives), so
the bytes are identical to ``SerializeToString``; the tests check that against protobuf itself.
"""

from __future__ import annotations

VARINT, FIXED64, LEN, START_GROUP, END_GROUP, FIXED32 = 0, 1, 2, 3, 4, 5


class WireError(ValueError):
    """Malformed protobuf bytes; the caller turns it into a FormatError naming the file."""


_SMALL = [bytes([i]) for i in range(128)]


def encode_varint(value: int) -> bytes:
    if 0 <= value < 128:
        return _SMALL[value]
    if value < 0:
        value += 1 << 64  # int64/int32 negatives are sign-extended to 64 bits
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def decode_varint(buf, pos: int, end: int) -> tuple[int, int]:
    """Return (value, new_pos). Raises WireError when the varint runs past `end` or 10 bytes."""
    if pos < end:
        byte = buf[pos]
        if byte < 0x80:  # most keys and small lengths: one byte
            return byte, pos + 1
    result = 0
    shift = 0
    while True:
        if pos >= end:
            raise WireError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise WireError("varint longer than 10 bytes")


def as_signed64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def key(field: int, wire_type: int) -> bytes:
    return encode_varint((field << 3) | wire_type)


def len_field(field: int, payload_len: int) -> bytes:
    """Key and length prefix of a length-delimited field (the payload follows)."""
    return key(field, LEN) + encode_varint(payload_len)


def skip_field(buf, pos: int, end: int, wire_type: int) -> int:
    """Skip one field's value; return the position after it."""
    if wire_type == VARINT:
        return decode_varint(buf, pos, end)[1]
    if wire_type == FIXED64:
        pos += 8
    elif wire_type == FIXED32:
        pos += 4
    elif wire_type == LEN:
        length, pos = decode_varint(buf, pos, end)
        pos += length
    else:
        raise WireError(f"unsupported wire type {wire_type}")
    if pos > end:
        raise WireError("field runs past the end of its message")
    return pos
