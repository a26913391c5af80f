"""How a source is read, whatever its kind: the ``SourceReader`` protocol and the choice of reader.

PyTorch DCP's ``StorageReader`` is the model: a small protocol, one implementation per kind, and
the callers (``job.stages.prepare``, ``api``) never ask which kind they hold. The kinds, in the
order they are tried (the first that recognises the path reads it):

- a single checkpoint file, ``.ckpt`` or ``.safetensors`` (``sources.single_file.SingleFile``):
  one whole model, read as the one unsharded source rank; any path that is not a folder is this
  kind, so that a missing or unfit file is refused naming what it is;
- a MindFormers 2.x save (``sources.mindformers.MindFormersFolder``), detected from the folder
  itself; its ``metadata.json`` takes the place of the strategy file;
- an export for inference, shards + ``model.safetensors.index.json``
  (``sources.export_folder.ExportFolder``), read back as one unsharded rank;
- MindSpore's ``rank_<r>/`` folders with a strategy file (``sources.rank_folders.RankFolders``),
  the kind a folder is when it is no other, so that a folder of no kind is refused by rank-folder
  discovery, naming what it lacks.

Single checkpoint files given by rank (the API's per-rank conversion) are read by the same
readers (``reader_for_files``). Opening is the same for every kind (``SourceFiles``: a rank is one
file, or a tuple of files read as one), so it is not a method here.
"""

from __future__ import annotations

import os
from typing import Protocol

from reshard_job.sources.export_folder import ExportFolder
from reshard_job.sources.mindformers import MindFormersFolder, mindformers_folder_of
from reshard_job.sources.open_files import SourceFiles
from reshard_job.sources.rank_folders import LoadedStrategy, RankFiles, RankFolders
from reshard_job.sources.single_file import SingleFile
from reshard_job.storage import StorageOptions


class SourceSettings(Protocol):
    """What the user said of the source (``job.config.spec.SourceSpec``)."""

    checkpoints: str | None
    strategy: str | None
    select: str
    iteration: int | None


class SourceReader(Protocol):
    """One kind of source: how it is recognised, what files it has, how they are laid out, and
    what it says of itself that the opened files must agree with."""

    root: str

    @classmethod
    def detect(cls, path: str | None, storage: StorageOptions | None = None) -> bool:
        """Whether `path` (a folder or file, or a prefix or object in a bucket) is of this kind; a path
        that cannot be listed is not (never raises)."""

    def check(self, source: SourceSettings) -> None:
        """Refuse, in one line (``ConfigError``), settings that do not apply to this kind."""

    def discover(self, source: SourceSettings) -> RankFiles:
        """The files of every source rank (a file, or the tuple of files read as that rank)."""

    def layouts(self, strategy: str | None) -> LoadedStrategy:
        """The source's layouts: from the user's strategy file (or per-stage folder), or from the
        source itself."""

    def verify(self, found: RankFiles, files: SourceFiles) -> list[str]:
        """Check the opened files against what the source says of itself; the checks that ran."""


READERS: tuple[type, ...] = (SingleFile, MindFormersFolder, ExportFolder, RankFolders)  # in the order they are tried


def reader_for(source: SourceSettings, storage: StorageOptions | None = None) -> SourceReader:
    """The reader of the folder (or file) ``source.checkpoints`` names: the first kind that recognises it."""
    kind = next(kind for kind in READERS if kind.detect(source.checkpoints, storage))
    return kind(source.checkpoints, storage)


def reader_for_files(files: dict[int, tuple[str, ...]], strategy_file: str | None) -> SourceReader:
    """The reader of checkpoint files given by rank (absolute local paths): a MindFormers save's
    when they are the files of one iteration folder (`strategy_file` must then be None or its
    metadata.json), else single checkpoint files, one per rank, in the folder they share."""
    folder = mindformers_folder_of(files, strategy_file)
    if folder is not None:
        return MindFormersFolder(folder, given=files)
    root = os.path.dirname(os.path.commonprefix([p[0] for p in files.values()])) or "/"
    return RankFolders(root, given=files)
