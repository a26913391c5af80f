"""Safetensors files, plain and as MindSpore writes them: an indexing reader and a streaming writer.

A safetensors file is an 8-byte little-endian header length ``n``, ``n`` bytes of JSON header
(``{"__metadata__": {str: str}, name: {"dtype", "shape", "data_offsets"}, ...}``, padded with
spaces), then the data section, every tensor's bytes in C order at ``8 + n + begin``.

Reading. ``SafetensorsReader`` parses and validates the header only (one positioned read of at most
100 MB, the limit the ``safetensors`` library and MindSpore's ``_fast_safe_open`` both enforce) and
fills ``entries`` in data-offset order; tensors and boxes are then served by ``PositionedReader``
with positioned reads, so a box of a large tensor costs about the box's bytes, never the file.
Everything that can be wrong with the input (length prefix, UTF-8, JSON, dtypes, shapes, offsets,
``crc_num``) is reported as ``SafetensorsFormatError`` naming the file and, where there is one, the
tensor. Offsets must tile the data section exactly (no gap, no overlap, nothing after the last
tensor) as both the library and MindSpore require; a file that breaks this would be refused by
whatever consumes our output, so accepting it here would only move the failure.

MindSpore flavour (spec: checkpoint-format §10): ``save_checkpoint(format="safetensors")`` goes
through ``safetensors.numpy.save_file`` and adds ``__metadata__`` entries: ``"format": "ms"``,
optionally ``"remove_redundancy"``, ``"crc_num"`` (zlib CRC32 chained over every tensor in sorted
name order, first the UTF-8 name, then the raw bytes) and ``"<name>": "Int4"`` for each qint4x2
tensor. The reader turns such a marker into dtype ``Int4`` (opaque bytes, copied whole, never
sliced) and checks ``crc_num`` when asked to.

Writing: why declare-then-stream. The header, which holds every tensor's offsets, precedes the
data, so the complete list of tensors (names, dtypes, shapes) must be known before the first data
byte is written, but the data itself need not be: ``declare`` every tensor, then stream each one's
bytes through ``begin(name)`` in file order (``data_order()``), so memory stays at the caller's
buffers no matter how large the file. ``add`` is the small-file convenience: it copies the array
and writes it when its turn in file order comes (at the latest on ``commit``).

The layout is the ``safetensors`` library's, so that for the same tensors our bytes equal
``save_file``'s: tensors sorted by descending dtype alignment (the order of the library's ``Dtype``
enum), then by name (byte-wise UTF-8, which is Python's ``str`` order); compact JSON with
``__metadata__`` first, then tensors in file order, each as ``dtype``, ``shape``,
``data_offsets``; non-ASCII characters written raw and control characters escaped as serde_json
does; the header padded with spaces to a multiple of 8. One thing cannot be matched: the library
keeps metadata in a hash map, so with two or more metadata keys its key order varies from run to
run. We write metadata keys sorted, which makes our output deterministic; files with zero or one
metadata key are byte-identical to the library's.

The CRC and the header. ``crc_num`` depends on all the data but sits in the header, before it.
* If every tensor was given with ``add`` (in memory), the CRC is computed before the header is
  written: one pass, bytes exactly as MindSpore writes them.
* ``crc=<int>``: the caller already knows the value (e.g. copying a file whose CRC was verified).
  It is written straight away and checked against the streamed data on ``commit``.
* ``crc=True`` while streaming: the header is written with room for the widest CRC (10 digits),
  the data is streamed (the CRC of each tensor computed on the way and chained in sorted-name order
  at the end with ``crc32_combine``), then the real header is written over the reserved one and
  padded with spaces to the reserved length, which JSON ignores. The file's sha256 is then computed
  by reading it back once, because the header bytes changed after they were hashed. The result is
  read by MindSpore and the library alike; it is byte-identical to MindSpore's own file whenever
  the real CRC's digits fit in the same multiple of 8 (most of the time: three quarters of all
  CRC values have 10 digits), otherwise it differs only in the amount of header padding.
"""

from __future__ import annotations

import hashlib
import json
import operator
import os
import stat
import zlib
from dataclasses import dataclass
from math import prod

import numpy as np

