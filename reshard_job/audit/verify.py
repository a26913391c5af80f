"""Is the file on disk still the one recorded? Re-read the bytes and compare.

Four subjects: a run (its recorded outputs, optionally its inputs), a file path (against the
content last recorded at that path), a content given by sha256 or a prefix of one (at every path
it was last recorded at), and an output directory (every file its ``manifest.json`` lists, against
the sha256 listed there, and the manifest itself, which must be a content the lineage database
recorded: a manifest edited to match edited files is caught here). No cache is trusted.

Each file ends in one state: ``ok``, ``missing``, ``changed``, ``unreadable``, (a directory's
manifest) ``unrecorded``, or (a file a loader would take that the manifest does not list)
``unlisted``. A manifest no recorded run wrote, over files that all verify, whose run is recorded
as stopped before completing, is *complete, not recorded* (``complete_unrecorded``; exit status 3).

For a run (given by id, or found from a directory's manifest), its recorded fingerprints are
checked too: every output parameter's must equal its source's, and the run's manifests must list
the recorded ones (a run recorded before fingerprints existed has none, which is said, not failed).
The report is intact only if every file is ``ok`` and no fingerprint disagrees.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from reshard_job.audit.entities import iso
from reshard_job.text import listed
from reshard_job.lineage.errors import AmbiguousRunError, LineageError, UnknownRunError
from reshard_job.audit.lookup import (ContentSubject, RunSubject, artifact_at_path, artifacts_by_digest,
                                      by_id_or_digest, resolve_run_id)
from reshard_job.audit.manifests import OutputListing, node_listings, read_listing
from reshard_job.formats.manifest_file import MANIFEST_FILE
from reshard_job.lineage.fingerprint_rows import read_fingerprints
from reshard_job.lineage.models import FINGERPRINT_SIDES, Artifact, ArtifactLocation, Event, Run
from reshard_job.lineage.status import RunStatus
from reshard_job.audit.queries import FingerprintSummary, fingerprint_summary, run_files
from reshard_job.audit.reading import (absolute, content_digest, environment_names_an_endpoint, exists, file_size,
                                       is_directory, json_document, read_small_file, reaching)
from reshard_job.audit.unlisted import unlisted_files
from reshard_job.storage import is_url

STATES = ("ok", "missing", "changed", "unreadable", "unrecorded", "unlisted")
# What a manifest's fingerprints are, against the database's: a disagreement is the only failure.
MANIFEST_STATES = ("agrees", "disagrees", "none", "unreadable")
NAMES_IN_A_LINE = 5


@dataclass
class FileCheck:
    """One file compared with its record."""

    path: str
    expected_sha256: str
    expected_size: int
    state: str = "ok"
    actual_sha256: str | None = None
    actual_size: int | None = None
    detail: str | None = None
    # What the record says about the file, as far as the subject tells.
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        entry = {"path": self.path, "expected_sha256": self.expected_sha256, "expected_size": self.expected_size,
                 "actual_sha256": self.actual_sha256, "actual_size": self.actual_size, "state": self.state}
        if self.detail is not None:
            entry["detail"] = self.detail
        return {**entry, **self.extra}


@dataclass(frozen=True)
class ParameterProblem:
    """Parameters whose fingerprints disagree, as one entry of ``VerifyReport.problems``: its
    ``path`` and ``state`` read like a file's, so a failed verify's one-line summary names them."""

    names: tuple[str, ...]
    state: str

    @property
    def path(self) -> str:
        if not self.names:  # a manifest at odds as a whole (its algorithm, its shape)
            return "the recorded"
        return f"parameter{'s' if len(self.names) != 1 else ''} {listed(self.names, NAMES_IN_A_LINE, repr)}"


@dataclass(frozen=True)
class ManifestFingerprints:
    """A manifest's ``fingerprints`` against the database's record of the same run."""

    path: str
    state: str  # one of MANIFEST_STATES
    differ: tuple[str, ...] = ()  # parameters listed differently (or on one side only)
    detail: str | None = None

    def to_json(self) -> dict[str, Any]:
        entry = {"path": self.path, "state": self.state, "differ": list(self.differ)}
        if self.detail is not None:
            entry["detail"] = self.detail
        return entry


@dataclass
class FingerprintCheck:
    """A run's recorded fingerprints: outputs against sources, and each manifest against the database."""

    summary: FingerprintSummary
    manifests: list[ManifestFingerprints] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.summary.equal and all(m.state != "disagrees" for m in self.manifests)

    @property
    def problems(self) -> list[ParameterProblem]:
        mismatches = self.summary.mismatches
        out = []
        differ = tuple(m.name for m in mismatches if m.source is not None)
        if differ:
            out.append(ParameterProblem(differ, "fingerprint differs from the source's"))
        unsourced = tuple(m.name for m in mismatches if m.source is None)
        if unsourced:
            out.append(ParameterProblem(unsourced, "has no source fingerprint"))
        out += [ParameterProblem(m.differ, f"fingerprints disagree with {m.path}"
                                 + (f" ({m.detail})" if m.detail else "")) for m in self.manifests
                if m.state == "disagrees"]
        return out

    def to_json(self) -> dict[str, Any]:
        return {**self.summary.to_json(), "ok": self.ok, "manifests": [m.to_json() for m in self.manifests]}


