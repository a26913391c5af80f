"""Where the target files live, and how the driver checks them: on storage it sees, or on each node's own disk.

With ``output.placement=shared`` (the default) every file lies under ``output.dir`` as the driver
sees it, whichever machine wrote it: the driver verifies, keeps and journals the files itself
(``SharedOutputs``, a thin layer over ``OutputDir``).

With ``output.placement=per_node`` rank r's file is written under the same local ``output.dir`` on
the target node that holds rank r, a disk the driver cannot read. The choices made:

- **The driver's ``output.dir`` stays the record.** It holds the lock, the journal (each finished
  file with its size, sha256 and its identity *as its node saw it*), the target strategy, and
  ``manifest.json``, written last, listing every file with its rank, path and node, and each
  node's own manifest. The driver may run on one of the nodes (its directory is then also that
  node's directory: the names never clash) or elsewhere.
- **Whatever must look at a file runs where the file is**, as one small task per node
  (``RayExecutor.run_on_nodes``). Before converting, ``survey_node`` refuses a node directory
  holding another conversion's or someone else's files (unless ``output.overwrite``), removes
  the temporary files of killed attempts, verifies the files the journal (a resume) or the
  manifest (an identical rerun) holds done — same identity, else re-read and hashed — and takes
  the node's manifest down before anything there is rewritten. After converting,
  ``publish_node`` writes the target strategy and the node's manifest there.
- **A node's manifest** (``manifest.<node>.json``, e.g. ``manifest.reshard_node_1.json``) is the
  job's manifest restricted to that node's files, naming the node. Its presence means the
  node's files are complete; it is recorded in the lineage database with the other outputs, so
  ``audit verify`` accepts the node's directory, and a training job on that node loads only its
  own ranks from it. Files that changed on a node are found by the next run's survey and redone.

The node-side functions use only the local file system and return plain values: a problem they
find is a value (``problem``), turned into one ``OutputError`` line by the driver.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

from reshard_job.errors import OutputError
from reshard_job.jsonchunks import plain
from reshard_job.lineage.file_records import FileRecord
from reshard_job.storage import LOCAL, storage_for
from reshard_job.execute.tasks import RankResult
from reshard_job.text import rank_ranges
from reshard_job.job.output.journal import JournalEntry
from reshard_job.job.output.directory import OutputDir, removing, still_holds
from reshard_job.job.output.manifest_reading import read_manifest_summary

log = logging.getLogger("reshard_job")

NODE_MANIFEST_PREFIX = "manifest."
NODE_MANIFEST_SUFFIX = ".json"


def node_manifest_name(node: str) -> str:
    """``manifest.<node>.json``: the manifest of one node's files, next to them."""
    return f"{NODE_MANIFEST_PREFIX}{node}{NODE_MANIFEST_SUFFIX}"


def node_manifest_records(target: dict) -> list[FileRecord]:
    """The node manifests a job manifest's ``target`` section lists, as lineage output records."""
    return [FileRecord(m["path"], m["sha256"], m["size"], "manifest") for m in target.get("node_manifests") or []]


# ==================================================================================== node side


@dataclass(frozen=True)
class NodeFile:
    """A target file on a node: where it goes (relative to output.dir) and, once written, what it holds."""

    rank: int
    path: str
    size: int = 0
    sha256: str = ""
    identity: tuple = ()


@dataclass(frozen=True)
class SurveyRequest:
    out_dir: str
    node: str
    fingerprint: str
    expected: tuple[NodeFile, ...]  # every file this job writes on the node
    claims: tuple[NodeFile, ...] = ()  # those the driver holds done: verify them
    driver_fresh: bool = False  # the driver's directory holds nothing of this conversion
    overwrite: bool = False
    will_write: bool = True  # files there are about to be (re)written: take the node's manifest down


@dataclass(frozen=True)
class SurveyResult:
    node: str
    verified: tuple[int, ...] = ()  # claimed ranks whose files verify
    manifest: tuple[int, str] | None = None  # (size, sha256) of the node's manifest of this conversion
    removed: int = 0  # temporary files of killed attempts removed
    problem: str | None = None