from ..errors import LayoutError, SafetensorsFormatError
from . import dtypes
from ..storage.atomic import AtomicFile
from .ckpt import WrittenFile
from .tensorfile import PositionedReader, TensorEntry

MAX_HEADER_BYTES = 100_000_000  # the safetensors library's MAX_HEADER_SIZE; MindSpore uses the same
METADATA_KEY = "__metadata__"
INT4_MARK = "Int4"
CRC_KEY = "crc_num"
FORMAT_KEY = "format"
CRC_WIDTH = 10  # decimal digits of the largest CRC32 value, 4294967295

# The safetensors library's Dtype enum in declaration (= increasing alignment) order, restricted to
# the codes we read and write. The library lays tensors out by descending position here, then name.
_LIBRARY_DTYPE_ORDER = [
    "BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3",
    "I16", "U16", "F16", "BF16",
    "I32", "U32", "F32",
    "C64", "F64", "I64", "U64",
]
_RANK = {code: i for i, code in enumerate(_LIBRARY_DTYPE_ORDER)}
# Int4 has no safetensors code: MindSpore hands the packed bytes to numpy, which stores them as
# one-byte integers, and marks the name in the metadata.
INT4_STORAGE_CODE = "I8"


# ========================================================================================== CRC


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


# ======================================================================================= reader


class SafetensorsReader(PositionedReader):
    """Index of a safetensors file; serves tensors and boxes of tensors by positioned reads.

    ``entries`` maps names to TensorEntry in data-offset order; dtypes are MindSpore names
    ("BFloat16", "Float32", ..., "Int4" for names the metadata marks so). Each entry's ``extra``
    holds ``safetensors_dtype`` (the code in the file) and ``data_offsets``.
    """

    def __init__(self, path: str | os.PathLike, *, verify_crc: bool = True):
        super().__init__(path)
        self.size = 0
        self.header_len = 0
        self._metadata: dict[str, str] | None = None
        fd = self._open()
        try:
            st = os.fstat(fd)
            # opening a directory read-only succeeds on Linux; only reading it fails
            if stat.S_ISDIR(st.st_mode):
                raise self._error("is a directory, expected a file")
            self.size = st.st_size
            self._index()
        except BaseException:
            self.close()
            raise
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
        raw = self.pread(8, n)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self._error(f"header is not valid UTF-8 (byte {e.start})") from None
        header = self._parse_json(text)
        if not isinstance(header, dict):
            raise self._error(f"header is JSON {type(header).__name__}, expected an object")
        self._metadata = self._parse_metadata(header.pop(METADATA_KEY, None))
        entries = [self._parse_tensor(name, info) for name, info in header.items()]
        self._check_layout(entries, size - 8 - n)
        marks = self._metadata or {}
        for e in entries:
            if marks.get(e.name) == INT4_MARK:
                # packed qint4x2: the bytes were validated under their stored code; carried opaque
                e.dtype = INT4_MARK
                e.extra.pop("storage", None)
            self.entries[e.name] = e

    def _parse_json(self, text: str):
        def unique(pairs):
            obj = {}
            for k, v in pairs:
                if k in obj:
                    raise self._error(f"header has key {k!r} twice")
                obj[k] = v
            return obj

        try:
            return json.loads(text, object_pairs_hook=unique)
        except SafetensorsFormatError:
            raise
        except RecursionError:
            raise self._error("header JSON is nested too deeply") from None
        except ValueError as e:  # JSONDecodeError, and over-long integer literals
            raise self._error(f"header is not valid JSON ({e})") from None

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

    def _parse_tensor(self, name: str, info) -> TensorEntry:
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
            raise self._error(f"{where}: unknown dtype {code!r}") from None
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise self._error(f"{where}: shape {shape!r} is not a list of non-negative integers")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int and o >= 0 for o in offsets)
        ):
            raise self._error(f"{where}: data_offsets {offsets!r} is not a pair of non-negative integers")
        begin, end = offsets
        if end < begin:
            raise self._error(f"{where}: data_offsets [{begin}, {end}] end before they begin")
        want = prod(shape) * dt.itemsize
        if end - begin != want:
            raise self._error(
                f"{where}: data_offsets [{begin}, {end}] hold {end - begin} bytes, "
                f"but shape {shape} of {code} needs {want}"
            )
        extra = {"safetensors_dtype": code, "data_offsets": (begin, end)}
        if dt.name not in dtypes.BY_NAME:  # codes MindSpore has no name for (F8_*): remember storage
            extra["storage"] = dt.storage
        return TensorEntry(name, dt.name, tuple(shape), want, [(begin, want)], extra=extra)

    def _check_layout(self, entries: list[TensorEntry], data_size: int) -> None:
        # sorted by offsets; stable, so equal offsets (empty tensors) keep header order
        entries.sort(key=lambda e: e.extra["data_offsets"])
        pos = 0
        for e in entries:
            begin, end = e.extra["data_offsets"]
            if end > data_size:
                raise self._error(
                    f"tensor {e.name!r}: data_offsets [{begin}, {end}] run past the {data_size}-byte "
                    f"data section (file truncated?)"
                )
            if begin < pos:
                raise self._error(f"tensor {e.name!r}: data_offsets [{begin}, {end}] overlap the previous tensor")
            if begin > pos:
                raise self._error(
                    f"tensor {e.name!r}: data_offsets [{begin}, {end}] leave a gap after byte {pos} "
                    f"(offsets must be contiguous)"
                )
            pos = end
            e.pieces = [(self.data_start + begin, end - begin)]
            e.finish()
        if pos != data_size:
            raise self._error(f"{data_size - pos} bytes after the last tensor's data (offsets end at {pos})")

    # --- CRC ----------------------------------------------------------------------------------
    def stored_crc(self) -> int | None:
        if not self.has_crc:
            return None
        text = self._metadata[CRC_KEY]
        if not (text.isascii() and text.isdigit()) or int(text) > 0xFFFFFFFF:
            raise self._error(f"metadata {CRC_KEY} {text!r} is not a CRC32 value")
        return int(text)

    def compute_crc(self) -> int:
        """MindSpore's crc_num over the tensors as stored: sorted names, each name then its bytes."""
        crc = 0
        for name in sorted(self.entries):
            crc = zlib.crc32(name.encode("utf-8"), crc)
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


