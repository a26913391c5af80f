"""A source reader seen through ``target.include``/``exclude``/``rename`` (``plan.selection``).

The planner, the writer and the proof ask a reader for parameters by the names the outputs will
have; ``RenamedReader`` answers under those names from the file's own, so none of them knows a
selection was made. What is left out is simply not there. Reads that take an entry or a byte
offset (not a name) go to the file's reader unchanged, as does everything else it offers.
"""

from __future__ import annotations

from typing import Mapping


class RenamedReader:
    """`inner` under new names: `stored` maps a new name to the file's name for it.

    `only_stored`: the reader holds exactly the names of `stored` (the job's view, made from every
    name of the source); otherwise names `stored` does not mention keep their own (a task's view,
    which carries the renamed parameters of its plan only)."""

    name_keys = None  # no fast set of names: ``formats.index.IndexView`` iterates ``entries``

    def __init__(self, inner, stored: Mapping[str, str], *, only_stored: bool):
        self.inner = inner
        self.stored = stored
        self.only_stored = only_stored
        self._entries: dict | None = None
        self._moved = None if only_stored else frozenset(stored.values())

    def source_name(self, name: str) -> str:
        """The file's name for `name` (a name that is not there maps to nothing the file holds)."""
        old = self.stored.get(name)
        if old is not None:
            return old
        if self.only_stored or name in self._moved:
            return "\0" + name  # not there under this name
        return name

    @property
    def entries(self) -> dict:
        if self._entries is None:
            held = self.inner.entries
            if self.only_stored:
                self._entries = {new: held[old] for new, old in self.stored.items() if old in held}
            else:
                self._entries = {n: e for n, e in held.items() if n not in self._moved}
                self._entries.update({new: held[old] for new, old in self.stored.items() if old in held})
        return self._entries

    def __contains__(self, name: str) -> bool:
        return self.source_name(name) in self.inner.entries

    def __getitem__(self, name: str):
        return self.inner.entries[self.source_name(name)] if name in self else self.entries[name]

    def __iter__(self):
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def names(self) -> list[str]:
        return list(self.entries)

    def describe(self, name: str):
        describe = getattr(self.inner, "describe", None)
        if describe is None:
            e = self[name]
            return e.dtype, tuple(e.shape), e.kind, e.nbytes
        if name not in self:
            raise KeyError(name)
        return describe(self.source_name(name))

    def same_entries(self, other) -> bool:
        return False  # compared name by name

    def whole_span(self, name: str):
        span = getattr(self.inner, "whole_span", None)
        return span(self.source_name(name)) if span is not None and name in self else None

    def whole_spans(self, names: list[str]) -> list:
        return [self.whole_span(name) for name in names]  # (the inner reader's would take them as its own)

    def read_box(self, name: str, box, out=None):
        return self.inner.read_box(self.source_name(name), box, out)

    def iter_content(self, name: str, *args, **kwargs):
        return self.inner.iter_content(self.source_name(name), *args, **kwargs)

    def read_str(self, name: str) -> str:
        return self.inner.read_str(self.source_name(name))

    def iter_str_bytes(self, name: str, block: int):
        return self.inner.iter_str_bytes(self.source_name(name), block)

    def map_records(self, name: str):
        return self.inner.map_records(self.source_name(name))

    def __getattr__(self, attr: str):
        # path, size, identity, read_logical, read_near, pread_into, close... (no parameter name)
        return getattr(self.inner, attr)
