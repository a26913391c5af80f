"""Reading safetensors files, plain and MindSpore-flavoured: the header is parsed and validated,
then tensors and boxes are served by positioned reads (see the package docstring).

A header may list hundreds of thousands of tensors (an expert per tensor): it is read a window
at a time (``json_stream.JsonStream``) into columns (names, dtypes, shapes shared between equal
ones, offsets), some 60 bytes a tensor; ``entries`` builds a tensor's ``TensorEntry`` when it is
asked for (as the `.ckpt` reader does). ``json.loads`` of a 63 MB header took 1 GB.
"""

from __future__ import annotations

import re
import sys
import zlib
from array import array
from collections.abc import Mapping
from math import prod

import numpy as np

from reshard_job.errors import SafetensorsFormatError
import reshard_job.core.dtypes as dtypes
from reshard_job.core.sizes import shape_problem
from reshard_job.json_stream import MATCHED, JsonProblem, JsonStream
from reshard_job.formats.tensorfile import PositionedReader, TensorEntry
from reshard_job.formats.crc32 import crc32_combine, hashed_as_count, scalar_crc_part
from reshard_job.formats.safetensors.header import CRC_KEY, FORMAT_KEY, INT4_MARK, MAX_HEADER_BYTES, METADATA_KEY


MAX_DIMS = 64  # numpy's limit on an array's dimensions (MindSpore's tensors have at most 8)
MAX_ENTRY_CHARS = 1 << 16  # a tensor's header entry: dtype, at most MAX_DIMS dims, two offsets
_INT = r"(?:0|[1-9][0-9]{0,17})"
# an entry as the safetensors library writes it, its name without escapes: parsed by this alone (a third
# of the time of the JSON scanner); anything else (other spacing or key order too) goes the careful way
_COMPACT = re.compile(rf'"([^"\\\x00-\x1f]*)":\{{"dtype":"([A-Za-z0-9_]{{1,32}})","shape":\[((?:{_INT}(?:,{_INT}){{0,{MAX_DIMS - 1}}})?)\],"data_offsets":\[({_INT}),({_INT})\]\}}')


def _brief(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:79] + "…"


class _Entries(Mapping):
    """The reader's entries by name, in file order, built from its columns on access."""

    __slots__ = ("_r", "_last")

    def __init__(self, reader: "SafetensorsReader"):
        self._r = reader
        self._last: tuple[str, TensorEntry] | None = None  # a tensor is often asked for several times in a row

    def __getitem__(self, name: str) -> TensorEntry:
        last = self._last
        if last is not None and last[0] == name:
            return last[1]
        entry = self._r._entry(self._r._pos[name])
        self._last = (name, entry)
        return entry

    def __contains__(self, name) -> bool:
        return name in self._r._pos

    def __iter__(self):
        return iter(self._r._names)

    def __len__(self) -> int:
        return len(self._r._names)


