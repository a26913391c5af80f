"""MindFormers 2.x distributed checkpoints (``iteration_XXXXXXXX/`` + ``metadata.json``) as a source.

Spec: ``spec/mindformers-checkpoint-format.md``. A save is a folder with
``latest_checkpointed_iteration.txt`` and ``iteration_<8 digits>/`` subfolders, each holding
``metadata.json`` (every parameter's global shape, dtype, layout, shards, and which file holds
each shard), ``common.json`` and ``<prefix>-model|opt-<idx>-<total>.safetensors`` files of local
slices. No strategy file and no ``rank_<r>/`` folders are involved.

The parts: ``formats.mindformers_metadata`` parses ``metadata.json``; ``sources.mindformers_layouts``
turns its layouts into the strategy file the planner reads; ``sources.mindformers_save`` reads one
iteration and checks every file's header; this module tells a save from other folders and reads it
as a source (``MindFormersFolder``). A "source rank" is a storage rank: the files ``storage_data``
says that rank wrote (a model file and an opt file), read as one through ``MultiFileReader``. Its
``metadata.json`` takes the place of the strategy file (it is hashed and recorded like one), and
its index lists exactly what a rank's files hold: a rank that stored nothing (a redundancy-removed
save) is in the index with nothing, so the planner sees which rank holds which slice instead of
taking the rank's file for missing.

Deliberately not here: the MindSpore-style ``rank_<r>/<prefix>_rank_<r>-<epoch>_<step>.ckpt``
("legacy") saves of MindFormers, which are ordinary per-rank checkpoints with a strategy file.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace

from reshard_job.core.tensor_meta import TensorMeta
from reshard_job.errors import ConfigError
from reshard_job.formats.mindformers_metadata import METADATA_FILE, SHARD_FILE
from reshard_job.plan.model import Plan
from reshard_job.sources.mindformers_save import ITERATION_DIR, TRACKER_FILE, MindFormersSource, load_mindformers
from reshard_job.sources.open_files import SourceFiles, files_of
from reshard_job.sources.rank_folders import RANK_DIR, LoadedStrategy, RankFiles
from reshard_job.storage import StorageError, StorageOptions, absolute, storage_for

log = logging.getLogger("reshard_job")


def is_mindformers_checkpoint(path: str | os.PathLike, storage: StorageOptions | None = None) -> bool:
    """Whether `path` (a folder, or a prefix in a bucket) looks like a MindFormers save: its root,
    or one iteration folder of it."""
    path = absolute(path)
    try:
        return looks_like_mindformers(storage_for(path, storage).listdir(path))
    except (OSError, StorageError):
        return False


def looks_like_mindformers(listing) -> bool:
    """Whether a folder's entries (``FileInfo``) are those of a MindFormers save or iteration folder."""
    for entry in listing:
        if entry.name in (TRACKER_FILE, METADATA_FILE) and entry.is_file:
            return True
        if ITERATION_DIR.match(entry.name) and entry.is_dir:
            return True
        if SHARD_FILE.match(entry.name) and entry.is_file:
            return True
    return False


def is_mindformers_source(src_dir: str | None, storage_options: StorageOptions | None = None) -> bool:
    """Whether `src_dir` (a folder, or a prefix in a bucket) is a MindFormers 2.x save (its root or
    one iteration folder), not rank folders."""
    if src_dir is None:
        return False
    src_dir = absolute(src_dir)
    try:
        listing = storage_for(src_dir, storage_options).listdir(src_dir)
    except (OSError, StorageError):
        return False
    # a folder of rank_<r>/ directories is MindSpore's layout, whatever else it holds
    return looks_like_mindformers(listing) and not any(RANK_DIR.match(e.name) and e.is_dir for e in listing)


def discover_mindformers(src_dir: str, iteration: int | None = None, storage_options: StorageOptions | None = None,
                         *, absent_files_ok: bool = False) -> tuple[RankFiles, MindFormersSource]:
    """One iteration of a MindFormers save: every storage rank's files (model file, opt file), with
    their identities, and the parsed save (layouts from metadata.json, every file's header checked;
    `absent_files_ok`: see ``load_mindformers``)."""
    source = load_mindformers(absolute(src_dir), iteration, storage_options, absent_files_ok=absent_files_ok)
    storage = storage_for(source.folder, storage_options)
    files: dict[int, str | tuple[str, ...]] = {}
    identities: dict[int, tuple] = {}
    for rank, paths in sorted(source.rank_files.items()):
        infos = [storage.info(p) for p in paths]
        files[rank] = tuple(paths)
        identities[rank] = tuple(tuple(i.identity) if i is not None else () for i in infos)
    return RankFiles(source.root, files, "safetensors", {}, identities), source


def mindformers_folder_of(files: dict[int, tuple[str, ...]], strategy_file: str | None) -> str | None:
    """The iteration folder when the files are a MindFormers save's (all in one folder holding
    metadata.json); `strategy_file` must then be None or that metadata.json."""
    folders = {os.path.dirname(os.path.realpath(p)) for paths in files.values() for p in paths}
    if len(folders) != 1:
        return None
    folder = folders.pop()
    metadata = os.path.join(folder, METADATA_FILE)
    if not os.path.isfile(metadata):
        return None
    if strategy_file is not None and os.path.realpath(absolute(strategy_file)) != metadata:
        raise ConfigError(f"the checkpoint files are a MindFormers save ({folder}), whose layouts come from its "
                          f"metadata.json: give src_strategy_file=None or {metadata}")
    return folder


