"""Runs of records alike but for their names, found in bulk: where the walk spends its time in a
file of many small tensors (experts, their optimizer states, a model's many biases).

A record of such a run is ``0x0A <length> 0x0A <name length> <name> <tail> <content>``, its tail
(TensorProto key and length, dims, dtype, content length) equal to its neighbours'. The walk
(``walk.RecordWalk._walk_repeats``) checks such records one at a time; after a few in a row it asks
here for the rest of the run in its window at once. Every place where the tail's bytes occur ahead
is found with a few numpy passes; a record starting where one tail's content ends is checked (framing,
name length, where its own tail lies, where it ends) for all of them at once, and the run is the
stretch of such records, each ending where the next begins. Names come out of one decode of all
of them. The checks are the walk's own, so the index is the one the walk would build; anything
unusual (a name given twice in a row, a name that is not UTF-8, a tail's bytes inside a name) ends
the run early and the walk goes on record by record.
"""

from __future__ import annotations

import sys
from array import array

import numpy as np

SEPARATOR = 0x12  # the first byte of every tail (TensorProto key): what the names are split on
LONG_RUN = 256  # records taken at once from which runs are looked for again as soon as usual


class TailPlaces:
    """Where one tail's bytes lie in ``window[lo:hi]``, and which of those places a record alike
    follows (a record reaching past `hi` is not one: the caller looks further if the run got there)."""

    def __init__(self, window, lo: int, hi: int, tail: bytes, clen: int):
        w = np.frombuffer(window, dtype=np.uint8)[:hi]
        size = hi
        self.step = len(tail) + clen  # from a tail's first byte to the end of its record
        found = w[lo:size - len(tail) + 1] == tail[0] if size - lo >= len(tail) else np.zeros(0, bool)
        places = np.flatnonzero(found) + lo
        for k in range(1, len(tail)):
            places = places[w[places + k] == tail[k]]
        self.places = places
        starts = places + self.step  # where a record alike would begin after each of them
        fits = starts + 3 < size  # the walk's own bound: a shorter remainder ends the run
        s = np.where(fits, starts, 0)
        b1, b2 = w[np.minimum(s + 1, size - 1)], w[np.minimum(s + 2, size - 1)]
        short = b1 < 0x80
        ok = fits & (w[s] == 0x0A) & (short | (b2 < 0x80))
        vlen = np.where(short, b1, (b1.astype(np.int64) & 0x7F) | (b2.astype(np.int64) << 7))
        v = s + np.where(short, 2, 3)
        end = v + vlen
        ok &= (end <= size) & (vlen >= 2)
        v = np.where(ok, v, 0)
        nlen = w[np.minimum(v + 1, size - 1)]
        ok &= (w[v] == 0x0A) & (nlen < 0x80)
        own_tail = v + 2 + nlen
        ok &= own_tail + self.step == end
        ok[:-1] &= own_tail[:-1] == places[1:]  # its tail is the very next place found
        if len(ok):
            ok[-1] = False
        self.bad = np.flatnonzero(~ok)  # places after which the run stops
        self.name_at = v + 2

    def run(self, prev_tail: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(record starts, name starts, tail places) of the records alike that follow the record
        whose tail lies at `prev_tail` (window offsets), up to the first that is not; None if none."""
        i = int(np.searchsorted(self.places, prev_tail))
        if i >= len(self.places) or self.places[i] != prev_tail:
            return None
        stop = int(self.bad[np.searchsorted(self.bad, i)])  # ok[-1] is False: always found
        if stop == i:
            return None
        return self.places[i:stop] + self.step, self.name_at[i:stop], self.places[i + 1:stop + 1]


def run_names(window, name_at: np.ndarray, tails: np.ndarray) -> list[str] | None:
    """The names of a run's records, decoded in one call; None where one is not UTF-8 or holds the
    byte the names are split on (the walk then takes those records one by one, and says which)."""
    if not len(tails):
        return []
    w = np.frombuffer(window, dtype=np.uint8)
    first, last = int(name_at[0]), int(tails[-1])
    marks = np.zeros(last - first + 2, dtype=np.int8)  # +1 where a name starts, -1 after its separator
    marks[name_at - first] = 1
    marks[tails - first + 1] = -1
    keep = np.cumsum(marks[:-1], dtype=np.int8) > 0
    joined = w[first:last + 1][keep].tobytes()  # each name followed by its tail's first byte
    if joined.count(SEPARATOR) != len(tails):
        return None
    try:
        return joined.decode("utf-8").split(chr(SEPARATOR))[:-1]
    except UnicodeDecodeError:
        return None


def take_run(walk, window, wstart: int, pos: int, typical: int, tail: tuple) -> tuple[int, int] | None:
    """Index the records alike that follow `pos` in `window` (which began at file offset `wstart`)
    as ``RecordWalk._walk_repeats`` would one by one; return the position and `typical` after them,
    or None where there is no run to take here (the walk goes on record by record).

    The window is searched from `pos` in spans that double while the run goes on, so a run costs
    passes over about its own bytes, and a short one (16 records of one shape, then 16 of another)
    little more than itself."""
    raw, clen = tail[0], tail[1]
    span, taken, count = max(4096, 64 * (len(raw) + clen + 24)), None, 0
    while True:
        lo = pos - wstart - len(raw) - clen  # the tail of the record before `pos`
        hi = min(len(window), lo + span)
        found = TailPlaces(window, lo, hi, raw, clen).run(lo)
        end = _add_run(walk, window, wstart, found, len(raw) + clen, tail) if found is not None else None
        if end is None:
            break
        count += len(found[0])
        for n in (found[2] + len(raw) + clen - found[0])[-64:].tolist():  # (3/4)**64: the rest weighs nothing
            typical = (3 * typical + n) >> 2
        pos = wstart + end
        taken = pos, typical
        if hi == len(window):
            break
        span *= 2
    # runs that end soon after they are noticed (a few records of each shape in turn) are not worth
    # the passes: wait for longer ones before asking again; a long run resets the wait
    walk._run_after = 0 if count >= LONG_RUN else min(2 * max(walk._run_after, 8), 1 << 16)
    return taken


def _add_run(walk, window, wstart: int, found: tuple, step: int, tail: tuple) -> int | None:
    """Add a run's records to the walk's columns; the window offset after them, or None where a
    name is not UTF-8 or given twice in a row (a chunk): those records are then walked one by one."""
    raw, clen, dtype, shape = tail
    starts, name_at, tails = found
    ends = tails + step
    names = run_names(window, name_at, tails)
    columns = walk._names
    if names is None or (columns and columns[-1] == names[0]) or any(map(str.__eq__, names[1:], names)):
        walk._no_runs_before = wstart + int(ends[-1])
        return None
    m = len(names)
    columns += map(sys.intern, names)
    walk._kind += bytes(m)
    walk._dtype += [dtype] * m
    walk._shape += [shape] * m
    offsets = tails + (wstart + len(raw))
    walk._off += array("q", offsets.astype(np.int64).tobytes())
    walk._len += array("q", [clen]) * m
    walk._rec += array("q", (starts + wstart).astype(np.int64).tobytes())
    walk._rlen += array("q", (ends - starts).astype(np.int64).tobytes())
    if walk._note is not None:
        for offset, name in zip(offsets.tolist(), names):
            walk._note(offset, clen, name, dtype, shape)
    return int(ends[-1])
