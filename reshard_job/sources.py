"""Finding source checkpoints: ``<dir>/rank_<r>/`` directories and the file to take from each.

MindSpore's converter takes, per ``rank_<digits>`` directory, the lexicographically last ``*.ckpt``
(spec §8.1). That is the ``last`` rule here. It picks ``net-9_100.ckpt`` over ``net-10_100.ckpt``,
which is rarely what a user wants after a long training run, so ``latest_step`` parses MindSpore's
``<prefix>-<epoch>_<step>.ckpt`` names and takes the highest (epoch, step). Any other value is a
glob pattern matched against file names (the last match, lexicographically, wins).
"""

from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .formats.strategy import StrategyFile
    from .topology import Topology

from .errors import ConfigError

RANK_DIR = re.compile(r"^rank_(\d+)$")
STEP_NAME = re.compile(r"-(\d+)_(\d+)(?:_\d+)?\.(?:ckpt|safetensors)$")
SELECT_LAST = "last"
SELECT_LATEST_STEP = "latest_step"
EXTENSIONS = (".ckpt", ".safetensors")


@dataclass(frozen=True)
class RankFiles:
    files: dict[int, str]  # global rank -> chosen file (absolute path)
    format: str  # "ckpt" | "safetensors"
    ignored: dict[int, list[str]]  # rank -> other candidate files not chosen


def _step_key(name: str):
    m = STEP_NAME.search(name)
    return (1, int(m.group(1)), int(m.group(2)), name) if m else (0, 0, 0, name)


def choose(candidates: list[str], select: str) -> str | None:
    if not candidates:
        return None
    if select == SELECT_LAST:
        return sorted(candidates)[-1]
    if select == SELECT_LATEST_STEP:
        return max(candidates, key=_step_key)
    matches = [c for c in candidates if fnmatch.fnmatch(c, select)]
    return sorted(matches)[-1] if matches else None


def discover(src_dir: str | os.PathLike, select: str = SELECT_LAST) -> RankFiles:
    """Map every ``rank_<r>`` directory under `src_dir` to its chosen checkpoint file."""
    src_dir = os.path.abspath(os.fspath(src_dir))
    if not os.path.exists(src_dir):
        raise ConfigError(f"source checkpoint directory not found: {src_dir}")
    if not os.path.isdir(src_dir):
        raise ConfigError(f"source checkpoints must be a directory holding rank_<r>/ folders: {src_dir}")
    rank_dirs: dict[int, str] = {}
    for entry in os.listdir(src_dir):
        m = RANK_DIR.match(entry)
        full = os.path.join(src_dir, entry)
        if m and os.path.isdir(full):
            rank = int(m.group(1))
            if rank in rank_dirs:
                raise ConfigError(f"{src_dir}: two directories name rank {rank}: {os.path.basename(rank_dirs[rank])}, {entry}")
            rank_dirs[rank] = full
    if not rank_dirs:
        what = "is empty" if not os.listdir(src_dir) else "has no rank_<r>/ directories"
        raise ConfigError(f"source checkpoint directory {src_dir} {what}; expected rank_0/, rank_1/, ... each with a .ckpt file")
    files: dict[int, str] = {}
    ignored: dict[int, list[str]] = {}
    kinds: set[str] = set()
    empty: list[int] = []
    for rank, d in sorted(rank_dirs.items()):
        names = [n for n in os.listdir(d) if n.endswith(EXTENSIONS) and os.path.isfile(os.path.join(d, n))
                 and not n.startswith(".")]
        ckpts = [n for n in names if n.endswith(".ckpt")]
        sts = [n for n in names if n.endswith(".safetensors")]
        if ckpts and sts:
            raise ConfigError(f"{d}: holds both .ckpt and .safetensors files; keep one format per source")
        pool = ckpts or sts
        chosen = choose(pool, select)
        if chosen is None:
            empty.append(rank)
            continue
        kinds.add("ckpt" if chosen.endswith(".ckpt") else "safetensors")
        files[rank] = os.path.join(d, chosen)
        others = sorted(set(pool) - {chosen})
        if others:
            ignored[rank] = others
    if len(kinds) > 1:
        raise ConfigError(f"{src_dir}: some ranks hold .ckpt files and others .safetensors; use one format")
    if not files:
        rule = "" if select in (SELECT_LAST, SELECT_LATEST_STEP) else f" matching {select!r}"
        raise ConfigError(f"{src_dir}: no checkpoint files{rule} in any rank_<r>/ directory")
    if empty:
        rule = "" if select in (SELECT_LAST, SELECT_LATEST_STEP) else f" matching {select!r}"
        raise ConfigError(f"{src_dir}: no checkpoint file{rule} in rank director{'ies' if len(empty) > 1 else 'y'} "
                          + ", ".join(f"rank_{r}" for r in empty))
    return RankFiles(files, kinds.pop(), ignored)


@dataclass(frozen=True)
class LoadedStrategy:
    """A strategy as given by the user: a file, a directory of per-stage files (merged here), or none."""

    topology: "Topology"
    strategy: "StrategyFile | None"  # the (merged) strategy; None for an unsharded side
    files: tuple[str, ...]  # the files it was read from


def load_strategy(spec: str | os.PathLike | None) -> LoadedStrategy:
    from .formats.strategy import merge_strategy_files, read_strategy, stage_files
    from .topology import Topology

    if spec is None:
        return LoadedStrategy(Topology.unsharded(), None, ())
    path = os.path.abspath(os.fspath(spec))
    if os.path.isdir(path):
        files, fmt = stage_files(path)
        parsed = [read_strategy(f) for f in files]
        if len(parsed) == 1 and parsed[0].merged:
            sf = parsed[0]
        else:
            sf = merge_strategy_files(parsed)
            sf.format = fmt
            sf.path = path
        return LoadedStrategy(Topology.from_strategy(sf), sf, tuple(files))
    if not os.path.exists(path):
        raise ConfigError(f"strategy file not found: {path}")
    sf = read_strategy(path)
    return LoadedStrategy(Topology.from_strategy(sf), sf, (path,))