def _unique(pairs):
    """``object_pairs_hook``: a key given twice is an error (as the safetensors library says)."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise JsonProblem(f"key {twice[:80]!r} twice")
    return obj


class SafetensorsReader(PositionedReader):
    """Index of a safetensors file; serves tensors and boxes of tensors by positioned reads.

    ``entries`` maps names to TensorEntry in data-offset order; dtypes are MindSpore names
    ("BFloat16", "Float32", ..., "Int4" for names the metadata marks so). Each entry's ``extra``
    holds ``safetensors_dtype`` (the code in the file) and ``data_offsets``.
    """

    def __init__(self, source, *, verify_crc: bool = True, parsed: "SafetensorsReader | None" = None):
        """`parsed`: a reader of the file opened earlier: its header is taken where the file is the same."""
        super().__init__(source)
        self.header_len = 0
        self._metadata: dict[str, str] | None = None
        self._names: list[str] = []  # in file order
        self._pos: dict[str, int] = {}
        self._begin = array("q")  # data_offsets[0]
        # per tensor the number of its (code, MindSpore dtype name ("Int4" if marked), shape, nbytes)
        self._kind = array("I")
        self._kinds: list[tuple] = []
        self._kind_ids: dict[tuple, int] = {}
        try:
            if not self._take_header(parsed):
                self._index()
        except BaseException:
            self.close()
            raise
        self.entries = _Entries(self)
        if verify_crc and self.has_crc:
            self.verify_crc()

    def _error(self, problem: str) -> SafetensorsFormatError:
        return SafetensorsFormatError(self.path, problem)

    # --- header properties --------------------------------------------------------------------
    @property
    def metadata(self) -> dict[str, str]:
        """The ``__metadata__`` dict ({} when the file has none)."""
        return dict(self._metadata or {})

    @property
    def has_metadata(self) -> bool:
        return self._metadata is not None

    @property
    def has_crc(self) -> bool:
        return self._metadata is not None and CRC_KEY in self._metadata

    @property
    def is_mindspore(self) -> bool:
        return (self._metadata or {}).get(FORMAT_KEY) == "ms"

    @property
    def data_start(self) -> int:
        return 8 + self.header_len

    # --- indexing -----------------------------------------------------------------------------
    def _index(self) -> None:
        size = self.size
        if size == 0:
            raise self._error("empty file (0 bytes), expected a safetensors header")
        if size < 8:
            raise self._error(f"only {size} bytes, too short for the 8-byte header length (file truncated?)")
        n = int.from_bytes(self.pread(0, 8), "little")
        if n > MAX_HEADER_BYTES:
            raise self._error(
                f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit (not a safetensors file, or corrupt)"
            )
        if n > size - 8:
            raise self._error(f"header length {n} runs past the end of the {size}-byte file (file truncated?)")
        if n < 2:
            raise self._error(f"header length {n} is too short for a JSON object")
        self.header_len = n
        try:
            self._read_header(JsonStream(self._header_bytes(n), max_value=n + 1, object_pairs_hook=_unique))
        except JsonProblem as e:
            text = str(e)
            raise self._error(f"header is {text}" if text.startswith("not valid") else f"header: {text}") from None
        self._set_columns(size - 8 - n)

    def _take_header(self, parsed: "SafetensorsReader | None") -> bool:
        if (parsed is None or tuple(parsed.identity) != tuple(self.identity) or parsed.size != self.size
                or not parsed.identity or getattr(self._file, "note_content", None) is not None):
            return False  # (a file also being hashed is told where its tensors lie as they are parsed)
        for column in ("header_len", "_metadata", "_names", "_pos", "_begin", "_kind", "_kinds", "_kind_ids"):
            setattr(self, column, getattr(parsed, column))  # shared: neither reader changes them
        return True

    def _header_bytes(self, n: int):
        """``read(k)`` of the header's `n` bytes, front to back."""
        done = 0

        def read(k: int) -> bytes:
            nonlocal done
            k = min(k, n - done)
            if k <= 0:
                return b""
            data = self.pread(8 + done, k)
            done += k
            return data
        return read

    def _read_header(self, stream: JsonStream) -> None:
        """Every tensor's name, code, shape, begin and length into the columns, in header order
        (no row object per tensor: for 600,000 tensors those were 100 MiB at once); the metadata."""
        first = stream.peek()
        if first != "{":
            raise self._error(f"header is not a JSON object (it begins with {first[:1]!r}), expected an object")
        known, metadata = {}, False
        pos = self._pos  # name -> header position (file position once ``_set_columns`` has run)
        names, begins, kind_col = self._names, self._begin, self._kind
        bound = lambda k: MAX_HEADER_BYTES if k == METADATA_KEY else MAX_ENTRY_CHARS  # noqa: E731
        for name, info, m in stream.items(max_value=bound, pattern=_COMPACT):
            if name in pos or (name == METADATA_KEY and metadata):
                raise self._error(f"header has key {name[:80]!r} twice")
            if name == METADATA_KEY:
                self._metadata, metadata = (self._parse_metadata(_as_dict(m) if info is MATCHED else info), True)
                continue
            name = sys.intern(name)
            if info is MATCHED:
                begin, code, shape, nbytes = self._matched_tensor(name, m, known)
            else:
                begin, code, shape, nbytes = self._known_tensor(name, info, known) or self._parse_tensor(name, info, known)
            pos[name] = len(names)
            names.append(name)
            begins.append(begin)
            kind_col.append(self._kind_number((code, None, shape, nbytes)))
        stream.end()

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
            raise self._error(f"{where}: shape {_brief(shape)} is not a list of non-negative integers")
        if len(shape) > MAX_DIMS:
            raise self._error(f"{where}: shape has {len(shape)} dims, more than the {MAX_DIMS} any array can have")
        problem = shape_problem(shape, dt.itemsize)
        if problem:
            raise self._error(f"{where}: shape {_brief(shape)} cannot be kept: {problem}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int and o >= 0 for o in offsets)
        ):
            raise self._error(f"{where}: data_offsets {_brief(offsets)} is not a pair of non-negative integers")
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

    def _set_columns(self, data_size: int) -> None:
        """The columns put in file order, checked to tile the data section exactly; the dtypes."""
        sizes = np.array([k[3] for k in self._kinds], np.int64)
        begin = np.frombuffer(self._begin, np.int64)
        end = begin + sizes[np.frombuffer(self._kind, np.uint32)]
        later = (begin[1:] > begin[:-1]) | ((begin[1:] == begin[:-1]) & (end[1:] >= end[:-1]))
        if not later.all():  # stable: equal offsets (empty tensors) keep header order
            order = np.argsort(end, kind="stable")
            order = order[np.argsort(begin[order], kind="stable")]
            self._permute(order)
            begin = np.frombuffer(self._begin, np.int64)
            end = begin + sizes[np.frombuffer(self._kind, np.uint32)]
        self._check_tiling(begin, end, data_size)
        # each kind's MindSpore dtype name; qint4x2: validated under its stored code (I8, one byte
        # per element), typed Int4 again where the metadata marks the tensor
        self._kinds = [(code, dtypes.from_safetensors(code).name, shape, n) for code, _, shape, n in self._kinds]
        self._kind_ids = {kind: i for i, kind in enumerate(self._kinds)}
        marks = self._metadata or {}
        for i, name in enumerate(self._names) if marks else ():
            if marks.get(name) == INT4_MARK:
                code, _, shape, n = self._kinds[self._kind[i]]
                self._kind[i] = self._kind_number((code, INT4_MARK, shape, n))
        note = getattr(self._file, "note_content", None)  # a file also being hashed: where tensors lie
        if note is not None:
            for at, stop, name, kind in zip(begin.tolist(), end.tolist(), self._names, self._kind):
                note(self.data_start + at, stop - at, name, self._kinds[kind][1], self._kinds[kind][2])

    def _permute(self, order: np.ndarray) -> None:
        self._names = [self._names[i] for i in order.tolist()]
        self._begin = array("q", np.frombuffer(self._begin, np.int64)[order].tobytes())
        self._kind = array("I", np.frombuffer(self._kind, np.uint32)[order].tobytes())
        self._pos = {name: i for i, name in enumerate(self._names)}

    def _check_tiling(self, begin, end, data_size: int) -> None:
        """Tensors in file order must follow one another from byte 0 to the data section's end."""
        before = np.concatenate(([0], end[:-1]))
        bad = np.flatnonzero((end > data_size) | (begin != before))
        if len(bad):
            i = int(bad[0])
            at, to, name, pos = int(begin[i]), int(end[i]), self._names[i], int(before[i])
            if to > data_size:
                raise self._error(f"tensor {name!r}: data_offsets [{at}, {to}] run past the {data_size}-byte "
                                  f"data section (file truncated?)")
            if at < pos:
                raise self._error(f"tensor {name!r}: data_offsets [{at}, {to}] overlap the previous tensor")
            raise self._error(f"tensor {name!r}: data_offsets [{at}, {to}] leave a gap after byte {pos} "
                              f"(offsets must be contiguous)")
        pos = int(end[-1]) if len(end) else 0
        if pos != data_size:
            raise self._error(f"{data_size - pos} bytes after the last tensor's data (offsets end at {pos})")

    def _entry(self, i: int) -> TensorEntry:
        (code, dtype, shape, nbytes), begin = self._kinds[self._kind[i]], self._begin[i]
        extra = {"safetensors_dtype": code, "data_offsets": (begin, begin + nbytes)}
        dt = dtypes.from_safetensors(code)
        if dtype != INT4_MARK and dt.name not in dtypes.BY_NAME:  # codes MindSpore has no name for (F8_*)
            extra["storage"] = dt.storage
        return TensorEntry(self._names[i], dtype, shape, nbytes, [(self.data_start + begin, nbytes)],
                           extra=extra).finish()

    def new_entry(self, name: str) -> TensorEntry:
        """A tensor's entry made for the caller alone (``entries`` may hand out one it made before)."""
        return self._entry(self._pos[name])

    def whole_span(self, name: str) -> tuple[str, tuple[int, ...], int, int] | None:
        """(dtype, shape, file offset, length) of a tensor of plain data, straight from the columns
        (no entry built: the many-small-parameters path reads through this); None for anything
        else (absent, int4-packed, a dtype MindSpore has no name for), read through its entry."""
        i = self._pos.get(name)
        if i is None:
            return None
        _, dtype, shape, nbytes = self._kinds[self._kind[i]]
        return (dtype, shape, self.data_start + self._begin[i], nbytes) if _plain(dtype) else None

    def whole_spans(self, names: list[str]) -> list[tuple | None]:
        """``whole_span`` of each name, the column lookups done for all at once."""
        at = list(map(self._pos.get, names))
        if None in at:
            return list(map(self.whole_span, names))
        kinds = list(map(self._kinds.__getitem__, map(self._kind.__getitem__, at)))
        if not all(_plain(k[1]) for k in set(kinds)):
            return list(map(self.whole_span, names))
        start = self.data_start
        return [(dtype, shape, start + begin, nbytes) for (_, dtype, shape, nbytes), begin in
                zip(kinds, map(self._begin.__getitem__, at))]

    def describe(self, name: str) -> tuple[str, tuple[int, ...], str, int]:
        """(dtype, shape, kind, nbytes) of a tensor, from the columns (no entry built)."""
        _, dtype, shape, nbytes = self._kinds[self._kind[self._pos[name]]]
        return dtype, shape, "tensor", nbytes

    # --- CRC ----------------------------------------------------------------------------------
    def stored_crc(self) -> int | None:
        if not self.has_crc:
            return None
        text = self._metadata[CRC_KEY]
        if not (text.isascii() and text.isdigit()) or int(text) > 0xFFFFFFFF:
            raise self._error(f"metadata {CRC_KEY} {text!r} is not a CRC32 value")
        return int(text)

    def scalar_crc_parts(self) -> dict[str, tuple[int, int]]:
        """name -> (crc32, length) of what crc_num hashes for each 0-d integer tensor: its value
        as a count of zero bytes (see ``formats.crc32``); refuses a value MindSpore cannot hash."""
        out = {}
        for name, number in zip(self._names, self._kind):
            code, _, shape, _ = self._kinds[number]
            if hashed_as_count(code, shape):
                try:
                    out[name] = scalar_crc_part(code, self.read_raw(name))
                except ValueError as e:
                    raise self._error(f"tensor {name!r}: {CRC_KEY} cannot be checked: {e}") from None
        return out

    def compute_crc(self) -> int:
        """MindSpore's crc_num over the tensors: sorted names, each name then ``bytes()`` of its array."""
        scalars = self.scalar_crc_parts()
        crc = 0
        for name in sorted(self.entries):
            crc = zlib.crc32(name.encode("utf-8"), crc)
            if name in scalars:
                crc = crc32_combine(crc, *scalars[name])
                continue
            for block in self.iter_content(name):
                crc = zlib.crc32(block, crc)
        return crc

    def verify_crc(self) -> None:
        """Check ``crc_num`` against the data; raise naming the file on mismatch."""
        stored = self.stored_crc()
        if stored is None:
            return
        computed = self.compute_crc()
        if computed != stored:
            raise self._error(
                f"CRC32 mismatch: metadata {CRC_KEY} says {stored}, the tensors give {computed} "
                f"(file corrupted, or metadata copied from another file)"
            )

    # --- typed reads --------------------------------------------------------------------------
    def _storage(self, entry: TensorEntry) -> np.dtype:
        storage = entry.extra.get("storage")
        if storage is not None:
            return storage
        return super()._storage(entry)


def _as_dict(m: re.Match) -> dict:
    """The header entry ``_COMPACT`` matched, as ``json`` would have made it."""
    return {"dtype": m[2], "shape": [int(d) for d in m[3].split(",")] if m[3] else [],
            "data_offsets": [int(m[4]), int(m[5])]}


def _plain(dtype: str) -> bool:
    """Whether a tensor of this dtype is stored as its plain little-endian elements."""
    dt = dtypes.BY_NAME.get(dtype)
    return dtype != INT4_MARK and dt is not None and dt.storage is not None