@dataclass
class VerifyReport:
    files: list[FileCheck]
    run_id: str | None = None
    run_status: str | None = None
    path: str | None = None  # the file or directory verified, when not a run
    fingerprints: FingerprintCheck | None = None  # None: no run to check them for (a file path)
    sha256: str | None = None  # the content verified (at every path it was recorded at), when given by digest

    def count(self, state: str) -> int:
        return sum(1 for f in self.files if f.state == state)

    @property
    def files_intact(self) -> bool:
        return all(f.state == "ok" for f in self.files)

    @property
    def intact(self) -> bool:
        return self.files_intact and (self.fingerprints is None or self.fingerprints.ok)

    @property
    def complete_unrecorded(self) -> bool:
        """Every listed file verifies, but its manifest was never recorded as written: the job was
        stopped after publishing the manifest and before recording its run (rerun it to record)."""
        unrecorded = [f for f in self.files if f.state != "ok"]
        return bool(unrecorded) and all(f.state == "unrecorded" and f.extra.get("complete") for f in unrecorded) \
            and (self.fingerprints is None or self.fingerprints.ok)

    @property
    def problems(self) -> list[FileCheck | ParameterProblem]:
        files: list[FileCheck | ParameterProblem] = [f for f in self.files if f.state != "ok"]
        return files + (self.fingerprints.problems if self.fingerprints is not None else [])

    def to_json(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "run_status": self.run_status, "path": self.path, "sha256": self.sha256,
                "intact": self.intact, "complete_unrecorded": self.complete_unrecorded,
                "checked": len(self.files), **{state: self.count(state) for state in STATES},
                "files": [f.to_json() for f in self.files],
                "fingerprints": None if self.fingerprints is None else self.fingerprints.to_json()}


def check_file(path: str, expected_sha256: str, expected_size: int, **extra: Any) -> FileCheck:
    """Compare one file on disk with its record; one of another size differs, and is not hashed
    (a 5 GB file in the place of a 42 kB output took 20 s to find changed)."""
    check = FileCheck(path, expected_sha256.lower(), expected_size, extra=extra)
    try:
        check.actual_size = file_size(path)
        if check.actual_size != expected_size:
            check.state, check.detail = "changed", f"{check.actual_size} bytes, recorded {expected_size}"
            return check
        check.actual_sha256, check.actual_size = content_digest(path)
    except FileNotFoundError:
        check.state = "missing"
    except IsADirectoryError:
        check.state, check.detail = "changed", "is a directory"
    except OSError as exc:
        check.state, check.detail = "unreadable", exc.strerror or str(exc)
    else:
        if (check.actual_sha256, check.actual_size) != (check.expected_sha256, expected_size):
            check.state = "changed"
    return check