def survey_node(req: SurveyRequest) -> SurveyResult:
    """On the node: is its output.dir usable for this conversion, and which claimed files verify?"""
    storage = storage_for(req.out_dir)
    problem = _unusable(req)
    if problem:
        return SurveyResult(req.node, problem=problem)
    path = os.path.join(req.out_dir, node_manifest_name(req.node))
    manifest, digest = _read_json(path)
    if manifest is not None and manifest.get("fingerprint") != req.fingerprint:
        if not req.overwrite:
            return SurveyResult(req.node, problem=_other(req, f"the outputs of a different conversion (run "
                                                              f"{manifest.get('run_id', '?')})"))
        _remove_listed(req.out_dir, manifest)
        removing(storage, path)
        manifest = digest = None
    if req.driver_fresh and manifest is None and not req.overwrite:
        present = [f.path for f in req.expected if os.path.lexists(os.path.join(req.out_dir, f.path))]
        if present:
            shown = ", ".join(present[:3]) + (", ..." if len(present) > 3 else "")
            return SurveyResult(req.node, problem=_other(req, f"files this tool did not produce ({shown})"))
    folders = sorted({os.path.dirname(f.path) for f in req.expected if os.path.dirname(f.path)})
    removed = storage.remove_incomplete(req.out_dir, folders) if os.path.isdir(req.out_dir) else 0
    verified = tuple(f.rank for f in req.claims if _verifies(req.out_dir, f))
    if req.will_write and manifest is not None:
        removing(storage, path)
        digest = None
    return SurveyResult(req.node, verified, digest, removed)


def _unusable(req: SurveyRequest) -> str | None:
    if os.path.lexists(req.out_dir) and not os.path.isdir(req.out_dir):
        return f"output.dir {req.out_dir} on {req.node} exists and is not a directory"
    for f in req.expected:
        folder = os.path.join(req.out_dir, os.path.dirname(f.path))
        where = os.path.realpath(folder)
        if os.path.lexists(folder) and not _inside(folder, req.out_dir):
            return (f"output.dir {req.out_dir} on {req.node}: {f.path} would be written to {where}, outside "
                    "output.dir (a symbolic link inside it points elsewhere); remove the link or choose another "
                    "output.dir")
    return None


def _other(req: SurveyRequest, what: str) -> str:
    return (f"output.dir {req.out_dir} on {req.node} holds {what}; choose another output.dir or set "
            "output.overwrite=true")


def _holds(path: str, data: bytes) -> bool:
    """Whether the file at `path` holds exactly `data` (reading no more than that)."""
    try:
        f = LOCAL.open_read(path)
    except Exception:  # noqa: BLE001 - absent, or not a file: writing it says what is wrong
        return False
    try:
        if f.size != len(data):
            return False
        have = bytearray(len(data))
        return f.pread_into(0, memoryview(have)) == len(data) and have == data
    finally:
        f.close()


def _read_json(path: str) -> tuple[dict | None, tuple[int, str] | None]:
    """What the job needs of a node's manifest and its (size, sha256), or (None, None) when absent;
    a damaged or unreadable one counts as another conversion's ({}, None). Read past what is not
    needed and bounded by what it lists (``manifest_reading``), never whole."""
    try:
        f = LOCAL.open_read(path)
    except FileNotFoundError:
        return None, None
    except Exception:  # noqa: BLE001 - a FIFO, a folder, no permission: not ours to trust
        return {}, None
    try:
        return read_manifest_summary(f)
    except Exception:  # noqa: BLE001 - damaged (ManifestDamaged), or it could not be read
        return {}, None
    finally:
        f.close()


def _inside(path: str, root: str) -> bool:
    path, root = os.path.realpath(path), os.path.realpath(root)
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _remove_listed(out_dir: str, manifest: dict) -> None:
    """Remove the files another conversion's node manifest lists, where they lie inside output.dir."""
    for f in (manifest.get("target") or {}).get("files") or []:
        if not isinstance(f, dict) or not isinstance(f.get("path"), str):
            continue
        path = os.path.join(out_dir, OutputDir._rel_listed(f))
        if _inside(os.path.dirname(path), out_dir):
            try:
                LOCAL.remove(path)
            except OSError:
                pass


