"""A safetensors header read into columns: every tensor's name, dtype code, shape, begin and length,
in header order, with no object per tensor (for 600,000 tensors those were 100 MiB at once), and
its ``__metadata__``; every entry checked (``HeaderColumns``, the reading half of
``SafetensorsReader``).

Entries as the safetensors library writes them (compact, keys in its order, a name without escapes)
are read by one regular expression, many at a time (``JsonStream.items(runs=True)``); anything else
goes through the JSON scanner and the careful checks.
"""

from __future__ import annotations

import re
import sys
from math import prod

import reshard_job.core.dtypes as dtypes
from reshard_job.core.sizes import shape_problem
from reshard_job.formats.safetensors.header import MAX_HEADER_BYTES, METADATA_KEY
from reshard_job.json_stream import MATCHED, MATCHED_RUN, JsonStream

MAX_DIMS = 64  # numpy's limit on an array's dimensions (MindSpore's tensors have at most 8)
MAX_ENTRY_CHARS = 1 << 16  # a tensor's header entry: dtype, at most MAX_DIMS dims, two offsets
_INT = r"(?:0|[1-9][0-9]{0,17})"
# an entry as the safetensors library writes it, its name without escapes: parsed by this alone (a third
# of the time of the JSON scanner); anything else (other spacing or key order too) goes the careful way
_COMPACT = re.compile(rf'"([^"\\\x00-\x1f]*)":\{{"dtype":"([A-Za-z0-9_]{{1,32}})","shape":\[((?:{_INT}(?:,{_INT}){{0,{MAX_DIMS - 1}}})?)\],"data_offsets":\[({_INT}),({_INT})\]\}}')


BEYOND_ANY_FILE = 1 << 63  # a file position no file reaches (nor an int64 column holds)


def brief(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:79] + "…"


