"""Reading safetensors files, plain and MindSpore-flavoured: the header is parsed and validated,
then tensors and boxes are served by positioned reads (see the package docstring).

A header may list hundreds of thousands of tensors (an expert per tensor): it is read a window
at a time into columns (names, dtypes, shapes shared between equal ones, offsets; see
``header_columns``), some 60 bytes a tensor; ``entries`` builds a tensor's ``TensorEntry`` when it is
asked for (as the `.ckpt` reader does). ``json.loads`` of a 63 MB header took 1 GB.
"""

from __future__ import annotations

import hashlib
import zlib
from array import array
from collections.abc import Mapping

import numpy as np

from reshard_job.errors import SafetensorsFormatError
from reshard_job.text import shorten
import reshard_job.core.dtypes as dtypes
from reshard_job.json_stream import JsonProblem, JsonStream
from reshard_job.core.tensor_meta import TensorMeta
from reshard_job.formats.index import shared_meta
from reshard_job.formats.tensorfile import PositionedReader, TensorEntry
from reshard_job.formats.crc32 import crc32_combine, hashed_as_count, scalar_crc_part
from reshard_job.formats.safetensors.header_columns import HeaderColumns
from reshard_job.formats.safetensors.header import CRC_KEY, FORMAT_KEY, INT4_MARK, MAX_HEADER_BYTES


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


class SafetensorsReader(HeaderColumns, PositionedReader):
    """Index of a safetensors file; serves tensors and boxes of tensors by positioned reads.

    ``entries`` maps names to TensorEntry in data-offset order; dtypes are MindSpore names
    ("BFloat16", "Float32", ..., "Int4" for names the metadata marks so). Each entry's ``extra``
    holds ``safetensors_dtype`` (the code in the file) and ``data_offsets``.
    """

    def __init__(self, source, *, verify_crc: bool = True, parsed: "SafetensorsReader | None" = None,
                 twins: dict | None = None):
        """`parsed`: a reader of the file opened earlier: its header is taken where the file is the same.
        `twins`: headers parsed from other files, by (length, file size, sha256 of the header): a
        file whose header is byte for byte one of them shares its columns (see ``_index``)."""
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
        self._metas: dict[int, object] = {}  # kind number -> its TensorMeta (``meta``)
        try:
            if not self._take_header(parsed):
                self._index(twins)
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
    def _index(self, twins: dict | None = None) -> None:
        """Read and check the header into the columns. Replicas (data parallel ranks, or ranks
        holding equal slices) have byte-identical headers: with `twins`, a header whose digest is
        there takes the columns parsed from the first (8 files of 300,000 tensors parsed one)."""
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
        key = None
        if twins is not None and getattr(self._file, "note_content", None) is None:
            key = (n, size, self._header_digest(n))
            if key in twins:
                self._share_columns(twins[key])
                return
        try:
            self._read_header(JsonStream(self._header_bytes(n), max_value=n + 1, object_pairs_hook=_unique))
        except JsonProblem as e:
            text = str(e)
            raise self._error(f"header is {text}" if text.startswith("not valid") else f"header: {text}") from None
        self._set_columns(size - 8 - n)
        if key is not None:
            twins[key] = self._columns()

    _COLUMNS = ("header_len", "_metadata", "_names", "_pos", "_begin", "_kind", "_kinds", "_kind_ids")

    def _columns(self) -> tuple:
        return tuple(getattr(self, column) for column in self._COLUMNS)

    def _share_columns(self, columns: tuple) -> None:
        for column, value in zip(self._COLUMNS, columns):
            setattr(self, column, value)  # shared: no reader changes them once parsed

    def _header_digest(self, n: int) -> bytes:
        digest, read = hashlib.sha256(), self._header_bytes(n)
        while block := read(1 << 20):
            digest.update(block)
        return digest.digest()

    def _take_header(self, parsed: "SafetensorsReader | None") -> bool:
        if (parsed is None or tuple(parsed.identity) != tuple(self.identity) or parsed.size != self.size
                or not parsed.identity or getattr(self._file, "note_content", None) is not None):
            return False  # (a file also being hashed is told where its tensors lie as they are parsed)
        self._share_columns(parsed._columns())
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

    def name_keys(self):
        """The names this file holds, as a dict's keys view (set operations run in C: the planner
        compares the names of every rank)."""
        return self._pos.keys()

    def same_entries(self, other) -> bool:
        """Whether `other` is a safetensors reader holding the same names, in the same order, with
        the same dtype, shape and size each (what ``describe`` tells), by whole columns."""
        if not isinstance(other, SafetensorsReader) or len(other._names) != len(self._names):
            return False
        if not (other._names is self._names or other._names == self._names):
            return False
        mine, theirs = [k[1:] for k in self._kinds], [k[1:] for k in other._kinds]
        if mine == theirs:
            return other._kind == self._kind
        return all(mine[a] == theirs[b] for a, b in zip(self._kind, other._kind))  # numbered otherwise

    def record_ranges(self, names: list[str]) -> np.ndarray | None:
        """(file offset, length) of each named tensor's data, straight from the columns, as an
        (n, 2) int64 array (the hash pass takes a million of them as a table); None unless every
        name is a tensor of plain data here (what ``whole_span`` serves)."""
        at = list(map(self._pos.get, names))
        if None in at:
            return None
        rows = np.array(at, np.int64)
        kinds = np.frombuffer(self._kind, np.uint32)[rows]
        if not all(_plain(self._kinds[k][1]) for k in np.unique(kinds).tolist()):
            return None
        sizes = np.array([k[3] for k in self._kinds], np.int64)[kinds]
        return np.stack([np.frombuffer(self._begin, np.int64)[rows] + self.data_start, sizes], axis=1)

    def meta(self, name: str) -> TensorMeta:
        """``describe`` as the shared ``TensorMeta``, made once per kind of tensor: the planner asks
        for every tensor's several times (600,000 tensors of a few kinds)."""
        kind = self._kind[self._pos[name]]
        meta = self._metas.get(kind)
        if meta is None:
            meta = self._metas[kind] = shared_meta(self.describe(name))
        return meta

    def describe(self, name: str) -> tuple[str, tuple[int, ...], str, int]:
        """(dtype, shape, kind, nbytes) of a tensor, from the columns (no entry built)."""
        _, dtype, shape, nbytes = self._kinds[self._kind[self._pos[name]]]
        return dtype, shape, "tensor", nbytes

    # --- CRC ----------------------------------------------------------------------------------
    def stored_crc(self) -> int | None:
        if not self.has_crc:
            return None
        text = self._metadata[CRC_KEY]
        if not (text.isascii() and text.isdigit()) or len(text) > 10 or int(text) > 0xFFFFFFFF:
            raise self._error(f"metadata {CRC_KEY} {shorten(repr(text), 80)} is not a CRC32 value")
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


def _plain(dtype: str) -> bool:
    """Whether a tensor of this dtype is stored as its plain little-endian elements."""
    dt = dtypes.BY_NAME.get(dtype)
    return dtype != INT4_MARK and dt is not None and dt.storage is not None
