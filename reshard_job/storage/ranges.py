"""Turning many small byte ranges into few large requests (pure; no I/O).

Every request to an object store costs a round trip (milliseconds) whatever its size, while
bytes cost bandwidth. Ranges that lie close together are therefore fetched by one request that
also reads the gap between them, as long as the gap is small (``max_gap``): reading a few
hundred KiB more is cheaper than another round trip. Requests are capped at ``max_request``
bytes, and a range longer than that is split, so that one huge slice becomes several requests
that can be in flight at once and no single request holds more than the cap in flight.

``plan_requests`` only computes the requests; the reader streams each response into the
caller's buffers piece by piece (``Piece``), so coalescing costs no extra memory.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Piece:
    """Bytes of one request that belong to one of the caller's ranges."""

    index: int  # which of the caller's ranges
    offset: int  # absolute file offset of the piece
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class Request:
    """One ranged GET: bytes [offset, offset + length) and the pieces of ranges inside it."""

    offset: int
    length: int
    pieces: tuple[Piece, ...]

    @property
    def end(self) -> int:
        return self.offset + self.length


def clip_ranges(ranges: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """Each (offset, length) cut to what a file of `size` bytes holds (length 0 past its end)."""
    out = []
    for offset, length in ranges:
        if offset < 0 or length < 0:
            raise ValueError(f"invalid byte range ({offset}, {length})")
        start = min(offset, size)
        out.append((start, max(0, min(offset + length, size) - start)))
    return out


def plan_requests(ranges: list[tuple[int, int]], *, max_gap: int, max_request: int) -> list[Request]:
    """Requests covering every non-empty range, in file order.

    Ranges may overlap or repeat (each gets its own pieces). A request spans at most
    `max_request` bytes and never reads a gap longer than `max_gap` bytes between ranges.
    """
    if max_request <= 0 or max_gap < 0:
        raise ValueError("max_request must be positive and max_gap non-negative")
    # Pieces no longer than max_request, sorted by offset: a long range becomes several pieces.
    pieces: list[Piece] = []
    for index, (offset, length) in enumerate(ranges):
        pos, end = offset, offset + length
        while pos < end:
            step = min(end - pos, max_request)
            pieces.append(Piece(index, pos, step))
            pos += step
    pieces.sort(key=lambda p: (p.offset, p.end))

    requests: list[Request] = []
    start = end = 0
    members: list[Piece] = []
    for piece in pieces:
        if members and piece.offset - end <= max_gap and max(end, piece.end) - start <= max_request:
            members.append(piece)
            end = max(end, piece.end)
            continue
        if members:
            requests.append(Request(start, end - start, tuple(members)))
        start, end, members = piece.offset, piece.end, [piece]
    if members:
        requests.append(Request(start, end - start, tuple(members)))
    return requests