def _verifies(out_dir: str, f: NodeFile) -> bool:
    """Same identity as when written, else the same sha256 read now (as ``OutputDir.verify`` does)."""
    full = os.path.join(out_dir, f.path)
    return still_holds(storage_for(full), full, f.size, f.sha256, f.identity)


@dataclass(frozen=True)
class PublishRequest:
    out_dir: str
    node: str
    files: tuple[NodeFile, ...]  # the node's target files, which must be there with these sizes
    manifest: bytes
    strategy_name: str | None = None
    strategy: bytes | None = None


def publish_node(req: PublishRequest) -> tuple[int, str] | str:
    """On the node: the target strategy, then the node's manifest, last. (size, sha256) of the
    manifest, or the problem found (a file gone or cut since it was written)."""
    storage = storage_for(req.out_dir)
    for f in req.files:
        info = storage.info(os.path.join(req.out_dir, f.path))
        if info is None or not info.is_file or info.size != f.size:
            return (f"output.dir {req.out_dir} on {req.node}: {f.path} is missing or changed size since it was "
                    "written; run the same command again to redo it")
    if req.strategy is not None and req.strategy_name:
        path = os.path.join(req.out_dir, req.strategy_name)
        if not _holds(path, req.strategy):  # a driver on this node wrote it already
            storage.write_bytes(path, req.strategy, mode=0o444)
    return storage.write_bytes(os.path.join(req.out_dir, node_manifest_name(req.node)), req.manifest, mode=0o444)


# ==================================================================================== driver side


class SharedOutputs:
    """``output.placement=shared``: the driver sees every file and checks it itself."""

    per_node = False

    def __init__(self, out: OutputDir):
        self.out = out

    def verify_complete(self, listed: list[JournalEntry], manifest: dict) -> tuple[list[JournalEntry], bool]:
        """(files of a complete directory that no longer verify, whether everything else is in place)."""
        return [e for e in listed if not self.out.verify(e)], True

    def reusable(self, paths: dict[int, str], *, resume: bool, fresh: bool) -> dict[int, JournalEntry]:
        return self.out.reusable(paths) if resume else {}

    def identity(self, result: RankResult) -> tuple:
        info = self.out.storage.info(result.path)
        return tuple(info.identity) if info is not None else ()

    def file_entry(self, entry: dict) -> dict:
        return entry

    def publish(self, build: Callable[..., dict], target: dict, tensors: dict,
                strategy: Callable[[], bytes | None]) -> dict:
        """Extra keys of the manifest's ``target`` section (none: the directory is the one place).
        `strategy`: the target strategy's bytes when asked (held compressed: not unpacked for nothing)."""
        return {}


