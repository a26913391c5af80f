"""Several safetensors files presented as one source rank.

Some savers spread one rank's tensors over several files: MindFormers writes a rank's network
weights to a ``-model-`` file and its optimizer states to an ``-opt-`` file, and an export for
inference splits one full model into size-bounded shards. The planner and the executor think in
ranks, each read through one object; ``MultiFileReader`` is that object for a set of files.

Composition, not inheritance: it holds one ``SafetensorsReader`` per file and sends each call to
the reader of the file that holds the tensor. Tensor names must be unique across the files (a
name in two files would make "the rank's tensor" ambiguous), which is checked when the files are
opened.

Byte offsets. ``entries`` and ``pread`` use one address space over all files, file after file
in the order given (file ``i`` starts at the sum of the sizes of the files before it). So the
offsets in an entry's ``pieces`` always mean the same bytes as ``pread`` returns, whichever file
they are in; a read that would run from one file into the next is refused.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np

from reshard_job.errors import FormatError, PlanError
from reshard_job.core.boxes import Box
from reshard_job.formats.index import reader_index
from reshard_job.formats.safetensors import SafetensorsReader
from reshard_job.formats.tensorfile import TensorEntry

if TYPE_CHECKING:
    from reshard_job.storage import RandomAccess


class _Entries(Mapping):
    """The tensors of all files by name (file after file), each entry built on access with its
    offsets in the one address space."""

    __slots__ = ("_m", "_last")

    def __init__(self, reader: "MultiFileReader"):
        self._m = reader
        self._last: tuple[str, TensorEntry] | None = None  # a tensor is often asked for several times in a row

    def __getitem__(self, name: str) -> TensorEntry:
        last = self._last
        if last is not None and last[0] == name:
            return last[1]
        i = self._m._owner[name]
        entry = _shifted(self._m._readers[i].new_entry(name), self._m._bases[i])  # its own entry: shifted in place
        self._last = (name, entry)
        return entry

    def __contains__(self, name) -> bool:
        return name in self._m._owner

    def __iter__(self):
        return iter(self._m._owner)

    def __len__(self) -> int:
        return len(self._m._owner)


class _Owners(Mapping):
    """Tensor name -> the index of the file that holds it. A rank of a few files asks each file's
    own name table in turn (a dict of all the names beside them was 30 MiB for 600,000 tensors);
    one of many files builds that dict. Refuses a name two files hold."""

    PROBED = 4  # files asked in turn at most

    def __init__(self, readers: list[SafetensorsReader]):
        self._tables = [r.entries for r in readers]
        self._dict: dict[str, int] | None = {} if len(readers) > self.PROBED else None
        for i, table in enumerate(self._tables):
            for name in (table if self._dict is not None or i else ()):
                first = self._dict.setdefault(name, i) if self._dict is not None else self.get(name)
                if first != i:
                    raise FormatError(readers[i].path, f"tensor {name!r} is also in {readers[first].path}; files "
                                                       "read as one rank must not hold the same tensor twice")

    def get(self, name, default=None):
        if self._dict is not None:
            return self._dict.get(name, default)
        for i, table in enumerate(self._tables):
            if name in table:
                return i
        return default

    def __getitem__(self, name) -> int:
        i = self.get(name)
        if i is None:
            raise KeyError(name)
        return i

    def __contains__(self, name) -> bool:
        return self.get(name) is not None

    def __iter__(self):
        return iter(self._dict) if self._dict is not None else (n for table in self._tables for n in table)

    def __len__(self) -> int:
        return len(self._dict) if self._dict is not None else sum(map(len, self._tables))


class MultiFileReader:
    """The tensors of several safetensors files, read as one rank's file (names unique across them)."""

    def __init__(self, sources: Iterable["str | os.PathLike | RandomAccess"], *, verify_crc: bool = True,
                 parsed: Mapping[str, SafetensorsReader] | None = None):
        """`sources`: paths (opened read-only through ``reshard_job.storage``) or open
        ``storage.RandomAccess`` files, which are then closed with this reader. `parsed`: readers
        of some of the files opened before, by path (``SafetensorsReader``'s `parsed`)."""
        sources = list(sources)
        if not sources:
            raise ValueError("MultiFileReader needs at least one file")
        self._readers: list[SafetensorsReader] = []
        self._bases: list[int] = []
        self.entries = _Entries(self)
        try:
            base = 0
            for source in sources:
                path = source if isinstance(source, (str, os.PathLike)) else source.path
                reader = SafetensorsReader(source, verify_crc=verify_crc, parsed=(parsed or {}).get(str(path)))
                self._readers.append(reader)
                self._bases.append(base)
                base += reader.size
            self._owner = _Owners(self._readers)
        except BaseException:
            self.close()
            for source in sources[len(self._readers):]:  # opened by the caller, never handed to a reader
                if not isinstance(source, (str, os.PathLike)):
                    source.close()
            raise
        self.paths: tuple[str, ...] = tuple(r.path for r in self._readers)
        self.path = _display_path(self.paths)

    @property
    def readers(self) -> tuple[SafetensorsReader, ...]:
        """One reader per file, in the order given (for per-file work: hashing, CRC checks)."""
        return tuple(self._readers)

    @property
    def size(self) -> int:
        """Bytes of all files together."""
        return sum(r.size for r in self._readers)

    @property
    def identity(self) -> tuple:
        """The files' storage identities, in order (what the job compares to see a change)."""
        return tuple(tuple(r.identity) for r in self._readers)

    # --- mapping ------------------------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def __getitem__(self, name: str) -> TensorEntry:
        return self.entries[name]

    def __iter__(self):
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def names(self) -> list[str]:
        return list(self.entries)

    def describe(self, name: str) -> tuple[str, tuple[int, ...], str, int]:
        """(dtype, shape, kind, nbytes) of a tensor, without building its entry."""
        return self._reader_of(name).describe(name)

    def file_of(self, name: str) -> str:
        """The file that holds tensor `name`."""
        return self.paths[self._owner[name]]

    def _reader_of(self, name: str) -> SafetensorsReader:
        return self._readers[self._owner[name]]

    # --- reads --------------------------------------------------------------------------------
    def read_box(self, name: str, box: Box, out: np.ndarray | None = None) -> np.ndarray:
        return self._reader_of(name).read_box(name, box, out=out)

    def read(self, name: str) -> np.ndarray:
        return self._reader_of(name).read(name)

    def iter_content(self, name: str, block: int = 8 * 1024 * 1024):
        return self._reader_of(name).iter_content(name, block)

    def read_raw(self, name: str) -> bytes:
        return self._reader_of(name).read_raw(name)

    def read_logical(self, entry: TensorEntry, offset: int, view: memoryview) -> None:
        """Bytes `offset`.. of a tensor's logical content into `view` (entry as listed in ``entries``)."""
        owner = self._reader_of(entry.name)
        owner.read_logical(owner.entries[entry.name], offset, view)

    def pread(self, offset: int, nbytes: int) -> bytes:
        """Bytes at `offset` of the concatenated address space (see the module docstring)."""
        reader, within = self._locate(offset, nbytes)
        return reader.pread(within, nbytes)

    def pread_into(self, offset: int, view: memoryview) -> None:
        reader, within = self._locate(offset, len(view))
        reader.pread_into(within, view)

    def read_near(self, offset: int, nbytes: int) -> memoryview:
        reader, within = self._locate(offset, nbytes)
        return reader.read_near(within, nbytes)

    def read_spans(self, offsets: list[int], nbytes: int) -> list[bytes]:
        """The `nbytes` at each offset (see ``PositionedReader.read_spans``)."""
        if len(self._readers) == 1:
            return self._readers[0].read_spans(offsets, nbytes)
        return [self.pread(offset, nbytes) for offset in offsets]

    def whole_span(self, name: str) -> tuple | None:
        """The owning file's ``whole_span``, its offset in the one address space."""
        i = self._owner.get(name)
        span = self._readers[i].whole_span(name) if i is not None else None
        if span is None or not self._bases[i]:
            return span
        return span[0], span[1], span[2] + self._bases[i], span[3]

    def whole_spans(self, names: list[str]) -> list[tuple | None]:
        if len(self._readers) == 1:
            return self._readers[0].whole_spans(names)
        return list(map(self.whole_span, names))

    def _locate(self, offset: int, nbytes: int) -> tuple[SafetensorsReader, int]:
        """(the file's reader, the offset within it) of `nbytes` at `offset` in the one address space."""
        i = bisect.bisect_right(self._bases, offset) - 1
        if offset < 0 or i < 0:
            raise FormatError(self.path, f"offset {offset} is outside the files")
        reader = self._readers[i]
        within = offset - self._bases[i]
        if within + nbytes > reader.size:
            raise FormatError(reader.path, f"a read of {nbytes} bytes at byte {within} runs past the end of the file")
        return reader, within

    # --- lifetime -----------------------------------------------------------------------------
    def close(self) -> None:
        for reader in self._readers:
            reader.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class MultiFileSources:
    """Source ranks each read from several files; what ``execute.rank_task.execute_rank`` asks ``sources`` for.

    Offers the same calls as ``sources.open_files.SourceFiles`` (``reader(rank)``, ``index()``, ``close()``),
    with a tuple of files per rank where that class has one path. Readers open on first use and
    stay open until ``close``.
    """

    def __init__(self, rank_files: Mapping[int, Sequence[str | os.PathLike]], *, verify_crc: bool = True):
        self.paths: dict[int, tuple[str, ...]] = {
            int(rank): tuple(os.fspath(p) for p in files) for rank, files in rank_files.items()
        }
        self.verify_crc = verify_crc
        self._readers: dict[int, MultiFileReader] = {}

    def reader(self, rank: int) -> MultiFileReader:
        reader = self._readers.get(rank)
        if reader is None:
            files = self.paths.get(rank)
            if not files:
                raise PlanError(f"source rank {rank} has no checkpoint file")
            reader = self._readers[rank] = MultiFileReader(files, verify_crc=self.verify_crc)
        return reader

    def index(self):
        """What every rank holds, as the planner sees it (rank -> name -> TensorMeta)."""
        return {rank: reader_index(self.reader(rank)) for rank in sorted(self.paths)}

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _shifted(entry: TensorEntry, base: int) -> TensorEntry:
    if base:  # the entry was built for this call: shifted in place
        entry.pieces = [(offset + base, length) for offset, length in entry.pieces]
    return entry


def _display_path(paths: tuple[str, ...]) -> str:
    """One path, or ``dir/{a, b}`` for files of one folder, so messages stay one readable line."""
    if len(paths) == 1:
        return paths[0]
    folders = {os.path.dirname(p) for p in paths}
    if len(folders) == 1:
        return os.path.join(folders.pop(), "{" + ", ".join(os.path.basename(p) for p in paths) + "}")
    return " + ".join(paths)
