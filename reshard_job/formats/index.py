"""What a reader holds, as the planner sees it: name -> ``TensorMeta`` (dtype, shape, kind, size).

Kept beside the readers (not in the planner) because every source set builds one per rank,
single-file or multi-file alike; the planner only reads these values.
"""

from __future__ import annotations

from collections.abc import Mapping
from reshard_job.core.tensor_meta import TensorMeta
from reshard_job.formats.base import TensorReader


_METAS: dict[tuple, TensorMeta] = {}


def shared_meta(key: tuple) -> TensorMeta:
    """The TensorMeta of (dtype, shape, kind, size): one object for all equal ones (a million
    tensors share a few), up to 100,000 distinct ones kept."""
    meta = _METAS.get(key)
    if meta is None:
        meta = TensorMeta(*key)
        if len(_METAS) < 100_000:
            _METAS[key] = meta
    return meta


class IndexView(Mapping):
    """What a reader holds, as the planner sees it (name -> TensorMeta), without a copy per tensor:
    metadata objects are shared between every tensor (and file) with the same dtype, shape and size."""

    def __init__(self, reader: TensorReader):
        self._reader = reader
        self._describe = getattr(reader, "describe", None) or self._from_entry
        # the reader's own shared metas where it keeps them (a lookup, no key made per call)
        self._meta = getattr(reader, "meta", None) or (lambda name: shared_meta(self._describe(name)))

    @property
    def reader(self) -> TensorReader:
        return self._reader

    def _from_entry(self, name: str) -> tuple:
        e = self._reader.entries[name]
        return e.dtype, tuple(e.shape), e.kind, e.nbytes

    def __getitem__(self, name: str) -> TensorMeta:
        return self._meta(name)

    def same_entries(self, other) -> bool:
        """Whether `other` holds exactly the names and (dtype, shape, kind, size) this one does:
        asked of the readers (whole columns compared at once) where both can tell, else False
        (the caller then compares name by name)."""
        same = getattr(self._reader, "same_entries", None)
        return isinstance(other, IndexView) and same is not None and same(other._reader)

    def keys(self):
        """The names, set-like; the reader's own view where it has one (compared in C, not name by
        name: the planner compares the names of every rank)."""
        fast = getattr(self._reader, "name_keys", None)
        return fast() if fast is not None else super().keys()

    def __contains__(self, name) -> bool:
        return name in self._reader.entries

    def __iter__(self):
        return iter(self._reader.entries)

    def __len__(self) -> int:
        return len(self._reader.entries)


def reader_index(reader: TensorReader) -> Mapping[str, TensorMeta]:
    """What a reader holds, as the planner sees it."""
    return IndexView(reader)
