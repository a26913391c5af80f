"""CRC32 algebra: combining CRCs of consecutive pieces, and MindSpore's safetensors ``crc_num``.

MindSpore's ``crc_num`` chains zlib CRC32 over every tensor in sorted name order (the UTF-8 name,
then the raw bytes), while a streaming writer produces tensors in file order. Combining CRCs
(zlib's ``crc32_combine``, which Python lacks) lets the writer compute each tensor's CRC as its
bytes pass and chain them in name order at the end, without a second pass over the data.
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


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32 of A+B from crc32(A), crc32(B) and len(B); zlib's crc32_combine, which Python lacks.

    Lets the writer chain tensors' CRCs in sorted-name order while their bytes arrive in file order.
    """
    global _ZERO_OPS
    if len2 <= 0:
        return crc1
    if _ZERO_OPS is None:
        _ZERO_OPS = _zero_byte_operators()
    k = 0
    while len2:
        if len2 & 1:
            crc1 = _gf2_times(_ZERO_OPS[k], crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


def chain_crc(parts: dict[str, tuple[int, int]]) -> int:
    """MindSpore's crc_num from per-tensor (crc32 of the bytes, byte count): sorted names, name then bytes."""
    crc = 0
    for name in sorted(parts):
        data_crc, nbytes = parts[name]
        crc = zlib.crc32(name.encode("utf-8"), crc)
        crc = crc32_combine(crc, data_crc, nbytes)
    return crc
