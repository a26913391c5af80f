"""The interfaces every checkpoint format implements: a tensor reader and a tensor writer.

A reader indexes a file once (names, dtypes, shapes, where each tensor's bytes lie) and then
serves whole tensors, boxes of tensors and raw byte blocks by positioned reads through a
``storage.RandomAccess``, so nothing is loaded that is not asked for. A writer streams tensors
into a ``storage.AtomicWriter``: ``begin`` a tensor, pass its bytes to the sink in any pieces,
``close`` the sink; ``commit`` publishes the file and returns a ``WrittenFile`` with the sha256 of
the file and of every tensor, all computed while writing.

Formats differ in one way that matters to a streaming writer: a safetensors header (every
tensor's offsets) precedes the data, so the writer must know all tensors before the first byte;
a ``.ckpt`` does not. ``TensorWriter.arrange`` covers both: the executor hands over every tensor
it will write, and writes them in the order it returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol, Sequence, runtime_checkable

import numpy as np

from reshard_job.core.boxes import Box
from reshard_job.formats.tensorfile import TensorEntry


@dataclass(frozen=True)
class WrittenFile:
    path: str
    size: int
    sha256: str
    tensors: dict[str, str]  # parameter name -> sha256 of its bytes


@dataclass(frozen=True)
class TensorDecl:
    """A tensor a writer will be given: name, MindSpore dtype name, dims, and kind."""

    name: str
    dtype: str
    dims: tuple[int, ...]
    kind: str = "tensor"  # tensor | str | map


@runtime_checkable
class TensorReader(Protocol):
    path: str
    entries: dict[str, TensorEntry]

    def __contains__(self, name: str) -> bool: ...

    def __getitem__(self, name: str) -> TensorEntry: ...

    def names(self) -> list[str]: ...

    def read_box(self, name: str, box: Box, out: np.ndarray | None = None) -> np.ndarray: ...

    def iter_content(self, name: str, block: int = ...) -> Iterator[memoryview]: ...

    def read_str(self, name: str) -> str: ...

    def map_records(self, name: str) -> list[list[tuple[tuple[int, ...], str, bytes]]]: ...

    def close(self) -> None: ...


@runtime_checkable
class TensorSink(Protocol):
    name: str

    def write(self, data) -> None: ...

    def close(self) -> str:
        """Finish the tensor; return the sha256 of its bytes."""


@runtime_checkable
class TensorWriter(Protocol):
    path: str

    def arrange(self, tensors: Sequence[TensorDecl]) -> list[str]:
        """Announce every tensor about to be written; return their names in the order to write them."""

    def begin(self, name: str, dtype: str, dims) -> TensorSink: ...

    def add_str(self, name: str, text: str) -> str: ...

    def add_map(self, name: str, records: list[list[tuple[tuple[int, ...], str, bytes]]]) -> None: ...

    def commit(self) -> WrittenFile: ...

    def abort(self) -> None: ...


def whole_spans_of(reader, names: list[str]) -> list:
    """The reader's ``whole_spans`` of `names` (else its ``whole_span`` of each): (dtype, shape,
    offset, length) of each tensor stored whole in one record, None for the others and for every
    name where the reader can give none."""
    many = getattr(reader, "whole_spans", None)
    if many is not None:
        return many(names)
    one = getattr(reader, "whole_span", None)
    return list(map(one, names)) if one is not None else [None] * len(names)
