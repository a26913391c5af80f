"""A single checkpoint file as the source: one whole, unsharded model (``SingleFile``).

MindFormers' ``TransformCkpt`` takes one ``.ckpt`` of a whole model as well as a folder of ranks,
and a model saved on one device is one file with no ``rank_0/`` folder around it. Such a file is
source rank 0 of a one-device layout: no strategy (``source.strategy=null``), or one that lays out
a single device. A strategy of several devices is refused, since one file cannot be the shards of
many ranks, and taking it for rank 0's shard would write part of the model as if it were whole.

The file is opened read-only like any rank's file, and gets the same checks: its identity (size,
times, inode; an object's ETag) as listed is the one every read must still see, its format's CRC
is checked while the job hashes it, and lineage records it, with its sha256, as the input of rank 0.
"""

from __future__ import annotations

from reshard_job.errors import ConfigError
from reshard_job.formats.registry import CHECKPOINT_SUFFIXES, kind_of
from reshard_job.sources.rank_folders import LoadedStrategy, RankFiles, check_no_iteration, load_strategy
from reshard_job.storage import StorageError, StorageOptions, absolute, storage_for


class SingleFile:
    """One checkpoint file, ``.ckpt`` or ``.safetensors``, read as the only source rank (rank 0)."""

    def __init__(self, root: str, storage: StorageOptions | None = None):
        self.root = absolute(root)
        self.storage = storage

    @classmethod
    def detect(cls, path: str | None, storage: StorageOptions | None = None) -> bool:
        """A path that is not a folder: a file, or a checkpoint file's name that is absent (so that
        it is refused as the missing file it names, not as a missing folder)."""
        if path is None:
            return False
        path = absolute(path)
        try:
            info = storage_for(path, storage).info(path)
        except (OSError, StorageError):
            return False
        if info is None:
            return path.endswith(CHECKPOINT_SUFFIXES)
        return not info.is_dir

    def check(self, source) -> None:
        check_no_iteration(source)

    def discover(self, source) -> RankFiles:
        path = self.root
        where = storage_for(path, self.storage)
        info = where.info(path)
        if info is None:
            raise ConfigError(f"source checkpoint file not found: {path}")
        if not info.is_file:
            raise ConfigError(f"source checkpoints {path} is neither a folder nor a regular file (a FIFO or device?); "
                              "give a checkpoint file or a folder of rank_<r>/ folders")
        kind = kind_of(path)
        if kind is None:
            raise ConfigError(f"source checkpoints {path} is a file but not a checkpoint: a single source file must "
                              f"end with {' or '.join(CHECKPOINT_SUFFIXES)} (else give a folder of rank_<r>/ folders)")
        return RankFiles(where.parent(path), {0: path}, kind, {}, {0: tuple(info.identity)}, {0: info.size})

    def layouts(self, strategy: str | None) -> LoadedStrategy:
        loaded = load_strategy(strategy, self.storage)
        if loaded.topology.devices > 1:
            raise ConfigError(f"source checkpoints {self.root} is a single checkpoint file, one whole model, but "
                              f"source.strategy {strategy} lays out {loaded.topology.devices} devices; give the folder "
                              "holding that save's rank_<r>/ folders, or source.strategy=null for a whole model")
        return loaded

    def verify(self, found: RankFiles, files) -> list[str]:
        return []  # a lone file says nothing of itself beyond its format's own checks (its CRC, when hashed)
