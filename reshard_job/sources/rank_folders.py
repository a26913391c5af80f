"""Finding the sources: ``<dir>/rank_<r>/`` folders, the file to take from each, and strategy files.

Everything is looked at through ``reshard_job.storage``, so the same code serves local folders and
object-store prefixes, and nothing that is not a regular file (a FIFO, a device) is ever opened.

Which file of a rank folder: MindSpore's converter takes the lexicographically last ``*.ckpt``
(spec §8.1), the ``last`` rule here. It picks ``net-9_100.ckpt`` over ``net-10_100.ckpt``, which is
rarely what a user wants after a long training run, so the default, ``latest_step``, parses
MindSpore's ``<prefix>-<epoch>_<step>`` names (MindFormers' ``<prefix>_rank_<r>-<epoch>_<step>``
too) and takes the highest (epoch, step); ranks whose chosen saves are of different steps are
refused, since their shards do not belong together. Any other value is a glob pattern matched
against file names (the last match, lexicographically, wins).

Rank folders are one kind of source folder (``RankFolders``, the kind a folder is when it is no
other: ``sources.base``); MindFormers 2.x saves (``sources.mindformers``) and exports for inference
(``sources.export_folder``) are the others. Single checkpoint files given by rank (the API's
per-rank conversion) are read as rank folders' files.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from reshard_job.errors import ConfigError, PlanError
from reshard_job.formats.registry import CHECKPOINT_SUFFIXES, CKPT, kind_of
from reshard_job.storage import StorageOptions, absolute, storage_for
from reshard_job.text import shorten

if TYPE_CHECKING:
    from reshard_job.core.strategy_model import StrategyFile
    from reshard_job.core.topology import Topology

RANK_DIR = re.compile(r"^rank_([0-9]{1,250})$")  # ASCII digits (\d would take an Arabic-Indic one), any count
STEP_NAME = re.compile(r"-(\d+)_(\d+)(?:_\d+)?\.(?:ckpt|safetensors)$")
SELECT_LAST = "last"
SELECT_LATEST_STEP = "latest_step"
STRATEGY_MAX_BYTES = 1 << 30  # a strategy file for a huge model is tens of MB; more is not a strategy


@dataclass(frozen=True)
class RankFiles:
    root: str
    # global rank -> chosen file (absolute path or URL), or the files read together as that rank
    files: dict[int, str | tuple[str, ...]]
    format: str  # "ckpt" | "safetensors"
    ignored: dict[int, list[str]] = field(default_factory=dict)  # rank -> other candidate files not chosen
    # rank -> FileInfo.identity when listed (for a tuple of files, the tuple of their identities)
    identities: dict[int, tuple] = field(default_factory=dict)
    sizes: dict[int, int] = field(default_factory=dict)  # rank -> bytes when listed (single-file ranks)


def step_of(name: str) -> tuple[int, int] | None:
    m = STEP_NAME.search(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _step_key(name: str):
    step = step_of(name)
    return (1, *step, name) if step else (0, 0, 0, name)


def choose(candidates: list[str], select: str) -> str | None:
    if not candidates:
        return None
    if select == SELECT_LAST:
        return sorted(candidates)[-1]
    if select == SELECT_LATEST_STEP:
        return max(candidates, key=_step_key)
    matches = [c for c in candidates if fnmatch.fnmatch(c, select)]
    return sorted(matches)[-1] if matches else None


def _rank_dirs(storage, src_dir: str) -> dict[int, str]:
    info = storage.info(src_dir)
    if info is None:
        raise ConfigError(f"source checkpoint directory not found: {src_dir}")
    if not info.is_dir:
        raise ConfigError(f"source checkpoints must be a directory holding rank_<r>/ folders: {src_dir}")
    entries = storage.listdir(src_dir)
    rank_dirs: dict[int, str] = {}
    for entry in entries:
        m = RANK_DIR.match(entry.name)
        if m and entry.is_dir:
            rank = int(m.group(1))
            if rank in rank_dirs:
                raise ConfigError(f"{src_dir}: two directories name rank {rank}: "
                                  f"{storage.basename(rank_dirs[rank])}, {entry.name}")
            rank_dirs[rank] = entry.path
    if not rank_dirs:
        what = "is empty" if not entries else "has no rank_<r>/ directories"
        raise ConfigError(f"source checkpoint directory {src_dir} {what}; "
                          "expected rank_0/, rank_1/, ... each with a .ckpt file")
    return rank_dirs


def discover(src_dir, select: str = SELECT_LATEST_STEP, storage_options: StorageOptions | None = None) -> RankFiles:
    """Map every ``rank_<r>`` directory under `src_dir` to its chosen checkpoint file."""
    src_dir = absolute(src_dir)
    storage = storage_for(src_dir, storage_options)
    files: dict[int, str] = {}
    identities: dict[int, tuple] = {}
    sizes: dict[int, int] = {}
    ignored: dict[int, list[str]] = {}
    kinds: set[str] = set()
    empty: list[int] = []
    for rank, d in sorted(_rank_dirs(storage, src_dir).items()):
        listed = {e.name: e for e in storage.listdir(d)
                  if e.name.endswith(CHECKPOINT_SUFFIXES) and not e.name.startswith(".") and e.is_file}
        by_kind: dict[str, list[str]] = {}
        for name in listed:
            by_kind.setdefault(kind_of(name), []).append(name)
        if len(by_kind) > 1:
            raise ConfigError(f"{d}: holds both {' and '.join(sorted('.' + k for k in by_kind))} files; "
                              "keep one format per source")
        pool = next(iter(by_kind.values()), [])
        chosen = choose(pool, select)
        if chosen is None:
            empty.append(rank)
            continue
        kinds.add(kind_of(chosen))
        files[rank] = listed[chosen].path
        identities[rank] = listed[chosen].identity
        sizes[rank] = listed[chosen].size
        others = sorted(set(pool) - {chosen})
        if others:
            ignored[rank] = others
    rule = "" if select in (SELECT_LAST, SELECT_LATEST_STEP) else f" matching {select!r}"
    if len(kinds) > 1:
        raise ConfigError(f"{src_dir}: some ranks hold .ckpt files and others .safetensors; use one format")
    if not files:
        raise ConfigError(f"{src_dir}: no checkpoint files{rule} in any rank_<r>/ directory")
    if empty:
        raise ConfigError(f"{src_dir}: no checkpoint file{rule} in rank director{'ies' if len(empty) > 1 else 'y'} "
                          + ", ".join(f"rank_{r}" for r in empty))
    found = RankFiles(src_dir, files, kinds.pop(), ignored, identities, sizes)
    if select == SELECT_LATEST_STEP:
        _check_same_step(found, storage)
    return found


def _check_same_step(found: RankFiles, storage) -> None:
    """Shards of different saves do not belong together: refuse ranks whose latest steps differ."""
    steps = {r: step_of(storage.basename(p)) for r, p in found.files.items()}
    if None in steps.values() or len(set(steps.values())) <= 1:
        return
    newest = max(steps.values())
    behind = sorted(r for r, s in steps.items() if s != newest)
    example = behind[0]
    raise PlanError(
        f"{found.root}: rank folders hold saves of different steps: rank {example} has at most "
        f"{shorten(storage.basename(found.files[example]))} while others have epoch {newest[0]} step {newest[1]}"
        f" ({len(behind)} rank(s) behind: {', '.join(f'rank_{r}' for r in behind[:8])}"
        f"{', ...' if len(behind) > 8 else ''}); copy the missing saves, or pick one step for all ranks with "
        "source.select='<glob>' (e.g. '*-1_100.ckpt')"
    )


@dataclass(frozen=True)
class LoadedStrategy:
    """A strategy as given by the user: a file, a directory of per-stage files (merged here), or none."""

    topology: "Topology"
    strategy: "StrategyFile | None"  # the (merged) strategy; None for an unsharded side
    files: tuple[str, ...]  # the files it was read from


def read_strategy_file(path: str, storage_options: StorageOptions | None = None, known=None) -> "StrategyFile":
    """Parse one strategy file read through its storage (JSON iff the name ends in .json)."""
    return read_strategy_bytes(path, storage_options, known)[0]


def read_strategy_bytes(path: str, storage_options: StorageOptions | None = None,
                        known=None) -> tuple["StrategyFile", bytes]:
    """A strategy file's parsed content and the exact bytes it was parsed from; `known`: the JSON
    entries other files of its folder had (``strategy_json.ValidatedEntries``)."""
    from reshard_job.formats.strategy import format_for, parse_protobuf_strategy
    from reshard_job.formats.strategy_json import parse_json_strategy
    from reshard_job.core.strategy_model import FORMAT_JSON
    from reshard_job.errors import StrategyFormatError
    from reshard_job.storage import StorageError

    try:
        data = storage_for(path, storage_options).read_bytes(path, STRATEGY_MAX_BYTES)
    except FileNotFoundError:
        raise StrategyFormatError(path, "strategy file not found") from None
    except StorageError as e:
        text = str(e)
        raise StrategyFormatError(path, text[len(path) + 2:] if text.startswith(path + ": ") else text) from None
    if not data:
        raise StrategyFormatError(path, "strategy file is empty (0 bytes)")
    if format_for(path) == FORMAT_JSON:
        sf = parse_json_strategy(data, path, known)
    else:
        sf = parse_protobuf_strategy(data, path)
    sf.path = path
    return sf, data


def _stage_files(storage, folder: str) -> list[str]:
    from reshard_job.errors import StrategyFormatError

    entries = [e for e in storage.listdir(folder) if e.name.endswith((".ckpt", ".json"))]
    odd = [e for e in entries if not e.is_file]
    if odd:
        raise StrategyFormatError(odd[0].path, "is not a regular file (a FIFO, device or directory named like a "
                                               "strategy file); remove it from the pipeline strategy directory")
    ckpts = [e.path for e in entries if e.name.endswith(".ckpt")]
    jsons = [e.path for e in entries if e.name.endswith(".json")]
    if ckpts and jsons:
        raise StrategyFormatError(folder, "holds both .ckpt and .json strategy files; they must be all one format")
    if not ckpts and not jsons:
        raise StrategyFormatError(folder, "no strategy files (*.ckpt or *.json) in pipeline strategy directory")
    return ckpts or jsons


def load_strategy(spec, storage_options: StorageOptions | None = None) -> LoadedStrategy:
    """A strategy file, a directory of per-stage files (merged), or None for an unsharded side."""
    from reshard_job.formats.strategy import merge_strategy_files
    from reshard_job.formats.strategy_json import ValidatedEntries
    from reshard_job.core.strategy_model import FORMAT_JSON, FORMAT_PROTOBUF
    from reshard_job.core.topology import Topology

    if spec is None:
        return LoadedStrategy(Topology.unsharded(), None, ())
    spec = absolute(spec)
    storage = storage_for(spec, storage_options)
    info = storage.info(spec)
    if info is None:
        raise ConfigError(f"strategy file not found: {spec}")
    if info.is_dir:
        files = _stage_files(storage, spec)
        known = ValidatedEntries()  # stage files repeat their layouts: each validated once
        parsed = [read_strategy_file(f, storage_options, known) for f in files]
        if len(parsed) == 1 and parsed[0].merged:
            sf = parsed[0]
        else:
            sf = merge_strategy_files(parsed)
            sf.format = FORMAT_JSON if files[0].endswith(".json") else FORMAT_PROTOBUF
            sf.path = spec
        return LoadedStrategy(Topology.from_strategy(sf), sf, tuple(files))
    sf = read_strategy_file(spec, storage_options)
    return LoadedStrategy(Topology.from_strategy(sf), sf, (spec,))


def check_no_iteration(source) -> None:
    """``source.iteration`` picks an iteration of a MindFormers save, and of nothing else."""
    if source.iteration is not None:
        raise ConfigError(f"source.iteration={source.iteration} picks an iteration of a MindFormers checkpoint folder, "
                          f"but {source.checkpoints} holds no MindFormers save (set source.iteration=null)")


class RankFolders:
    """MindSpore's ``rank_<r>/`` folders as a ``SourceReader``: one file per rank (``source.select``),
    laid out by the user's strategy file. It is the kind a folder is when it is no other, so that
    ``discover`` names what is wrong with a folder of no kind.

    `given` (rank -> a tuple of one file) are single checkpoint files given by rank instead (the
    API's per-rank conversion), `root` then being the folder they share."""

    def __init__(self, root: str, storage: StorageOptions | None = None, *,
                 given: dict[int, tuple[str, ...]] | None = None):
        self.root = root
        self.storage = storage
        self.given = given

    @classmethod
    def detect(cls, path: str | None, storage: StorageOptions | None = None) -> bool:
        return True

    def check(self, source) -> None:
        check_no_iteration(source)

    def discover(self, source) -> RankFiles:
        if self.given is None:
            return discover(self.root, source.select, self.storage)
        if any(len(paths) != 1 for paths in self.given.values()):
            raise ConfigError("checkpoint_files_map gives several files for a rank, which only a MindFormers save "
                              "(an iteration folder with metadata.json) has")
        kinds = {kind_of(paths[0]) or CKPT for paths in self.given.values()}
        return RankFiles(self.root, {r: p[0] for r, p in self.given.items()}, kinds.pop() if len(kinds) == 1 else CKPT)

    def layouts(self, strategy: str | None) -> LoadedStrategy:
        return load_strategy(strategy, self.storage)

    def verify(self, found: RankFiles, files) -> list[str]:
        return []  # rank folders say nothing of themselves: the cross-checks (job.stages.prepare) compare them