def verify_run(session: Session, run_id: str, *, include_inputs: bool = False) -> VerifyReport:
    """Re-hash a run's recorded outputs (and optionally inputs) and compare with the record."""
    run = session.get(Run, run_id)
    if run is None:
        raise UnknownRunError(run_id)
    directions = ["output", "input"] if include_inputs else ["output"]
    files = [check_file(f.path, f.digest, f.size, direction=direction, kind=f.kind, rank=f.rank)
             for direction in directions for f in run_files(session, run_id, direction)]
    if not files:
        what = "files" if include_inputs else "outputs"
        raise LineageError(f"run {run_id} is {run.status} and has no recorded {what} to verify")
    manifests = [f.path for f in files if f.extra.get("direction") == "output" and f.extra.get("kind") == "manifest"]
    return VerifyReport(files, run_id=run_id, run_status=str(run.status),
                        fingerprints=check_fingerprints(session, run_id, manifests))


def check_fingerprints(session: Session, run_id: str, manifests: list[str]) -> FingerprintCheck:
    """Compare the run's recorded output fingerprints with its source ones, and with what each of
    `manifests` (the run's manifest files, as they are now) lists; nothing recorded is no failure."""
    check = FingerprintCheck(fingerprint_summary(session, run_id))
    if not check.summary.recorded:
        return check
    recorded = None
    for path in manifests:
        section = _manifest_section(path)
        if isinstance(section, ManifestFingerprints):
            check.manifests.append(section)
            continue
        recorded = recorded or read_fingerprints(session, run_id)
        check.manifests.append(_compare_manifest(path, section, recorded))
    return check


def _manifest_section(path: str) -> Any:
    """The manifest's ``fingerprints`` section, or the ``ManifestFingerprints`` saying why there is none.

    A manifest that cannot be read is reported by its file check; here it only goes unused."""
    try:
        manifest = json_document(read_small_file(path))
    except FileNotFoundError:
        return ManifestFingerprints(path, "unreadable", detail="missing")
    except OSError as exc:
        return ManifestFingerprints(path, "unreadable", detail=exc.strerror or str(exc))
    except (ValueError, UnicodeDecodeError):
        return ManifestFingerprints(path, "unreadable", detail="not JSON")
    section = manifest.get("fingerprints") if isinstance(manifest, dict) else None
    if section is None:
        return ManifestFingerprints(path, "none")
    if not isinstance(section, dict):
        return ManifestFingerprints(path, "disagrees", detail="its fingerprints are not a mapping")
    return section


def _compare_manifest(path: str, section: dict, recorded: dict[str, Any]) -> ManifestFingerprints:
    differ: set[str] = set()
    for side in FINGERPRINT_SIDES:
        listed = section.get(side) if isinstance(section.get(side), dict) else {}
        held = recorded[side]
        differ |= {name for name in listed.keys() | held.keys() if _hex(listed.get(name)) != _hex(held.get(name))}
    detail = None
    if section.get("algorithm") != recorded["algorithm"]:
        detail = f"algorithm {str(section.get('algorithm'))[:40]!r}, recorded {recorded['algorithm']!r}"
    state = "disagrees" if differ or detail else "agrees"
    return ManifestFingerprints(path, state, tuple(sorted(differ)), detail)


def _hex(digest: Any) -> Any:
    return digest.lower() if isinstance(digest, str) else digest


def verify_path(session: Session, path: str) -> VerifyReport:
    """Compare the file at `path` with the content last recorded at that path."""
    where = absolute(path)
    recorded = artifact_at_path(session, where)
    if recorded is None:
        raise LineageError(f"{where}: no file was ever recorded at this path")
    artifact, location = recorded
    runs = list(session.scalars(
        select(Event.run_id).where(Event.artifact_id == artifact.id,
                                   or_(Event.path == location.path, Event.path == where))
        .distinct().order_by(Event.run_id)))
    checked = check_file(where, artifact.digest, artifact.size, kind=artifact.kind, rank=artifact.rank,
                         last_recorded=iso(location.last_seen), run_ids=runs)
    return VerifyReport([checked], path=where)