class HeaderColumns:
    """The header's columns, filled by ``_read_header`` (the reader supplies ``_error`` and the
    columns: ``_pos``, ``_names``, ``_begin``, ``_kind``, ``_kinds``, ``_kind_ids``, ``_metadata``)."""

    def _read_header(self, stream: JsonStream) -> None:
        """Every tensor's name, code, shape, begin and length into the columns; the metadata."""
        first = stream.peek()
        if first != "{":
            raise self._error(f"header is not a JSON object (it begins with {first[:1]!r}), expected an object")
        known, numbers, metadata = {}, {}, False
        bound = lambda k: MAX_HEADER_BYTES if k == METADATA_KEY else MAX_ENTRY_CHARS  # noqa: E731
        for name, info, m in stream.items(max_value=bound, pattern=_COMPACT, runs=True):
            if info is not MATCHED_RUN:
                metadata = self._take_entry(name, info, m, known, metadata)
            elif not self._take_rows(name, known, numbers):  # `name`: the groups of many entries
                for row in name:
                    metadata = self._take_entry(row[0], MATCHED, ("", *row), known, metadata)
        stream.end()

    def _take_entry(self, name: str, info, m, known: dict, metadata: bool) -> bool:
        """One header entry into the columns (or the metadata); whether the metadata has been read."""
        if name in self._pos or (name == METADATA_KEY and metadata):
            raise self._error(f"header has key {name[:80]!r} twice")
        if name == METADATA_KEY:
            self._metadata = self._parse_metadata(_as_dict(m) if info is MATCHED else info)
            return True
        name = sys.intern(name)
        if info is MATCHED:
            begin, code, shape, nbytes = self._matched_tensor(name, m, known)
        else:
            begin, code, shape, nbytes = self._known_tensor(name, info, known) or self._parse_tensor(name, info, known)
        if begin >= BEYOND_ANY_FILE:  # (the column is of int64; the file's size refuses what is below this)
            raise self._error(f"tensor {name[:80]!r}: data_offsets begin at {brief(begin)}, beyond any file")
        self._pos[name] = len(self._names)  # name -> header position (file position once ``_set_columns`` ran)
        self._names.append(name)
        self._begin.append(begin)
        self._kind.append(self._kind_number((code, None, shape, nbytes)))
        return metadata

    def _take_rows(self, rows: list[tuple], known: dict, numbers: dict) -> bool:
        """Entries ``_COMPACT`` matched (their groups), all at once where each is a tensor of a new
        name and of a dtype and shape met before, with the length they give; else False, nothing taken."""
        names = [sys.intern(row[0]) for row in rows]
        kinds = [known.get(row[1:3]) for row in rows]
        if (None in kinds or METADATA_KEY in names or not self._pos.keys().isdisjoint(names)
                or len(set(names)) != len(names)):
            return False
        begins = list(map(int, (row[3] for row in rows)))
        if max(begins) >= BEYOND_ANY_FILE:
            return False  # (taken one at a time, which names the entry)
        if any(int(row[4]) - begin != kind[2] for row, begin, kind in zip(rows, begins, kinds)):
            return False
        base = len(self._names)
        self._pos.update(zip(names, range(base, base + len(names))))
        self._names.extend(names)
        self._begin.extend(begins)
        for row, kind in zip(rows, kinds):
            if row[1:3] not in numbers:
                numbers[row[1:3]] = self._kind_number((kind[0], None, kind[1], kind[2]))
        self._kind.extend([numbers[row[1:3]] for row in rows])
        return True

    def _kind_number(self, kind: tuple) -> int:
        number = self._kind_ids.get(kind)
        if number is None:
            number = self._kind_ids[kind] = len(self._kinds)
            self._kinds.append(kind)
        return number

    def _matched_tensor(self, name: str, m: re.Match, known: dict) -> tuple:
        """``_parse_tensor`` of an entry ``_COMPACT`` matched: its dtype and shape text parsed once."""
        begin, end = int(m[4]), int(m[5])
        facts = known.get((m[2], m[3]))
        if facts is None or end - begin != facts[2]:
            facts = known[(m[2], m[3])] = self._parse_tensor(name, _as_dict(m), known)[1:]
        return (begin, *facts)

    def _known_tensor(self, name: str, info, known: dict) -> tuple | None:
        """``_parse_tensor`` of an entry whose dtype and shape an earlier one had (most do), or None."""
        try:
            shape, (begin, end) = info["shape"], info["data_offsets"]
            code, shape, nbytes = known[(info["dtype"], tuple(shape))]
        except (KeyError, TypeError, ValueError):
            return None
        if len(info) != 3 or type(begin) is not int or type(end) is not int or begin < 0 or end - begin != nbytes:
            return None
        self._check_text(name, "tensor name")
        return begin, code, shape, nbytes

    def _parse_metadata(self, meta) -> dict[str, str] | None:
        if meta is None:
            return None
        if not isinstance(meta, dict):
            raise self._error(f"{METADATA_KEY} is {type(meta).__name__}, expected an object of strings")
        for k, v in meta.items():
            if not isinstance(v, str):
                raise self._error(f"{METADATA_KEY} value of {k!r} is {type(v).__name__}, expected a string")
            self._check_text(k, "metadata key")
            self._check_text(v, f"metadata value of {k!r}")
        return meta

    def _check_text(self, s: str, what: str) -> None:
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate escape such as "\ud800"
            raise self._error(f"{what} {s!r} is not valid Unicode") from None

    def _parse_tensor(self, name: str, info, known: dict) -> tuple:
        """(begin, code, shape, nbytes) of one header entry, checked."""
        self._check_text(name, "tensor name")
        where = f"tensor {name!r}"
        if not isinstance(info, dict):
            raise self._error(f"{where}: header entry is {type(info).__name__}, expected an object")
        missing = [k for k in ("dtype", "shape", "data_offsets") if k not in info]
        if missing:
            raise self._error(f"{where}: header entry lacks {', '.join(missing)}")
        code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(code, str):
            raise self._error(f"{where}: dtype is {type(code).__name__}, expected a string")
        try:
            dt = dtypes.from_safetensors(code)
        except KeyError:
            raise self._error(f"{where}: unknown dtype {code[:40]!r}") from None
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise self._error(f"{where}: shape {brief(shape)} is not a list of non-negative integers")
        if len(shape) > MAX_DIMS:
            raise self._error(f"{where}: shape has {len(shape)} dims, more than the {MAX_DIMS} any array can have")
        problem = shape_problem(shape, dt.itemsize)
        if problem:
            raise self._error(f"{where}: shape {brief(shape)} cannot be kept: {problem}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int and o >= 0 for o in offsets)
        ):
            raise self._error(f"{where}: data_offsets {brief(offsets)} is not a pair of non-negative integers")
        begin, end = offsets
        if end < begin:
            raise self._error(f"{where}: data_offsets [{begin}, {end}] end before they begin")
        want = prod(shape) * dt.itemsize
        if end - begin != want:
            raise self._error(
                f"{where}: data_offsets [{begin}, {end}] hold {end - begin} bytes, "
                f"but shape {shape} of {code} needs {want}"
            )
        shape = tuple(shape)
        known[(code, shape)] = (sys.intern(code), shape, want)
        return begin, sys.intern(code), shape, want


def _as_dict(m: re.Match) -> dict:
    """The header entry ``_COMPACT`` matched, as ``json`` would have made it."""
    return {"dtype": m[2], "shape": [int(d) for d in m[3].split(",")] if m[3] else [],
            "data_offsets": [int(m[4]), int(m[5])]}