# ======================================================================================= writer


@dataclass
class _Decl:
    name: str
    dtype: str  # MindSpore name
    code: str  # safetensors code written to the header
    shape: tuple[int, ...]
    nbytes: int


def _resolve_dtype(name: str, dtype: str) -> tuple[str, str, int]:
    """(MindSpore name, safetensors code, itemsize) for a dtype given by MindSpore name or code."""
    if dtype == dtypes.STR_TYPE:
        raise LayoutError(
            f"parameter {name!r}: str entries cannot be stored in safetensors (MindSpore refuses them too)"
        )
    if dtype == INT4_MARK:
        return INT4_MARK, INT4_STORAGE_CODE, 1
    dt = dtypes.BY_NAME.get(dtype)
    if dt is None:
        try:
            dt = dtypes.from_safetensors(dtype)
        except KeyError:
            raise LayoutError(f"parameter {name!r}: unknown dtype {dtype!r}") from None
    if dt.safetensors not in _RANK:
        raise LayoutError(
            f"parameter {name!r}: dtype {dt.name} has no code the safetensors format knows "
            f"({dt.safetensors or 'none'}), so it cannot be written as safetensors"
        )
    return dt.name, dt.safetensors, dt.itemsize


def _json_str(s: str) -> str:
    # ensure_ascii=False: raw UTF-8, only '"', '\\' and control characters escaped (lowercase
    # \u00xx), which is exactly what serde_json produces
    return json.dumps(s, ensure_ascii=False)