def _manifest_check(session: Session, listing: OutputListing) -> FileCheck:
    """The manifest itself: its bytes must be a content a recorded run wrote."""
    producers = []
    for artifact in artifacts_by_digest(session, listing.manifest_sha256, listing.manifest_size):
        producers += session.scalars(select(Event.run_id).where(Event.artifact_id == artifact.id,
                                                                Event.direction == "output")
                                     .distinct().order_by(Event.run_id))
    manifest = FileCheck(listing.manifest_path, listing.manifest_sha256, listing.manifest_size,
                         actual_sha256=listing.manifest_sha256, actual_size=listing.manifest_size,
                         extra={"kind": "manifest", "rank": None, "run_ids": producers})
    if listing.node is not None:
        manifest.extra["node"] = listing.node
    if not producers:
        manifest.state = "unrecorded"
        manifest.detail = "no recorded run wrote this manifest"
        run = session.get(Run, listing.run_id) if listing.run_id else None
        if run is not None and run.status != RunStatus.COMPLETED:
            # The run that wrote it was stopped between publishing the manifest and recording itself.
            manifest.extra["complete"] = True
            manifest.detail = (f"complete, not recorded: rerun to record (run {listing.run_id} that wrote it "
                               f"is {run.status})")
    return manifest


def _damaged_is_not_unrecorded(manifests: list[FileCheck]) -> None:
    """Listed files that do not verify: the directory is damaged, whatever its manifest's record says."""
    for manifest in manifests:
        if manifest.extra.pop("complete", None):
            manifest.detail = "no recorded run wrote this manifest"


def _listed_checks(listing: OutputListing) -> list[FileCheck]:
    return [check_file(f.path, f.sha256, f.size, kind=f.kind, rank=f.rank, **({"node": f.node} if f.node else {}))
            for f in listing.files]


def verify_directory(session: Session, directory: str) -> VerifyReport:
    """Check every file an output directory's manifest lists, and that the manifest is recorded.

    With ``output.placement=per_node`` the files lie on the target nodes' disks: a node's
    directory is checked against the node manifests it holds (``manifest.<node>.json``, each of
    which must be recorded); the job's ``manifest.json``, where the driver left it there, only
    for being recorded, as its other files are on other machines."""
    nodes = node_listings(directory)
    listing = read_listing(directory) if not nodes or os.path.exists(os.path.join(directory, MANIFEST_FILE)) \
        else None
    if not nodes and listing.per_node:
        held = sorted({f.node for f in listing.files if f.node})
        raise LineageError(f"{listing.directory}: its files were written on the target nodes' own disks "
                           f"(output.placement=per_node); verify the same directory on each node "
                           f"({', '.join(held[:4])}{', ...' if len(held) > 4 else ''})")
    files, manifests = [], []
    for part in nodes or [listing]:
        files += _listed_checks(part)
        manifests.append(_manifest_check(session, part))
    files += [] if nodes else [FileCheck(p, "", 0, "unlisted", detail="not in the manifest") for p in  # a loader's too
                               unlisted_files(listing.directory, {f.path for f in files}, listing.manifest_path)]
    if nodes and listing is not None:
        manifests.append(_manifest_check(session, listing))
    if any(f.state != "ok" for f in files):
        _damaged_is_not_unrecorded(manifests)
    files = list({f.path: f for f in files}.values()) + manifests  # node manifests each list the strategy
    producers = [r for m in manifests for r in m.extra["run_ids"]]
    listing = listing or nodes[0]
    run_id = listing.run_id if listing.run_id in producers else (producers[0] if len(set(producers)) == 1 else None)
    status = fingerprints = None
    if run_id is not None:
        run = session.get(Run, run_id)
        status = None if run is None else str(run.status)
        fingerprints = check_fingerprints(session, run_id, [m.path for m in manifests])
    return VerifyReport(files, run_id=run_id, run_status=status, path=listing.directory, fingerprints=fingerprints)


