"""Where things lie: local places compared by device and inode (a bind mount shows a source
folder under another path, which no path comparison can see), URLs by bucket and key."""

from __future__ import annotations

import os


def inside(path: str, parent: str) -> bool:
    path, parent = os.path.realpath(path), os.path.realpath(parent)
    return path == parent or path.startswith(parent.rstrip(os.sep) + os.sep)


def real_paths(paths: list[str]) -> list[str]:
    """``os.path.realpath`` of each of `paths`, the folder of each resolved once: a job's sources
    share a few folders, and ``realpath`` walks every folder above a path (20,000 stage files of one
    pipeline folder, resolved one by one, took seconds)."""
    folders: dict[str, str] = {}
    out = []
    for p in paths:
        folder, name = os.path.split(p)
        if not os.path.isabs(p) or os.path.normpath(p) != p or name in ("", ".", ".."):
            out.append(os.path.realpath(p))  # ".." after a link: only realpath resolves it rightly
            continue
        real = folders.get(folder)
        if real is None:
            real = folders[folder] = os.path.realpath(folder)
        joined = os.path.join(real, name)
        out.append(os.path.realpath(joined) if os.path.islink(joined) else joined)
    return out


def place(path: str) -> tuple[int, int] | None:
    """(device, inode) of what `path` names now, following links; None where nothing is."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def self_and_ancestors(path: str):
    """`path` made absolute, then each folder above it up to the root."""
    path = os.path.abspath(path)
    while True:
        yield path
        parent = os.path.dirname(path)
        if parent == path:
            return
        path = parent


def places(paths) -> dict[tuple[int, int], str]:
    """(device, inode) -> the path that named it, for the local paths that exist."""
    out = {}
    for p in paths:
        if p and "://" not in p:
            key = place(p)
            if key is not None:
                out.setdefault(key, p)
    return out


def source_folder_around(path: str, source_dirs: dict[tuple[int, int], str], seen: dict) -> str | None:
    """The source folder that is `path` or holds it, as its device and inode say (any other name).
    `seen` keeps the answers for folders already walked (the rank folders share their parents)."""
    walked = []
    found = None
    for p in self_and_ancestors(path):
        if p in seen:
            found = seen[p]
            break
        walked.append(p)
        key = place(p)
        if key in source_dirs:
            found = source_dirs[key]
            break
    for p in walked:
        seen[p] = found
    return found


def url_key(url: str) -> str:
    """A URL as a place: s3:// and s3a:// name one bucket, case of the scheme and end slashes do not count."""
    scheme, _, rest = url.partition("://")
    scheme = scheme.lower()
    return f"{'s3' if scheme == 's3a' else scheme}://{rest.strip('/')}"


def under(path: str, parent: str) -> bool:
    """`path` is `parent` or below it, for URLs or local paths (local ones resolved)."""
    if "://" in path or "://" in parent:
        path, parent = url_key(path), url_key(parent)
        return path == parent or path.startswith(parent + "/")
    return inside(path, parent)
