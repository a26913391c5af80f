"""Reading a `.ckpt` file: a record-by-record index, then tensors and boxes by positioned reads.

The reader walks the records once, noting where each tensor's bytes lie, and then serves tensors or
boxes of them with positioned reads: nothing is loaded that is not asked for, and files over 2 GiB
need no special protobuf backend. The walk itself (how records group into tensors, how it reads
only about the headers' bytes) is ``reshard_job.formats.ckpt.walk``.
"""

from __future__ import annotations

import sys
import threading
import zlib
from array import array
from collections.abc import Mapping
from math import prod

import numpy as np

from reshard_job.errors import CheckpointFormatError
import reshard_job.core.dtypes as dtypes
from reshard_job.formats.tensorfile import KIND_MAP, KIND_STR, KIND_TENSOR, PositionedReader, TensorEntry
from reshard_job.formats.ckpt.records import CRC_TRAILER_LEN, Record
from reshard_job.core.sizes import shape_problem
from reshard_job.formats.ckpt.walk import HEAD, KINDS, RecordWalk, intern_shape, positions
from reshard_job.text import quoted

INDEX_FORMAT = 1  # of ``CheckpointReader.index_document``: a change makes cached documents unused
_SHARED_NAMES: list = []  # (names, positions) of recently indexed files, shared when equal
_SHAREABLE = ("_kind", "_dtype", "_shape", "_off", "_len", "_rec", "_rlen")
_SHARED_COLUMNS: list[dict] = []  # those columns of recently indexed files, shared when equal
_SHARING = threading.Lock()  # remote files are indexed in threads (SourceFiles.open_all)


_SPAN_SHAPES: dict[tuple, tuple | None] = {}  # (dtype, dims, stored bytes) -> shape read as, or None
_UNSET = object()


def _span_shape(dtype: str, dims: tuple, stored: int) -> tuple | None:
    """The shape a one-record tensor of these dims and stored bytes is read as (dims [0] holding
    one element is a scalar, as MindSpore reads it); None unless it is plain sliceable data."""
    dt = dtypes.BY_NAME.get(dtype)
    if dt is None or dt.storage is None or any(d < 0 for d in dims):
        return None
    if dims == (0,) and stored and dt.itemsize == stored:
        dims = ()
    return dims if prod(dims) * dt.itemsize == stored else None


def _known_record(r: list, size: int) -> Record:
    """A Record from an index document's list, or ValueError where it cannot be one of this file."""
    offset, length, dims, dtype, c_off, c_len = r
    if not (isinstance(dtype, str) and all(isinstance(x, int) for x in (offset, length, c_off, c_len, *dims))
            and 0 <= offset and offset + length <= size and 0 <= c_off and c_off + c_len <= size and c_len >= 0):
        raise ValueError("not a record of this file")
    return Record(offset, length, tuple(dims), dtype, c_off, c_len)


class _Entries(Mapping):
    """The reader's entries by name (file order of last occurrence), built on access."""

    def __init__(self, reader: "CheckpointReader"):
        self._r = reader

    def __getitem__(self, name: str) -> TensorEntry:
        return self._r._entry(self._r._pos[name])

    def __contains__(self, name) -> bool:
        return name in self._r._pos

    def keys(self):
        return self._r._pos.keys()  # a dict's: set operations on it run in C (a million names)

    def __iter__(self):
        return iter(self._r._pos)

    def __len__(self) -> int:
        return len(self._r._pos)


