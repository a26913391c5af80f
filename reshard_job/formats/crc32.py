"""CRC32 algebra: combining CRCs of consecutive pieces, and MindSpore's safetensors ``crc_num``.

MindSpore's ``crc_num`` chains zlib CRC32 over every tensor in sorted name order (the UTF-8 name,
then ``bytes(array)`` of the tensor as a numpy array), while a streaming writer produces tensors in
file order. Combining CRCs (zlib's ``crc32_combine``, which Python lacks) lets the writer compute
each tensor's CRC as its bytes pass and chain them in name order at the end, without a second pass.

``bytes(array)`` is the raw C-order bytes, except for a 0-d array of an integer dtype: numpy lets it
stand for an index, and ``bytes(n)`` is ``n`` zero bytes. So a 0-d integer tensor (``epoch_num``,
``step_num``) holding ``n`` contributes ``n`` zero bytes to the checksum, not its 8 stored bytes;
``bytes`` raises for a negative ``n`` or one past ``2**63 - 1``, so MindSpore writes and checks no
such file. The CRC of ``n`` zero bytes is computed in O(log n) steps, never by allocating them.
"""

from __future__ import annotations

import zlib


def _gf2_times(mat: list[int], vec: int) -> int:
    out = 0
    i = 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


def _zero_byte_operators() -> list[list[int]]:
    """Operators that advance a CRC32 state over 2**k zero bytes, for k = 0..63 (as in zlib)."""
    one_bit = [0xEDB88320] + [1 << n for n in range(31)]
    op = one_bit
    for _ in range(3):  # 1 -> 2 -> 4 -> 8 zero bits
        op = _gf2_square(op)
    ops = [op]
    for _ in range(63):
        ops.append(_gf2_square(ops[-1]))
    return ops


_ZERO_OPS: list[list[int]] | None = None


def _advance_over_zeros(register: int, count: int) -> int:
    """The raw CRC32 register after `count` zero bytes (count < 2**64), in O(log count) steps."""
    global _ZERO_OPS
    if _ZERO_OPS is None:
        _ZERO_OPS = _zero_byte_operators()
    k = 0
    while count:
        if count & 1:
            register = _gf2_times(_ZERO_OPS[k], register)
        count >>= 1
        k += 1
    return register


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32 of A+B from crc32(A), crc32(B) and len(B); zlib's crc32_combine, which Python lacks.

    Lets the writer chain tensors' CRCs in sorted-name order while their bytes arrive in file order.
    """
    if len2 <= 0:
        return crc1
    return _advance_over_zeros(crc1, len2) ^ crc2


def crc32_of_zeros(count: int, crc: int = 0) -> int:
    """``zlib.crc32(bytes(count), crc)`` without allocating the bytes (zlib inverts the register
    before and after, and zero bytes advance it linearly)."""
    return _advance_over_zeros(crc ^ 0xFFFFFFFF, count) ^ 0xFFFFFFFF


# safetensors codes MindSpore reads into numpy integer arrays: a 0-d one of these is an index to bytes()
INTEGER_CODES = frozenset({"I8", "U8", "I16", "U16", "I32", "U32", "I64", "U64"})
MAX_BYTES_COUNT = 2**63 - 1  # bytes(n) raises OverflowError past this (Py_ssize_t)


def hashed_as_count(code: str, shape) -> bool:
    """Whether MindSpore's crc_num takes this tensor's value as a count of zero bytes (0-d integer)."""
    return tuple(shape) == () and code in INTEGER_CODES


def scalar_crc_part(code: str, raw: bytes) -> tuple[int, int]:
    """(crc32, length) of what MindSpore's crc_num hashes for a 0-d integer tensor stored as `raw`:
    ``n`` zero bytes for the value ``n``. ValueError (the caller names the file and tensor) for a
    value ``bytes()`` refuses, which MindSpore can neither save nor check with ``crc_check``."""
    n = int.from_bytes(raw, "little", signed=code.startswith("I"))
    if not 0 <= n <= MAX_BYTES_COUNT:
        raise ValueError(f"0-d {code} value {n} is outside 0..2**63-1, and MindSpore's crc_num hashes "
                         f"such a tensor as bytes(value), which has no value for it")
    return crc32_of_zeros(n), n


def chain_crc(parts: dict[str, tuple[int, int]]) -> int:
    """MindSpore's crc_num from per-tensor (crc32 of the bytes, byte count): sorted names, name then bytes."""
    crc = 0
    for name in sorted(parts):
        data_crc, nbytes = parts[name]
        crc = zlib.crc32(name.encode("utf-8"), crc)
        crc = crc32_combine(crc, data_crc, nbytes)
    return crc


def _crc_table():
    import numpy as np

    table = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        table = np.where(table & 1, (table >> 1) ^ np.uint32(0xEDB88320), table >> 1).astype(np.uint32)
    return table


_TABLE = None


def crc32_rows(rows):
    """``zlib.crc32`` of each row of a 2-d uint8 array (one short byte string per row), all rows at
    once: one table step per column instead of one call per row, for the hundreds of thousands of
    tiny tensors a checkpoint may hold. Returns a uint32 array."""
    import numpy as np

    global _TABLE
    if _TABLE is None:
        _TABLE = _crc_table()
    crc = np.full(rows.shape[0], 0xFFFFFFFF, dtype=np.uint32)
    for column in rows.T:
        crc = _TABLE[(crc ^ column) & 0xFF] ^ (crc >> 8)
    return crc ^ np.uint32(0xFFFFFFFF)
