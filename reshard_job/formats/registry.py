"""The one place that decides file formats: which kind a checkpoint file is, and its reader and writer.

A checkpoint file's kind follows its name, as in MindSpore: ``.ckpt`` or ``.safetensors``. Every
other module asks here (``kind_of``, ``open_reader``, ``open_writer``, ``CHECKPOINT_SUFFIXES``)
instead of looking at extensions itself, so a new format is one entry in ``_FORMATS``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from reshard_job.errors import ConfigError
from reshard_job.formats.base import TensorReader, TensorWriter

CKPT = "ckpt"
SAFETENSORS = "safetensors"


@dataclass(frozen=True)
class _Format:
    kind: str
    suffix: str
    reader: Callable[..., TensorReader]
    writer: Callable[..., TensorWriter]


def _ckpt_reader(source, *, verify_crc: bool) -> TensorReader:
    from reshard_job.formats.ckpt import CheckpointReader

    return CheckpointReader(source, verify_crc=verify_crc)


def _ckpt_writer(target, *, crc: bool, metadata: dict | None, storage=None) -> TensorWriter:
    from reshard_job.formats.ckpt import CheckpointWriter

    return CheckpointWriter(target, crc=crc, storage=storage)


def _safetensors_reader(source, *, verify_crc: bool) -> TensorReader:
    from reshard_job.formats.safetensors import SafetensorsReader

    return SafetensorsReader(source, verify_crc=verify_crc)


def _safetensors_writer(target, *, crc: bool, metadata: dict | None, storage=None) -> TensorWriter:
    from reshard_job.formats.safetensors import SafetensorsWriter
    from reshard_job.formats.safetensors.header import FORMAT_KEY, MINDSPORE_FORMAT

    if metadata is not None and metadata.get(FORMAT_KEY) == MINDSPORE_FORMAT:  # e.g. with remove_redundancy
        return SafetensorsWriter(target, metadata=metadata, crc=crc, storage=storage)
    if metadata is not None:  # e.g. {"format": "pt"} for loaders outside MindSpore
        return SafetensorsWriter(target, metadata=metadata, mindspore=False, crc=crc, storage=storage)
    return SafetensorsWriter(target, crc=crc, storage=storage)


_FORMATS = {
    CKPT: _Format(CKPT, ".ckpt", _ckpt_reader, _ckpt_writer),
    SAFETENSORS: _Format(SAFETENSORS, ".safetensors", _safetensors_reader, _safetensors_writer),
}
KINDS = tuple(_FORMATS)
CHECKPOINT_SUFFIXES = tuple(f.suffix for f in _FORMATS.values())


def kind_of(path: str | os.PathLike) -> str | None:
    """The checkpoint kind a file name implies, or None for other files."""
    name = os.fspath(path)
    for f in _FORMATS.values():
        if name.endswith(f.suffix):
            return f.kind
    return None


def suffix_of(kind: str) -> str:
    return _FORMATS[check_kind(kind)].suffix


def check_kind(kind: str, what: str = "format") -> str:
    if kind not in _FORMATS:
        raise ConfigError(f"{what} must be one of {', '.join(KINDS)}, got {kind!r}")
    return kind


def open_reader(source, *, kind: str | None = None, verify_crc: bool = True) -> TensorReader:
    """A reader for `source` (a path, or an open ``storage.RandomAccess``); kind from the name by default."""
    path = source if isinstance(source, (str, os.PathLike)) else source.path
    kind = kind or kind_of(path) or CKPT
    return _FORMATS[kind].reader(source, verify_crc=verify_crc)


def open_writer(target, kind: str, *, crc: bool = False, metadata: dict | None = None,
                storage=None) -> TensorWriter:
    """A writer into `target` (a path or URL, reached with the ``StorageOptions`` `storage`, or an
    open ``storage.AtomicWriter``)."""
    return _FORMATS[check_kind(kind)].writer(target, crc=crc, metadata=metadata, storage=storage)