class MindFormersFolder:
    """A MindFormers save as a ``SourceReader``: its layouts come from ``metadata.json``, and what
    each rank holds from the headers read when the save was loaded, so a conversion is planned
    before any file opens and reads only the files the plan needs.

    `given` (rank -> files of one iteration folder) narrows the save to those files: the API's
    per-rank conversion, which may be given some of a rank's files only."""

    def __init__(self, root: str, storage: StorageOptions | None = None, *,
                 given: dict[int, tuple[str, ...]] | None = None):
        self.root = root
        self.storage = storage
        self.given = given
        self.save: MindFormersSource | None = None  # loaded by discover()
        # files metadata.json places may be absent: their parameters are then ``save.unavailable``, and
        # whoever plans a conversion refuses one that needs them (``job.stages.prepare``)
        self.absent_files_ok = False

    @classmethod
    def detect(cls, path: str | None, storage: StorageOptions | None = None) -> bool:
        return is_mindformers_source(path, storage)

    def check(self, source) -> None:
        if source.strategy is not None:
            raise ConfigError(f"{source.checkpoints} is a MindFormers checkpoint folder, whose layouts come from its "
                              f"metadata.json; set source.strategy=null (got {source.strategy})")

    def discover(self, source) -> RankFiles:
        """Every rank of the iteration (``source.iteration``, else the latest), or the given files."""
        found, self.save = discover_mindformers(self.root, source.iteration, self.storage,
                                                absent_files_ok=self.absent_files_ok)
        return found if self.given is None else self._given_files(found)

    def _given_files(self, found: RankFiles) -> RankFiles:
        given: dict[int, tuple[str, ...]] = {}
        for r, paths in sorted(self.given.items()):
            own = {os.path.basename(p): p for p in self.save.rank_files.get(r, ())}
            stray = [p for p in paths if os.path.basename(p) not in own]
            if stray:
                raise ConfigError(f"{stray[0]}: not a file of source rank {r} in {self.root} (metadata.json gives it "
                                  f"{', '.join(sorted(own)) or 'no file'}); see mindformers_rank_files")
            given[r] = tuple(own[os.path.basename(p)] for p in paths)
        identities = {r: tuple(found.identities[r][self.save.rank_files[r].index(p)] for p in given[r])
                      for r in given}
        return replace(found, files=given, identities=identities)

    def layouts(self, strategy: str | None = None) -> LoadedStrategy:
        """The layouts of metadata.json (recorded as the source strategy file); `strategy` is not
        used (``check`` refuses one). Loads the save when ``discover`` has not."""
        if self.save is None:
            self.save = load_mindformers(absolute(self.root), None, self.storage)
        save = self.save
        return LoadedStrategy(save.topology, save.strategy, (save.metadata_path,) if save.params else ())

    def verify(self, found: RankFiles, files: SourceFiles) -> list[str]:
        return []  # every file's header was checked against metadata.json when the save was loaded

    def index(self, found: RankFiles) -> dict[int, dict[str, TensorMeta]]:
        """What each rank's files in `found` hold (from the headers read when the save was loaded); a rank
        of the layouts that wrote no file at all holds nothing. Ranks not in `found` are missing."""
        save = self.save
        index: dict[int, dict[str, TensorMeta]] = {r: {} for r in range(save.devices) if r not in save.rank_files}
        for rank, files in found.files.items():
            paths = files_of(files)
            if len(paths) == 1:  # one file's header as it was read, not a copy (600,000 entries)
                index[rank] = save.file_tensors[paths[0]]
                continue
            index[rank] = {name: meta for f in paths for name, meta in save.file_tensors[f].items()}
        return dict(sorted(index.items()))

    def files_read(self, found: RankFiles, plan: Plan) -> RankFiles:
        """`found` narrowed to the ranks the plan reads and, per rank, to the files holding what it reads."""
        read: dict[int, set[int]] = {}  # rank -> its files the plan reads from (no set of names: 600,000 were 72 MiB)
        headers = self.save.file_tensors
        for rp in plan.ranks:
            for p in rp.params:
                for c in p.copies:
                    rank_files = found.files.get(c.source_rank)  # None: missing, reported by the plan
                    kept = read.setdefault(c.source_rank, set()) if rank_files is not None else None
                    if kept is None or len(kept) == len(rank_files):
                        continue
                    kept.update(i for i, f in enumerate(rank_files) if i not in kept and p.name in headers[f])
        files, identities = {}, {}
        for rank, kept in sorted(read.items()):
            keep = sorted(kept)
            files[rank] = tuple(found.files[rank][i] for i in keep)
            if rank in found.identities:
                identities[rank] = tuple(found.identities[rank][i] for i in keep)
        return replace(found, files=files, identities=identities)

    def log_found(self) -> None:
        """One line on the save read, and what of it is left aside."""
        save = self.save
        where = f"iteration {save.iteration}" if save.iteration is not None else "the folder itself"
        log.info("MindFormers checkpoint: %s (%s), %d rank(s), %d parameter(s) in metadata.json%s", save.folder,
                 where, len(save.rank_files), len(save.params) + len(save.unavailable),
                 ", redundancy removed" if save.deduplicated else "")
        extras = save.extras()
        if extras:
            log.info("tensors outside metadata.json, copied whole as MindSpore does: %s",
                     ", ".join(sorted(extras)[:8]))
        if save.unreferenced:
            log.warning("%s: %d .safetensors file(s) that metadata.json never names are ignored: %s", save.folder,
                        len(save.unreferenced), ", ".join(os.path.basename(f) for f in save.unreferenced[:4]))
