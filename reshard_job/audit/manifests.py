"""What an output directory holds, by its ``manifest.json``: the files to trace or verify.

The job writes ``manifest.json`` last, listing every target checkpoint and the target strategy
with size and sha256, under the absolute paths they were written at. A directory may have been
moved or copied since, so each listed file is looked for where it is now: at the same place
relative to the directory (``rank_<r>/<file>`` for checkpoints, ``<file>`` for the strategy),
found from where the listed files were relative to the directory they were written into.

The manifest's own digest is taken from the very bytes parsed here, so a check of "is this
manifest the one the lineage database recorded?" is about what was read.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
from dataclasses import dataclass, replace

from reshard_job.formats.manifest_file import MANIFEST_FILE, is_node_manifest_name
from reshard_job.lineage.hash_names import looks_like_sha256
from reshard_job.lineage.errors import LineageError
from reshard_job.audit.reading import absolute, dirname, join, json_document, read_small_file, relative_to
from reshard_job.text import shorten


@dataclass(frozen=True)
class ListedFile:
    """A file a manifest lists, where it should be now."""

    path: str
    kind: str
    rank: int | None
    size: int
    sha256: str
    node: str | None = None  # the target node holding it (output.placement=per_node)


@dataclass(frozen=True)
class OutputListing:
    directory: str
    manifest_path: str
    manifest_sha256: str
    manifest_size: int
    run_id: str | None  # as the manifest says; the lineage database is the authority
    files: tuple[ListedFile, ...]
    node: str | None = None  # a node's manifest (manifest.<node>.json): the files of that node only
    created_at: str | None = None  # when the job says it wrote the manifest (after every file it lists)

    @property
    def per_node(self) -> bool:
        """Whether the files lie on the target nodes' own disks (output.placement=per_node)."""
        return any(f.node for f in self.files)


def read_listing(directory: str) -> OutputListing:
    """The files `directory`'s manifest lists; a one-line ``LineageError`` if it has none or it is unusable.

    A node's directory of ``output.placement=per_node`` outputs holds its node's manifest
    (``manifest.<node>.json``) and, unless the job's driver ran there, no ``manifest.json``: its
    node manifests then stand for it (the first one names the listing)."""
    directory = absolute(directory)
    manifest_path = join(directory, MANIFEST_FILE)
    try:
        data = read_small_file(manifest_path)
    except FileNotFoundError:
        nodes = node_listings(directory)
        if nodes:
            files = {(f.path, f.sha256): f for n in nodes for f in n.files}  # each holds the strategy
            return replace(nodes[0], files=tuple(files.values()), node=None)
        raise LineageError(f"{directory}: no {MANIFEST_FILE}, so not a complete output directory of reshard_job "
                           f"(give a file in it instead)") from None
    except OSError as exc:
        raise LineageError(f"{manifest_path}: cannot read ({exc.strerror or exc})") from None
    return _parse_listing(directory, manifest_path, data)


def node_listings(directory: str) -> list[OutputListing]:
    """The node manifests (``manifest.<node>.json``) in `directory`, in name order: the directory
    is those target nodes' output directory (a local directory: node disks are never object stores)."""
    if "://" in directory:
        return []
    directory = os.path.abspath(directory)
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    out = []
    for name in names:
        if not is_node_manifest_name(name):  # manifest.<node>.json (output.placement=per_node)
            continue
        path = os.path.join(directory, name)
        try:
            data = read_small_file(path)
        except OSError as exc:
            raise LineageError(f"{path}: cannot read ({exc.strerror or exc})") from None
        try:
            claims_node = isinstance(json_document(data).get("node"), str)
        except (ValueError, UnicodeDecodeError, AttributeError):
            claims_node = False
        if claims_node:  # anything else named manifest.*.json is not the job's
            out.append(_parse_listing(directory, path, data))
    return out


def _parse_listing(directory: str, manifest_path: str, data: bytes) -> OutputListing:
    try:
        manifest = json_document(data)
        target = manifest["target"]
        written = [(entry["path"], "target_checkpoint", int(entry["rank"]), int(entry["size"]), entry["sha256"],
                    entry.get("node")) for entry in target.get("files") or []]
        strategy = target.get("strategy")
        if strategy:
            written.append((strategy["path"], "strategy", None, int(strategy["size"]), strategy["sha256"], None))
        node = manifest.get("node")
    except (ValueError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as exc:
        detail = f"missing {exc}" if isinstance(exc, KeyError) else \
            shorten(str(exc), 120) if type(exc) in (ValueError, json.JSONDecodeError) else type(exc).__name__
        raise LineageError(f"{manifest_path}: not a reshard_job manifest ({detail})") from None
    for path, _, _, _, digest, where in written:
        if not isinstance(path, str) or not isinstance(digest, str) or not looks_like_sha256(digest) \
                or not (where is None or isinstance(where, str)):
            raise LineageError(f"{manifest_path}: not a reshard_job manifest (bad entry for {str(path)[:80]!r})")

    written_into = _recorded_directory(target) or _directory_written_into([entry for entry in written])
    files = tuple(ListedFile(path=_where_now(path, written_into, directory), kind=kind, rank=rank, size=size,
                             sha256=digest.lower(), node=where)
                  for path, kind, rank, size, digest, where in written)
    run_id = manifest.get("run_id") if isinstance(manifest.get("run_id"), str) else None
    return OutputListing(directory=directory, manifest_path=manifest_path, manifest_sha256=hashlib.sha256(data).hexdigest(),
                         manifest_size=len(data), run_id=run_id or None, files=files,
                         node=node if isinstance(node, str) else None,
                         created_at=manifest.get("created_at") if isinstance(manifest.get("created_at"), str) else None)


def _recorded_directory(target: dict) -> str | None:
    """Where the files were written, from an entry that names its path relative to it (``file``);
    needed where files do not sit in ``rank_<r>/`` folders (an export's shards)."""
    for entry in target.get("files") or []:
        relative, path = entry.get("file"), entry.get("path")
        if isinstance(relative, str) and relative and isinstance(path, str) and path.endswith(os.sep + relative):
            return path[: -len(relative) - 1]
    return None


def _directory_written_into(written: list[tuple]) -> str | None:
    """The output directory as it was when the files were written: where the strategy file sat,
    else the parent of the ``rank_<r>`` folders."""
    for path, kind, *_ in written:
        if kind == "strategy":
            return dirname(path)
    for path, *_ in written:
        return dirname(dirname(path))
    return None


def _where_now(path: str, written_into: str | None, directory: str) -> str:
    relative = relative_to(path, written_into) if written_into else None
    return join(directory, relative or posixpath.basename(path.rstrip("/")))
