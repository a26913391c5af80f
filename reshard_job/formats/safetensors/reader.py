"""Reading safetensors files, plain and MindSpore-flavoured: the header is parsed and validated,
then tensors and boxes are served by positioned reads (see the package docstring)."""

from __future__ import annotations

import json
import zlib
from math import prod
from typing import TYPE_CHECKING

from reshard_job.errors import SafetensorsFormatError
import reshard_job.core.dtypes as dtypes
from reshard_job.formats.tensorfile import PositionedReader, TensorEntry
if TYPE_CHECKING:
    import numpy as np

from reshard_job.formats.safetensors.header import CRC_KEY, FORMAT_KEY, INT4_MARK, MAX_HEADER_BYTES, METADATA_KEY


class SafetensorsReader(PositionedReader):
    """Index of a safetensors file; serves tensors and boxes of tensors by positioned reads.

    ``entries`` maps names to TensorEntry in data-offset order; dtypes are MindSpore names
    ("BFloat16", "Float32", ..., "Int4" for names the metadata marks so). Each entry's ``extra``
    holds ``safetensors_dtype`` (the code in the file) and ``data_offsets``.
    """

    def __init__(self, source, *, verify_crc: bool = True):
        super().__init__(source)
        self.header_len = 0
        self._metadata: dict[str, str] | None = None
        try:
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
        note = getattr(self._file, "note_content", None)  # a file also being hashed: where tensors lie
        if note is not None:
            for e in entries:  # in file order now
                for offset, length in e.pieces:
                    note(offset, length)
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
