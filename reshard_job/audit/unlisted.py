"""Files in an output directory that its manifest does not list, where a loader would take them.

``audit verify`` of a directory checks every file the manifest lists; a file added beside them
(a ``rank_4/`` folder, a ``checkpoint_0-2_1.ckpt`` that MindSpore's newest-step rule would load
instead of ``checkpoint_0.ckpt``, a stray shard) would change what the directory loads as while
every listed file still verifies. Such files are reported ``unlisted``, which fails the check.
What is not a checkpoint's (a README, the job's own ``.reshard_job/`` state) is left alone.
"""

from __future__ import annotations

import os
import re

RANK_DIR = re.compile(r"^rank_\d+$")
LOADED_SUFFIXES = (".ckpt", ".safetensors", ".json")  # what loaders and strategies read


def unlisted_files(directory: str, listed: set[str], manifest: str) -> list[str]:
    """Paths under `directory` a loader would take that `listed` (real paths) does not hold:
    anything in a ``rank_<r>/`` folder, a rank folder of no listed file, and checkpoint, strategy
    or index files beside the manifest. Local directories only (an object store has no strays here)."""
    if not os.path.isdir(directory):
        return []
    known = {os.path.realpath(p) for p in listed} | {os.path.realpath(manifest)}
    out = []
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        path = os.path.join(directory, entry.name)
        if RANK_DIR.match(entry.name) and entry.is_dir(follow_symlinks=False):
            try:
                inside = sorted(os.path.join(path, name) for name in os.listdir(path))
            except OSError:  # unreadable here: its listed files' own checks say so
                continue
            strays = [p for p in inside if os.path.realpath(p) not in known]
            out += strays if len(strays) < len(inside) or not inside else [path]
        elif entry.name.endswith(LOADED_SUFFIXES) and os.path.realpath(path) not in known:
            out.append(path)
    return out