class CheckpointReader(RecordWalk, PositionedReader):
    """Index of a `.ckpt` file; serves tensors and boxes of tensors by positioned reads.

    ``entries`` maps each parameter name to its TensorEntry, in file order; ``groups`` yields every
    group of records in file order (needed to rewrite a file exactly). `source` is a path or an open
    ``storage.RandomAccess``.
    """

    def __init__(self, source, *, verify_crc: bool = True, known_index: dict | None = None):
        super().__init__(source)
        self.crc_stored: int | None = None
        self.walked = True  # False where the index came from `known_index` (see ``_index``)
        self._names: list[str] = []  # group names, in file order
        self._kind = bytearray()
        self._dtype: list[str] = []
        self._shape: list[tuple] = []
        self._off = array("q")  # content offset (first record)
        self._len = array("q")  # content length (all records)
        self._rec = array("q")  # record offset (first record)
        self._rlen = array("q")  # record length (first record)
        self._multi: dict[int, tuple] = {}  # group -> its Records (several chunks) or map parts
        self._pos: dict[str, int] = {}
        self._head = HEAD
        # a file read front to back for its digests too wants to know where tensor bytes lie
        # (``sources.file_digests.DigestingReader.note_content``)
        self._note = getattr(self._file, "note_content", None)
        try:
            self._index(known_index)
        except BaseException:
            self.close()
            raise
        self.entries = _Entries(self)
        if verify_crc and self.crc_stored is not None:
            self.verify_crc()

    def _error(self, problem: str) -> CheckpointFormatError:
        return CheckpointFormatError(self.path, problem)

    @property
    def has_crc(self) -> bool:
        return self.crc_stored is not None

    # --- indexing -----------------------------------------------------------------------------
    def _index(self, known: dict | None = None) -> None:
        """Walk the records, or take `known` (``index_document`` of these very bytes, from
        ``index_cache``) where it fits the file; either way the columns are then checked."""
        if self.size == 0:
            raise self._error("empty file (0 bytes), expected MindSpore checkpoint records")
        self.walked = known is None or not self._load_index(known)
        if self.walked:
            self._walk()
        self._validate()
        self._share_columns()

    def index_document(self) -> dict:
        """The index as plain JSON values: given back as ``known_index`` for the same bytes, the
        reader is ready without walking them (``index_cache``)."""
        def rec(r: Record) -> list:
            return [r.offset, r.length, list(r.dims), r.dtype, r.content_offset, r.content_len]

        multi = [[i, [[rec(r) for r in part] for part in v] if self._kind[i] == 2 else [rec(r) for r in v]]
                 for i, v in self._multi.items()]
        return {"format": INDEX_FORMAT, "size": self.size, "crc": self.crc_stored, "names": list(self._names),
                "kind": list(self._kind), "dtype": list(self._dtype), "shape": [list(d) for d in self._shape],
                "off": self._off.tolist(), "len": self._len.tolist(), "rec": self._rec.tolist(),
                "rlen": self._rlen.tolist(), "multi": multi}

    def _load_index(self, doc: dict) -> bool:
        """Take the columns of an ``index_document``; False (nothing taken) where it does not fit this
        file: another format version or size, columns of unequal length, a value of the wrong type,
        a byte range outside the file. Its dtypes and sizes are then checked as a walk's are."""
        size = self.size
        try:
            if doc.get("format") != INDEX_FORMAT or doc.get("size") != size:
                return False
            names = [sys.intern(n) for n in doc["names"]]  # (TypeError for anything but text)
            n = len(names)
            kinds = bytearray(doc["kind"])
            dtype_col = [sys.intern(d) for d in doc["dtype"]]
            shape_col = [intern_shape(tuple(d)) for d in doc["shape"]]
            cols = [array("q", doc[k]) for k in ("off", "len", "rec", "rlen")]
            if any(len(c) != n for c in (kinds, dtype_col, shape_col, *cols)) or any(k > 2 for k in kinds):
                return False
            if not all(isinstance(x, int) for d in shape_col for x in d):
                return False
            off, length, rec, rlen = cols
            if n and (min(min(off), min(length), min(rec), min(rlen)) < 0
                      or max(map(int.__add__, off, length)) > size or max(map(int.__add__, rec, rlen)) > size):
                return False
            multi: dict[int, tuple] = {}
            for i, v in doc["multi"]:
                if not 0 <= i < n:
                    return False
                if kinds[i] == 2:
                    multi[i] = tuple([_known_record(r, size) for r in part] for part in v)
                else:
                    multi[i] = tuple(_known_record(r, size) for r in v)
            crc = doc["crc"]
            if crc is not None and not isinstance(crc, int):
                return False
        except (KeyError, TypeError, ValueError, OverflowError):
            return False
        self._names, self._kind, self._dtype, self._shape = names, kinds, dtype_col, shape_col
        self._off, self._len, self._rec, self._rlen = off, length, rec, rlen
        self._multi = multi
        self.crc_stored = crc
        return True

    def _validate(self) -> None:
        """Every tensor's dtype known and its data the size its dims say, checked at open (cheaply,
        from the columns), so a bad file is refused before anything is planned from it."""
        by_name = dtypes.BY_NAME
        # most tensors share dtype, dims and size: each combination is checked once (the set is
        # made in C), and only where one is bad are the entries looked at one by one, in file order
        bad = set()
        for key in set(zip(self._kind, self._dtype, self._shape, self._len)):
            kind, dtype, dims, stored = key
            if kind == 1:
                if stored % 4:
                    bad.add(key)
            elif kind == 0:  # a map's parts were checked while parsing
                dt = by_name.get(dtype)
                if dt is None or dt.storage is None or shape_problem(dims, dt.itemsize) or (
                        stored != prod(dims) * dt.itemsize and not (dims == (0,) and stored == dt.itemsize)):
                    bad.add(key)
        if not bad:
            return
        for i, key in enumerate(zip(self._kind, self._dtype, self._shape, self._len)):
            if key in bad:
                if key[0] == 1:
                    raise self._error(f"parameter {self._names[i]!r}: str content of {key[3]} bytes is not UTF-32")
                self._entry(i)  # the detailed error

    def _share_columns(self) -> None:
        """Files of the ranks of one stage hold the same names in the same order, mostly with the
        same dtypes, shapes and sizes (and so the same offsets): equal columns are kept once, shared
        by every reader that has them (none is changed once the file is indexed)."""
        with _SHARING:
            self._share_columns_locked()

    def _share_columns_locked(self) -> None:
        for names, pos in _SHARED_NAMES:  # (equal names: equal positions, not made again)
            if len(names) == len(self._names) and names == self._names:
                self._names, self._pos = names, pos
                break
        else:
            self._pos = positions(self._names)
            _SHARED_NAMES.insert(0, (self._names, self._pos))
            del _SHARED_NAMES[4:]
        for attr in _SHAREABLE:
            mine = getattr(self, attr)
            for columns in _SHARED_COLUMNS:
                theirs = columns[attr]
                if theirs is not mine and len(theirs) == len(mine) and theirs == mine:
                    setattr(self, attr, theirs)
                    break
        _SHARED_COLUMNS.insert(0, {attr: getattr(self, attr) for attr in _SHAREABLE})
        del _SHARED_COLUMNS[4:]

    # --- entries ------------------------------------------------------------------------------
    def _entry(self, i: int) -> TensorEntry:
        """The TensorEntry of group `i`, checked (a bad dtype or size is an error only when used)."""
        name, kind = self._names[i], KINDS[self._kind[i]]
        if kind == KIND_MAP:
            parts = self._multi[i]
            pieces = [(p.content_offset, p.content_len) for rec in parts for p in rec]
            return TensorEntry(name, "map", (), self._len[i], pieces, KIND_MAP, extra=parts).finish()
        recs = self._multi.get(i)
        pieces = [(r.content_offset, r.content_len) for r in recs] if recs else [(self._off[i], self._len[i])]
        extra = recs or (self._first_record(i),)
        return self._tensor_entry(name, self._dtype[i], self._shape[i], self._len[i], pieces, extra)

    def _tensor_entry(self, tag: str, dtype: str, dims: tuple, stored: int, pieces, extra) -> TensorEntry:
        if dtype == dtypes.STR_TYPE:
            if stored % 4:
                raise self._error(f"parameter {quoted(tag)}: str content of {stored} bytes is not UTF-32")
            return TensorEntry(tag, dtypes.STR_TYPE, (), stored, pieces, KIND_STR, extra=extra).finish()
        if dtype not in dtypes.BY_NAME:
            raise self._error(f"parameter {quoted(tag)}: unknown dtype {dtype!r}")
        if any(d < 0 for d in dims):
            raise self._error(f"parameter {quoted(tag)}: negative dimension in dims {list(dims)}")
        dt = dtypes.BY_NAME[dtype]
        problem = shape_problem(dims, dt.itemsize if dt.storage is not None else 1)
        if problem:  # e.g. zero-size dims beside 2**62: no array can have them, whatever the data size
            raise self._error(f"parameter {quoted(tag)}: dims {_brief_dims(dims)}: {problem}")
        shape = dims
        want = prod(shape) * dt.itemsize
        if shape == (0,) and stored == dt.itemsize:
            shape, want = (), dt.itemsize  # MindSpore reads dims [0] as a scalar
        if stored != want:
            raise self._error(f"parameter {quoted(tag)}: {stored} bytes of data but dims {list(dims)} of {dtype} need {want}")
        return TensorEntry(tag, dtype, shape, stored, pieces, KIND_TENSOR, extra=extra).finish()

    def describe(self, name: str) -> tuple[str, tuple[int, ...], str, int]:
        """(dtype, shape, kind, nbytes) from the columns (checked at open), no TensorEntry built."""
        i = self._pos[name]
        kind = KINDS[self._kind[i]]
        if kind != KIND_TENSOR:
            return self._dtype[i], (), kind, self._len[i]
        shape = self._shape[i]
        if shape == (0,) and self._len[i] and self._dtype[i] in dtypes.BY_NAME \
                and dtypes.BY_NAME[self._dtype[i]].itemsize == self._len[i]:
            shape = ()  # MindSpore reads dims [0] as a scalar
        return self._dtype[i], shape, kind, self._len[i]

    def name_keys(self):
        """The names this file holds, as a dict's keys view (set operations run in C)."""
        return self._pos.keys()

    def same_entries(self, other) -> bool:
        """Whether `other` is a checkpoint reader holding the same names, in the same order, with
        the same kind, dtype, shape and size each (what ``describe`` tells), by whole columns."""
        if not isinstance(other, CheckpointReader) or len(other._names) != len(self._names):
            return False
        return ((other._names is self._names or other._names == self._names) and other._kind == self._kind
                and other._dtype == self._dtype and other._shape == self._shape and other._len == self._len)

    def whole_span(self, name: str) -> tuple[str, tuple[int, ...], int, int] | None:
        """(dtype, shape, offset, length) of a tensor stored in one record, straight from the
        index columns (no TensorEntry built: the many-small-parameters path reads through this);
        None for anything else, which is read, and refused where bad, through its entry."""
        i = self._pos.get(name)
        if i is None or self._kind[i] or i in self._multi:  # kind 0: a tensor
            return None
        key = (self._dtype[i], self._shape[i], self._len[i])
        shape = _SPAN_SHAPES.get(key, _UNSET)
        if shape is _UNSET:
            shape = _span_shape(*key)
            if len(_SPAN_SHAPES) < 100_000:
                _SPAN_SHAPES[key] = shape
        if shape is None:
            return None
        return key[0], shape, self._off[i], key[2]

    def whole_spans(self, names: list[str]) -> list[tuple | None]:
        """``whole_span`` of each name, the column lookups done for all at once (a run of small
        tensors of one dtype and shape costs a few C-level passes, not a call each)."""
        at = list(map(self._pos.get, names))
        if None in at or any(map(self._kind.__getitem__, at)) or (self._multi and not self._multi.keys().isdisjoint(at)):
            return list(map(self.whole_span, names))
        keys = list(zip(map(self._dtype.__getitem__, at), map(self._shape.__getitem__, at),
                        map(self._len.__getitem__, at)))
        shapes = {key: _SPAN_SHAPES.get(key, _UNSET) for key in set(keys)}
        shapes = {key: _span_shape(*key) if shape is _UNSET else shape for key, shape in shapes.items()}
        if None in shapes.values():
            return list(map(self.whole_span, names))
        offsets = map(self._off.__getitem__, at)
        if len(shapes) == 1:  # a run of one dtype and shape: no lookup each
            (dtype, _, nbytes), shape = next(iter(shapes.items()))
            return [(dtype, shape, off, nbytes) for off in offsets]
        return [(key[0], shapes[key], off, key[2]) for key, off in zip(keys, offsets)]

    def record_ranges(self, names: list[str]) -> np.ndarray | None:
        """(offset, length) of the one record of each named tensor, straight from the index columns,
        as an (n, 2) int64 array; None unless every name is a tensor stored in one record."""
        at = list(map(self._pos.get, names))
        if None in at or any(map(self._kind.__getitem__, at)) or not self._multi.keys().isdisjoint(at):
            return None
        rows = np.array(at, dtype=np.int64)
        return np.stack([np.frombuffer(self._off, np.int64)[rows], np.frombuffer(self._len, np.int64)[rows]], axis=1)

    def names(self) -> list[str]:
        return list(self._pos)

    @property
    def groups(self):
        """Every group of records in file order (a name that appears again is a group of its own)."""
        return (self._entry(i) for i in range(len(self._names)))

    def check_entries(self) -> None:
        """Validate every entry (dtype, dims against the data) - what opening a file promises."""
        for i in range(len(self._names)):
            self._entry(i)

    @staticmethod
    def records_of(entry: TensorEntry) -> tuple[Record, ...]:
        """The records a tensor or str entry was read from, in file order (for exact rewrites)."""
        if entry.kind == KIND_MAP:
            raise ValueError(f"parameter {entry.name!r} is a map tensor: see map_parts_of")
        return entry.extra

    @staticmethod
    def map_parts_of(entry: TensorEntry) -> tuple[list[Record], ...]:
        """A map tensor's records, each as its (keys, values, status) parts."""
        if entry.kind != KIND_MAP:
            raise ValueError(f"parameter {entry.name!r} is not a map tensor")
        return entry.extra

    # --- CRC ------------------------------------------------------------------------------------
    def verify_crc(self) -> None:
        """Check the CRC32 trailer against the records; raise naming the file on mismatch."""
        if self.crc_stored is None:
            return
        computed = crc_of_file(self, self.size - CRC_TRAILER_LEN)
        if computed != self.crc_stored:
            raise self._error(
                f"CRC32 mismatch: trailer says {self.crc_stored}, records give {computed} (file corrupted)"
            )

    # --- typed reads ----------------------------------------------------------------------------
    def kind(self, name: str) -> str:
        return self.entries[name].kind

    def read_str(self, name: str) -> str:
        if self.entries[name].kind != KIND_STR:
            return super().read_str(name)
        try:
            return self.read_raw(name).decode("utf-32-le")
        except UnicodeDecodeError:
            raise self._error(f"parameter {name!r}: str content is not valid UTF-32") from None

    def map_records(self, name: str) -> list[list[tuple[tuple[int, ...], str, bytes]]]:
        """A map tensor's records as (dims, dtype, raw bytes) of its keys, values and status parts."""
        entry = self.entries[name]
        if entry.kind != KIND_MAP:
            return super().map_records(name)
        return [[(p.dims, p.dtype, self.pread(p.content_offset, p.content_len)) for p in rec]
                for rec in self.map_parts_of(entry)]

    def read_map(self, name: str) -> list[np.ndarray]:
        """A map tensor as [keys, values, status], concatenated over its records."""
        parts: list[list[np.ndarray]] = [[], [], []]
        for rec in self.map_records(name):
            for i, (dims, dtype, raw) in enumerate(rec):
                try:
                    dt = np.dtype(dtype)
                except (TypeError, ValueError, SyntaxError):  # numpy parses odd strings as struct specs
                    raise self._error(f"map parameter {name!r}: unknown part dtype {dtype!r}") from None
                try:
                    parts[i].append(np.frombuffer(raw, dtype=dt).reshape(dims))
                except ValueError:
                    raise self._error(
                        f"map parameter {name!r}: {len(raw)} bytes of {dtype} do not fit dims {list(dims)}"
                    ) from None
        try:
            return [np.concatenate(ps) if ps else np.empty(0) for ps in parts]
        except ValueError:
            raise self._error(f"map parameter {name!r}: its records' parts have inconsistent shapes") from None

    def value(self, name: str):
        """A parameter as MindSpore's loader would hand it out: array, str, or map parts."""
        kind = self.kind(name)
        if kind == KIND_STR:
            return self.read_str(name)
        if kind == KIND_MAP:
            return self.read_map(name)
        return self.read(name)


def crc_of_file(reader: CheckpointReader, length: int) -> int:
    crc = 0
    buf = bytearray(8 * 1024 * 1024)
    mv = memoryview(buf)
    pos = 0
    while pos < length:
        n = min(len(buf), length - pos)
        reader.pread_into(pos, mv[:n])
        crc = zlib.crc32(mv[:n], crc)
        pos += n
    return crc


def _brief_dims(dims: tuple) -> str:
    """Dims for an error line: a hostile record may declare thousands of huge ones."""
    shown = [str(d) if d < 10**12 else f"2**{d.bit_length() - 1}+" for d in dims[:8]]
    return "[" + ", ".join(shown) + (", …]" if len(dims) > 8 else "]")