class TensorSink:
    """Accepts one tensor's bytes in order, in pieces of any size."""

    def __init__(self, writer: "SafetensorsWriter", decl: _Decl):
        self._w = writer
        self.name = decl.name
        self.total = decl.nbytes
        self.written = 0
        self._hash = hashlib.sha256()
        self._crc = 0

    def write(self, data) -> None:
        if self._w._open_sink is not self:
            # bytes written now would land in another tensor's place
            raise RuntimeError(f"parameter {self.name!r}: this sink is closed")
        mv = _byte_view(data, self.name)
        if self.written + len(mv) > self.total:
            raise ValueError(f"parameter {self.name!r}: more bytes than its shape and dtype hold ({self.total})")
        self._hash.update(mv)
        if self._w._track_crc:
            self._crc = zlib.crc32(mv, self._crc)
        self._w._file.write(mv)
        self.written += len(mv)

    def close(self) -> str:
        if self._w._open_sink is not self:
            raise RuntimeError(f"parameter {self.name!r}: this sink is closed")
        if self.written != self.total:
            raise ValueError(f"parameter {self.name!r}: got {self.written} of {self.total} bytes")
        digest = self._hash.hexdigest()
        self._w._tensor_done(self.name, digest, self._crc)
        return digest


class SafetensorsWriter:
    """Write a safetensors file: ``declare`` every tensor, then stream each one in ``data_order()``.

    ``metadata``: extra ``__metadata__`` entries (str -> str). ``mindspore=True`` adds
    ``"format": "ms"`` as MindSpore does (when there is at least one tensor; an explicit ``format``
    in ``metadata`` wins) and an ``"Int4"`` marker for each Int4 tensor. ``crc``: False, True
    (compute ``crc_num``) or an int (the known ``crc_num``, checked on commit); see the module
    docstring for how the CRC gets into a header that precedes the data. With no tensors, neither
    ``format`` nor ``crc_num`` is added (MindSpore saves an empty dict without metadata).

    Used as a context manager it commits on success and removes the temporary file on error.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        metadata: dict[str, str] | None = None,
        mindspore: bool = True,
        crc: bool | int = False,
        mode: int = 0o444,
        overwrite: bool = True,
    ):
        self.path = os.fspath(path)
        if metadata is not None:
            if not isinstance(metadata, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
            ):
                raise ValueError("metadata must be a dict of str to str")
            for k, v in metadata.items():
                _check_utf8(k, "metadata key")
                _check_utf8(v, f"metadata value of {k!r}")
            if CRC_KEY in metadata:
                # a copied crc_num would not match the new content (MindSpore's unified_safetensors
                # writes such stale values); the writer computes it or leaves it out
                raise ValueError(f"metadata key {CRC_KEY!r} is set by the writer: pass crc=True instead")
        if crc is not True and crc is not False:
            if not isinstance(crc, int) or not 0 <= crc <= 0xFFFFFFFF:
                raise ValueError(f"crc must be True, False or a CRC32 value, not {crc!r}")
        self.user_metadata = None if metadata is None else dict(metadata)
        self.mindspore = mindspore
        self.crc = crc
        self._decls: dict[str, _Decl] = {}
        self._pending: dict[str, tuple[bytes | memoryview, str]] = {}  # added before the header
        self._order: list[str] | None = None  # set when the header is written
        self._next = 0
        self._open_sink: TensorSink | None = None
        self._crcs: dict[str, tuple[int, int]] = {}
        self._track_crc = crc is not False
        self._reserved: int | None = None  # header length reserved for a CRC not yet known
        self.tensors: dict[str, str] = {}
        self.header_len: int | None = None
        # A CRC known only at the end is patched into the header afterwards, which needs a buffered file.
        self._file = AtomicFile(self.path, mode=mode, overwrite=overwrite, direct=crc is not True)

    # --- declaring ------------------------------------------------------------------------------
    def declare(self, name: str, dtype: str, shape) -> int:
        """Announce a tensor (any order); returns its byte count. All must come before the first ``begin``."""
        if self._order is not None:
            raise RuntimeError(
                f"parameter {name!r}: cannot declare after data writing started; declare every tensor first"
            )
        if not isinstance(name, str):
            raise ValueError(f"tensor names must be str, not {type(name).__name__}")
        if name == METADATA_KEY:
            raise ValueError(f"{METADATA_KEY!r} is reserved by the format and cannot name a tensor")
        _check_utf8(name, "tensor name")
        ms_name, code, itemsize = _resolve_dtype(name, dtype)
        try:
            shape = tuple(operator.index(d) for d in shape)  # ints only: 2.5 is not a dimension
        except TypeError:
            raise LayoutError(f"parameter {name!r}: shape {shape!r} is not a sequence of integers") from None
        if any(d < 0 for d in shape):
            raise LayoutError(f"parameter {name!r}: negative dimension in shape {list(shape)}")
        decl = _Decl(name, ms_name, code, shape, prod(shape) * itemsize)
        old = self._decls.get(name)
        if old is not None:
            if (old.dtype, old.shape) != (decl.dtype, decl.shape):
                raise ValueError(
                    f"parameter {name!r} declared twice, as {old.dtype} {list(old.shape)} "
                    f"and as {decl.dtype} {list(decl.shape)}"
                )
            return old.nbytes
        self._decls[name] = decl
        return decl.nbytes

    def data_order(self) -> list[str]:
        """Declared names in file order (descending dtype alignment, then name), as the library lays them out."""
        if self._order is not None:
            return list(self._order)
        return sorted(self._decls, key=lambda n: (-_RANK[self._decls[n].code], n))

    # --- header ---------------------------------------------------------------------------------
    def _metadata(self, crc_text: str | None) -> dict[str, str] | None:
        meta = None if self.user_metadata is None else dict(self.user_metadata)
        if self._decls:
            auto: dict[str, str] = {}
            if self.mindspore:
                auto[FORMAT_KEY] = "ms"
            for d in self._decls.values():
                if d.dtype == INT4_MARK:
                    auto[d.name] = INT4_MARK
            if crc_text is not None:
                auto[CRC_KEY] = crc_text
            if auto:
                meta = meta or {}
                for k, v in auto.items():
                    if k == FORMAT_KEY:
                        meta.setdefault(k, v)
                    else:
                        meta[k] = v
        if meta:
            # a user key that names a tensor would be read back as (or as not) an Int4 marker
            for k, v in meta.items():
                d = self._decls.get(k)
                if d is not None and (v == INT4_MARK) != (d.dtype == INT4_MARK):
                    raise ValueError(
                        f"metadata key {k!r} names a {d.dtype} tensor; its value {v!r} would change how it is read"
                    )
        return meta

    def _header(self, order: list[str], crc_text: str | None) -> bytes:
        meta = self._metadata(crc_text)
        parts = []
        if meta is not None:
            items = ",".join(f"{_json_str(k)}:{_json_str(v)}" for k, v in sorted(meta.items()))
            parts.append(f'"{METADATA_KEY}":{{{items}}}')
        pos = 0
        for name in order:
            d = self._decls[name]
            dims = ",".join(str(x) for x in d.shape)
            parts.append(
                f'{_json_str(name)}:{{"dtype":"{d.code}","shape":[{dims}],"data_offsets":[{pos},{pos + d.nbytes}]}}'
            )
            pos += d.nbytes
        return ("{" + ",".join(parts) + "}").encode("utf-8")

    def _start_data(self) -> None:
        """Fix the layout and write the length prefix and header; from here on only data follows."""
        order = self.data_order()
        if self.crc is False or not self._decls:
            header = self._header(order, None)
            crc_mode = "none"
        elif self.crc is not True:
            header = self._header(order, str(self.crc))
            crc_mode = "given"
        elif len(self._pending) == len(self._decls):
            # everything is in memory: the CRC can be computed before the header is written
            for name, (data, _) in self._pending.items():
                self._crcs[name] = (zlib.crc32(data), len(data))
            header = self._header(order, str(chain_crc(self._crcs)))
            self._crcs.clear()  # recomputed while the data is written, like any other tensor
            crc_mode = "exact"
        else:
            # the widest CRC; the real one is written over this header on commit
            header = self._header(order, "9" * CRC_WIDTH)
            crc_mode = "deferred"
        header += b" " * (-len(header) % 8)
        if len(header) > MAX_HEADER_BYTES:
            raise LayoutError(
                f"{self.path}: header of {len(header)} bytes exceeds the {MAX_HEADER_BYTES}-byte limit readers enforce"
            )
        self._crc_mode = crc_mode
        self._order = order
        self.header_len = len(header)
        if crc_mode == "deferred":
            self._reserved = len(header)
        self._file.write(len(header).to_bytes(8, "little"))
        self._file.write(header)

    # --- tensors --------------------------------------------------------------------------------
    def _tensor_done(self, name: str, digest: str, crc: int) -> None:
        self.tensors[name] = digest
        self._crcs[name] = (crc, self._decls[name].nbytes)
        self._open_sink = None
        self._next += 1

    def _advance_to(self, name: str | None) -> None:
        """Write buffered tensors that precede `name` in file order (all of them for None)."""
        while self._next < len(self._order):
            nxt = self._order[self._next]
            if nxt == name:
                return
            if nxt not in self._pending:
                if name is None:
                    return
                raise RuntimeError(
                    f"parameter {name!r} cannot be written yet: tensors are stored in data_order() "
                    f"and {nxt!r} comes before it"
                )
            data, digest = self._pending.pop(nxt)
            sink = self._open_sink = TensorSink(self, self._decls[nxt])
            sink.write(data)
            sink.close()

    def begin(self, name: str, dtype: str | None = None, dims=None) -> TensorSink:
        """Start writing a declared tensor; pass its bytes to the sink's ``write``, then ``close``.

        `dtype` and `dims` are optional (the declaration has them); when given, as by callers that
        drive `.ckpt` and safetensors writers alike, they must match the declaration.
        """
        if self._open_sink is not None:
            raise RuntimeError(f"parameter {self._open_sink.name!r} is still being written")
        if name not in self._decls:
            raise RuntimeError(f"parameter {name!r} was not declared")
        decl = self._decls[name]
        if dtype is not None and dtype not in (decl.dtype, decl.code):
            raise RuntimeError(f"parameter {name!r} was declared {decl.dtype}, not {dtype}")
        if dims is not None and tuple(int(d) for d in dims) != decl.shape:
            raise RuntimeError(f"parameter {name!r} was declared with shape {list(decl.shape)}, not {list(dims)}")
        if name in self.tensors or name in self._pending:
            raise RuntimeError(f"parameter {name!r} was already written")
        if self._order is None:
            self._start_data()
        self._advance_to(name)
        self._open_sink = TensorSink(self, self._decls[name])
        return self._open_sink

    def add(self, name: str, array: np.ndarray, dtype: str | None = None) -> str:
        """Declare and write a whole tensor from a numpy array (dtype from the array; uint16 stays UInt16).

        Before data writing started the array is copied and written on its turn; afterwards it
        must be a declared tensor and is written at once (so it must be next in ``data_order()``).
        Returns the tensor's sha256.
        """
        array = np.asarray(array)
        if dtype is None:
            try:
                dtype = dtypes.from_numpy(array.dtype).name
            except KeyError:
                raise LayoutError(f"parameter {name!r}: numpy dtype {array.dtype} has no safetensors dtype") from None
        ms_name, _, itemsize = _resolve_dtype(name, dtype)
        if ms_name != INT4_MARK and array.dtype.itemsize != itemsize:
            raise ValueError(f"parameter {name!r}: array of {array.dtype} cannot hold {ms_name}")
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        if ms_name == INT4_MARK and data.nbytes != prod(array.shape):
            raise ValueError(f"parameter {name!r}: Int4 data must be given as one byte per element of its shape")
        return self.add_bytes(name, ms_name, array.shape, data)

    def add_bytes(self, name: str, dtype: str, shape, data) -> str:
        """Like ``add``, from raw bytes in C order."""
        if self._order is None:
            nbytes = self.declare(name, dtype, shape)
            if name in self._pending:
                raise RuntimeError(f"parameter {name!r} was already added")
            mv = memoryview(bytes(_byte_view(data, name)))  # our own copy: the caller may reuse its buffer
            if len(mv) != nbytes:
                raise ValueError(f"parameter {name!r}: got {len(mv)} bytes, shape and dtype need {nbytes}")
            digest = hashlib.sha256(mv).hexdigest()
            self._pending[name] = (mv, digest)
            return digest
        d = self._decls.get(name)
        if d is None:
            raise RuntimeError(f"parameter {name!r}: cannot add an undeclared tensor after data writing started")
        if (d.dtype, d.shape) != (_resolve_dtype(name, dtype)[0], tuple(operator.index(x) for x in shape)):
            raise ValueError(f"parameter {name!r} was declared as {d.dtype} {list(d.shape)}")
        sink = self.begin(name)
        sink.write(data)
        return sink.close()

    # --- finishing ------------------------------------------------------------------------------
    def commit(self) -> WrittenFile:
        if self._open_sink is not None:
            raise RuntimeError(f"parameter {self._open_sink.name!r} was not finished")
        if self._order is None:
            self._start_data()
        self._advance_to(None)
        missing = [n for n in self._order if n not in self.tensors]
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise RuntimeError(f"{self.path}: declared tensors not written: {', '.join(map(repr, missing[:5]))}{more}")
        sha = None
        if self._crc_mode in ("given", "deferred"):
            crc = chain_crc(self._crcs)
            if self._crc_mode == "given" and crc != self.crc:
                self.abort()
                raise ValueError(f"{self.path}: crc={self.crc} was given, but the data written give {crc}")
            if self._crc_mode == "deferred":
                sha = self._rewrite_header(crc)
        size, digest = self._file.commit()
        return WrittenFile(self.path, size, sha or digest, dict(self.tensors))

    def _rewrite_header(self, crc: int) -> str:
        """Put the real CRC into the reserved header; return the file's sha256, read back once."""
        header = self._header(self._order, str(crc))
        header += b" " * (self._reserved - len(header))  # same length: the data does not move
        self._file.rewrite_at(8, header)
        h = hashlib.sha256()
        with open(self._file.tmp_path, "rb") as r:
            while block := r.read(8 * 1024 * 1024):
                h.update(block)
        return h.hexdigest()

    def abort(self) -> None:
        self._file.abort()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            try:
                self.result = self.commit()
            except BaseException:
                self.abort()  # a failed commit (unwritten tensor, CRC mismatch) leaves no temp file
                raise
        else:
            self.abort()
        return False