def verify_content(session: Session, artifact_id: int) -> VerifyReport:
    """Re-hash a content at every path it was recorded at, where it is still the last content
    recorded there (a path rewritten since holds another file now, verified by its own record)."""
    artifact = session.get(Artifact, artifact_id)
    checks = []
    for location in session.scalars(select(ArtifactLocation).where(ArtifactLocation.artifact_id == artifact_id)
                                    .order_by(ArtifactLocation.first_seen, ArtifactLocation.id)):
        latest = artifact_at_path(session, location.path)
        if latest is not None and latest[0].id != artifact_id:
            continue
        runs = list(session.scalars(select(Event.run_id).where(Event.artifact_id == artifact_id,
                                                               Event.path == location.path)
                                    .distinct().order_by(Event.run_id)))
        checks.append(check_file(location.path, artifact.digest, artifact.size, kind=artifact.kind,
                                 rank=artifact.rank, last_recorded=iso(location.last_seen), run_ids=runs))
    if not checks:
        raise LineageError(f"sha256 {artifact.digest}: every path it was recorded at has held another "
                           f"recorded file since; verify those paths instead")
    return VerifyReport(checks, sha256=artifact.digest)


def verify(session: Session, ref: str, *, include_inputs: bool = False) -> VerifyReport:
    """Verify an output directory, a file path, a run (id or unique prefix) or a content (sha256 or
    unique prefix of one, as ``trace`` and ``graph`` take it). Objects are reached at the endpoint
    the run that recorded them used, where the environment names none (``reading.reaching``)."""
    with reaching(_recorded_endpoint(session, ref)):
        return _verify(session, ref, include_inputs)


def _recorded_endpoint(session: Session, ref: str) -> str | None:
    """The object-store endpoint recorded by a run that `ref` names or that recorded files at `ref`."""
    if environment_names_an_endpoint() or (not is_url(ref) and (os.sep in ref or exists(ref))):
        return None  # the environment's endpoint wins; a local path needs none
    if is_url(ref):
        url = absolute(ref)
        at_or_under = or_(Event.path == url, Event.path.startswith(url + "/", autoescape=True))
        runs = select(Run).where(or_(Run.output_dir == url, Run.id.in_(select(Event.run_id).where(at_or_under))))
    else:
        try:
            subject = by_id_or_digest(session, ref.strip())
        except LineageError:
            return None
        if isinstance(subject, RunSubject):
            runs = select(Run).where(Run.id == subject.run_id)
        elif isinstance(subject, ContentSubject):
            used = select(Event.run_id).where(Event.artifact_id == subject.root.artifact_id)
            runs = select(Run).where(Run.id.in_(used))
        else:
            return None
    for run in session.scalars(runs.order_by(Run.started_at.desc(), Run.id)):
        endpoint = _endpoint_of(run.config)
        if endpoint is not None:
            return endpoint
    return None


def _endpoint_of(config) -> str | None:
    """``storage.endpoint_url`` of a recorded config (or the one its ``storage.options`` name)."""
    storage = config.get("storage") if isinstance(config, dict) else None
    if not isinstance(storage, dict):
        return None
    options = storage.get("options") if isinstance(storage.get("options"), dict) else {}
    client = options.get("client_kwargs") if isinstance(options.get("client_kwargs"), dict) else {}
    for endpoint in (storage.get("endpoint_url"), options.get("endpoint_url"), client.get("endpoint_url")):
        if isinstance(endpoint, str) and endpoint.strip() and "***" not in endpoint:  # masked: not usable
            return endpoint.strip()
    return None


def _verify(session: Session, ref: str, include_inputs: bool) -> VerifyReport:
    if is_directory(ref):
        return verify_directory(session, ref)
    if os.sep in ref or exists(ref):
        return verify_path(session, ref)
    subject = by_id_or_digest(session, ref.strip())
    if isinstance(subject, RunSubject):
        return verify_run(session, subject.run_id, include_inputs=include_inputs)
    if isinstance(subject, ContentSubject):
        return verify_content(session, subject.root.artifact_id)
    try:
        run_id = resolve_run_id(session, ref)
    except AmbiguousRunError:
        raise
    except LineageError as not_a_run:  # unknown, or too short for a prefix: maybe a file name
        if artifact_at_path(session, absolute(ref)) is not None:
            return verify_path(session, ref)
        if isinstance(not_a_run, UnknownRunError):
            raise LineageError(f"no run with id {ref!r}, no file with a sha256 starting so, and no file "
                               f"recorded at {absolute(ref)}") from None
        raise
    return verify_run(session, run_id, include_inputs=include_inputs)