class NodeOutputs:
    """``output.placement=per_node``: each node's files are checked and published by a task on that node."""

    per_node = True

    def __init__(self, out: OutputDir, executor: Any, placement: Callable[[int], str], fingerprint: str,
                 cluster: dict, *, overwrite: bool = False):
        self.out = out
        self.executor = executor  # a RayExecutor (run_on_nodes, output_identity)
        self.placement = placement
        self.fingerprint = fingerprint
        self.cluster = cluster  # {"nodes", "devices_per_node", "node_resource_prefix"} as settled
        self.overwrite = overwrite

    def node_of(self, rank: int) -> str:
        return self.placement(rank)

    def _survey(self, expected: dict[int, str], claims: list[JournalEntry], *, fresh: bool,
                will_write: bool) -> dict[str, SurveyResult]:
        by_node: dict[str, tuple[list[NodeFile], list[NodeFile]]] = {}
        for rank, path in sorted(expected.items()):
            by_node.setdefault(self.node_of(rank), ([], []))[0].append(NodeFile(rank, self.out.relative(path)))
        for e in claims:
            if self.node_of(e.rank) in by_node:
                by_node[self.node_of(e.rank)][1].append(NodeFile(e.rank, e.path, e.size, e.sha256, tuple(e.identity)))
        calls = {node: (SurveyRequest(self.out.path, node, self.fingerprint, tuple(exp), tuple(cl), fresh,
                                      self.overwrite, will_write),) for node, (exp, cl) in by_node.items()}
        holding = {node: "target rank" + ("s " if len(exp) > 1 else " ") + rank_ranges([f.rank for f in exp])
                   for node, (exp, _) in by_node.items()}
        found = self.executor.run_on_nodes(survey_node, calls, what=f"checking output.dir {self.out.path} on the "
                                                                     "target nodes", holding=holding)
        for result in found.values():
            if result.problem:
                raise OutputError(result.problem)
        removed = sum(r.removed for r in found.values())
        if removed:
            log.info("removed %d temporary file(s) left by an interrupted run on the nodes", removed)
        return found

    def verify_complete(self, listed: list[JournalEntry], manifest: dict) -> tuple[list[JournalEntry], bool]:
        expected = {e.rank: self.out.storage.join(self.out.path, e.path) for e in listed}
        found = self._survey(expected, listed, fresh=False, will_write=False)
        verified = {r for s in found.values() for r in s.verified}
        recorded = {m.get("node"): (m.get("size"), m.get("sha256"))
                    for m in (manifest.get("target") or {}).get("node_manifests") or []}
        stale = sorted(node for node, s in found.items()
                       if s.manifest is None or tuple(s.manifest) != tuple(recorded.get(node, ())))
        if stale:
            log.warning("%s: %s missing or changed on the node(s); writing again", self.out.path,
                        ", ".join(node_manifest_name(n) for n in stale[:4]))
        return [e for e in listed if e.rank not in verified], not stale

    def reusable(self, paths: dict[int, str], *, resume: bool, fresh: bool) -> dict[int, JournalEntry]:
        claims = [e for e in self.out.journal.read(paths)[1] if resume and paths.get(e.rank) ==
                  self.out.storage.join(self.out.path, e.path)]
        found = self._survey(paths, claims, fresh=fresh, will_write=True)
        verified = {r for s in found.values() for r in s.verified}
        keep = {}
        for e in claims:
            tensors = self.out.journal.tensors(e) if e.rank in verified else None
            if tensors is not None:  # a per-tensor record that is not the journaled one: redone
                e.tensors = tensors
                keep[e.rank] = e
        return keep

    def identity(self, result: RankResult) -> tuple:
        return self.executor.output_identity(result.target_rank)

    def file_entry(self, entry: dict) -> dict:
        return {**entry, "node": self.node_of(entry["rank"])}

    def publish(self, build: Callable[..., dict], target: dict, tensors: dict,
                strategy: Callable[[], bytes | None]) -> dict:
        """Each node's strategy copy and manifest, written there; the job manifest's extra ``target`` keys."""
        calls, paths = {}, {}
        strategy = strategy()
        for node in sorted({f["node"] for f in target["files"]}):
            files = [f for f in target["files"] if f["node"] == node]
            node_target = {**target, "files": files, "placement": "per_node", "cluster": self.cluster}
            manifest = build(target=node_target, tensors={str(f["rank"]): tensors[str(f["rank"])] for f in files},
                             node=node)
            data = (json.dumps(manifest, indent=2, default=plain) + "\n").encode("utf-8")
            strat = target.get("strategy")
            paths[node] = self.out.storage.join(self.out.path, node_manifest_name(node))
            calls[node] = (PublishRequest(self.out.path, node, tuple(NodeFile(f["rank"], self.out.relative(f["path"]),
                                                                              f["size"]) for f in files), data,
                                          self.out.storage.basename(strat["path"]) if strat else None, strategy),)
        written = self.executor.run_on_nodes(publish_node, calls, what=f"publishing output.dir {self.out.path} "
                                                                        "on the nodes")
        for answer in written.values():
            if isinstance(answer, str):
                raise OutputError(answer)
        return {"placement": "per_node", "cluster": self.cluster,
                "node_manifests": [{"node": node, "path": paths[node], "size": size, "sha256": sha}
                                   for node, (size, sha) in sorted(written.items())]}