def _byte_view(data, name: str) -> memoryview:
    """A flat byte view of a numpy array or any buffer, without copying when it is contiguous."""
    if isinstance(data, np.ndarray):
        if data.dtype.byteorder == ">":
            raise ValueError(f"parameter {name!r}: data must be little-endian (safetensors stores little-endian)")
        if not data.flags.c_contiguous:
            raise ValueError(f"parameter {name!r}: data must be C-contiguous")
        # through numpy: memoryview.cast refuses formats such as complex 'Zf'
        return memoryview(data.reshape(-1).view(np.uint8))
    mv = memoryview(data)
    if not mv.c_contiguous:
        raise ValueError(f"parameter {name!r}: data must be C-contiguous")
    if mv.format == "B" and mv.ndim == 1:
        return mv
    try:
        return mv.cast("B")
    except TypeError:  # a non-native struct format: copy its bytes
        return memoryview(mv.tobytes())


def _check_utf8(s: str, what: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} {s!r} cannot be encoded as UTF-8") from None


def save_file(
    path: str | os.PathLike,
    tensors: dict[str, np.ndarray],
    *,
    metadata: dict[str, str] | None = None,
    mindspore: bool = True,
    crc: bool = False,
    dtype_overrides: dict[str, str] | None = None,
    mode: int = 0o444,
) -> WrittenFile:
    """Write small in-memory tensors in one go (``dtype_overrides`` maps names to e.g. "BFloat16" for uint16 words)."""
    overrides = dtype_overrides or {}
    with SafetensorsWriter(path, metadata=metadata, mindspore=mindspore, crc=crc, mode=mode) as w:
        for name, array in tensors.items():
            w.add(name, array, overrides.get(name))
    return w.result


def copy_safetensors(
    reader: SafetensorsReader, path: str | os.PathLike, *, mode: int = 0o444
) -> WrittenFile:
    """Rewrite a file tensor by tensor through the streaming path (same tensors, metadata and CRC)."""
    meta = reader.metadata
    if reader.has_metadata:
        meta.pop(CRC_KEY, None)
        for name, e in reader.entries.items():
            if e.dtype == INT4_MARK:
                meta.pop(name, None)
    else:
        meta = None
    crc = reader.stored_crc() if reader.has_crc else False
    with SafetensorsWriter(path, metadata=meta, mindspore=False, crc=crc, mode=mode) as w:
        for name, e in reader.entries.items():
            w.declare(name, e.dtype, e.shape)
        for name in w.data_order():
            sink = w.begin(name)
            for block in reader.iter_content(name):
                sink.write(block)
            sink.close()
    return w.result
