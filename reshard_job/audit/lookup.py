"""From what a user typed to what the database holds: runs, contents, paths, output directories.

The audit prints 12-character digests and short run ids, so it must take them back: a run id or a
sha256 may be given whole or as a unique prefix of at least ``MIN_PREFIX_LENGTH`` characters.
A reference is read in this order, first match wins:

1. an existing directory: an output directory, by the files its ``manifest.json`` lists;
2. an existing file: looked up by its content (hashed now), wherever it was recorded;
3. a run id or run id prefix, and a sha256 or sha256 prefix: both are looked up, and a reference
   matching a run *and* a content is refused as ambiguous rather than guessed;
4. a path that no longer exists: what was last recorded at that path.

Prefix lookups are ``LIKE 'prefix%'``. On SQLite, whose ``LIKE`` ignores case and so cannot use
an index, a range (``digest >= prefix AND digest < prefix || U+10FFFF``, exact in SQLite's binary
collation) is added so the digest and primary-key indexes answer it. PostgreSQL gets no range:
under a linguistic collation such a bound can exclude real matches.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Union

from sqlalchemy import select
from sqlalchemy.orm import Session

from reshard_job.lineage.hash_names import MIN_PREFIX_LENGTH, SHA256_HEX_LENGTH, looks_like_digest_prefix, looks_like_sha256
from reshard_job.audit.entities import ArtifactInfo
from reshard_job.lineage.errors import AmbiguousReferenceError, AmbiguousRunError, LineageError, UnknownRunError
from reshard_job.audit.manifests import OutputListing, read_listing
from reshard_job.lineage.models import Artifact, ArtifactLocation, Event, Run
from reshard_job.audit.reading import absolute, content_digest, exists, is_directory, path_forms

# Enough candidates to say "matches N" without reading them all.
_CANDIDATES = 11


# -- runs ----------------------------------------------------------------------------------------

def _starts_with(session: Session, column, prefix: str):
    condition = column.startswith(prefix, autoescape=True)
    if session.get_bind().dialect.name == "sqlite":
        # Byte order: every string starting with `prefix` sorts in [prefix, prefix + U+10FFFF).
        condition = condition & (column >= prefix) & (column < prefix + "\U0010ffff")
    return condition


def runs_with_prefix(session: Session, prefix: str) -> list[str]:
    return list(session.scalars(select(Run.id).where(_starts_with(session, Run.id, prefix)).order_by(Run.id)
                                .limit(_CANDIDATES)))


def resolve_run_id(session: Session, ref: str) -> str:
    """The full id of the run that `ref` names: the whole id, or a unique prefix of 8+ characters."""
    ref = ref.strip()
    if not ref:
        raise UnknownRunError(ref)
    if session.get(Run, ref) is not None:
        return ref
    if len(ref) < MIN_PREFIX_LENGTH:
        raise LineageError(f"run id {ref!r} is too short: give the whole id or a prefix of at least "
                           f"{MIN_PREFIX_LENGTH} characters")
    matches = runs_with_prefix(session, ref)
    if not matches:
        raise UnknownRunError(ref)
    if len(matches) > 1:
        raise AmbiguousRunError(ref, matches)
    return matches[0]


# -- contents ------------------------------------------------------------------------------------

def artifacts_by_digest(session: Session, digest: str, size: int | None = None) -> list[Artifact]:
    query = select(Artifact).where(Artifact.digest == digest.lower())
    if size is not None:
        query = query.where(Artifact.size == size)
    return list(session.scalars(query.order_by(Artifact.id)))


def artifacts_with_digest_prefix(session: Session, prefix: str) -> list[Artifact]:
    prefix = prefix.lower()
    if len(prefix) == SHA256_HEX_LENGTH:
        return artifacts_by_digest(session, prefix)
    return list(session.scalars(select(Artifact).where(_starts_with(session, Artifact.digest, prefix))
                                .order_by(Artifact.digest, Artifact.id).limit(_CANDIDATES)))


def artifact_at_path(session: Session, path: str) -> tuple[Artifact, ArtifactLocation] | None:
    """The content most recently seen at `path` (absolute, or resolved through symbolic links)."""
    candidates = path_forms(path)
    row = session.execute(
        select(Artifact, ArtifactLocation).join(ArtifactLocation, ArtifactLocation.artifact_id == Artifact.id)
        .where(ArtifactLocation.path.in_(sorted(candidates)))
        .order_by(ArtifactLocation.last_seen.desc(), ArtifactLocation.id.desc()).limit(1)
    ).first()
    return None if row is None else (row[0], row[1])


def artifact_info(session: Session, artifact: Artifact) -> ArtifactInfo:
    locations = session.scalars(select(ArtifactLocation).where(ArtifactLocation.artifact_id == artifact.id)
                                .order_by(ArtifactLocation.first_seen, ArtifactLocation.id))
    return ArtifactInfo.from_model(artifact, locations)


def use_at_path(session: Session, artifact_id: int, path: str) -> tuple[str | None, int | None]:
    """The role and rank this content last had at `path` in a run, or (None, None)."""
    row = session.execute(select(Event.role, Event.rank).where(Event.artifact_id == artifact_id, Event.path == path)
                          .order_by(Event.recorded_at.desc(), Event.id.desc()).limit(1)).first()
    return (None, None) if row is None else (row[0], row[1])


def root_at_path(session: Session, artifact_id: int, path: str) -> "Root":
    return Root(artifact_id, path, *use_at_path(session, artifact_id, path))


# -- subjects: what a reference names ------------------------------------------------------------

@dataclass(frozen=True)
class Root:
    """One content to start from, and the path and role it was reached through (if any)."""

    artifact_id: int
    path: str | None = None
    kind: str | None = None
    rank: int | None = None


@dataclass(frozen=True)
class ContentSubject:
    """A single file content: a path (hashed now), a digest or prefix, or a recorded path."""

    root: Root
    query: dict = field(default_factory=dict)


@dataclass(frozen=True)
class DirectorySubject:
    """An output directory: the contents its manifest lists."""

    listing: OutputListing
    roots: tuple[Root, ...]
    query: dict = field(default_factory=dict)


@dataclass(frozen=True)
class RunSubject:
    run_id: str
    query: dict = field(default_factory=dict)


Subject = Union[ContentSubject, DirectorySubject, RunSubject]


def resolve(session: Session, ref: str) -> Subject:
    """What `ref` names (see the module docstring); a one-line ``LineageError`` when nothing or
    more than one thing matches."""
    if is_directory(ref):
        return _directory(session, ref)
    if exists(ref):
        return _existing_file(session, ref)
    if os.sep not in ref:
        found = by_id_or_digest(session, ref.strip())
        if found is not None:
            return found
    return _recorded_path(session, ref)


def _directory(session: Session, ref: str) -> DirectorySubject:
    listing = read_listing(ref)
    roots = []
    for listed in listing.files:
        found = artifacts_by_digest(session, listed.sha256, listed.size)
        if not found:
            raise LineageError(f"{listed.path}: sha256 {listed.sha256} listed in {listing.manifest_path} is not in "
                               f"the lineage database")
        roots.append(Root(found[0].id, listed.path, listed.kind, listed.rank))
    query = {"path": listing.directory, "manifest": listing.manifest_path, "manifest_sha256": listing.manifest_sha256,
             "note": "traced by the sha256 its manifest lists; 'audit verify' re-reads the files"}
    return DirectorySubject(listing, tuple(roots), query)


def _existing_file(session: Session, ref: str) -> ContentSubject:
    path = absolute(ref)
    try:
        digest, size = content_digest(path)
    except OSError as exc:
        raise LineageError(f"{path}: cannot read ({exc.strerror or exc})") from None
    found = artifacts_by_digest(session, digest, size)
    if not found:
        recorded = artifact_at_path(session, path)
        if recorded is not None:
            raise LineageError(f"{path}: content sha256 {digest} is not in the lineage database; this path was "
                               f"recorded with sha256 {recorded[0].digest}, so the file changed since")
        raise LineageError(f"{path}: content sha256 {digest} is not in the lineage database")
    # Equal digests of different sizes would take a broken hash; the first is the answer.
    return ContentSubject(root_at_path(session, found[0].id, path), {"path": path, "sha256": digest})


def by_id_or_digest(session: Session, ref: str) -> Subject | None:
    run_ids: list[str] = []
    if ref:
        if session.get(Run, ref) is not None:
            return RunSubject(ref, {"run_id": ref})
        if len(ref) >= MIN_PREFIX_LENGTH:
            run_ids = runs_with_prefix(session, ref)
    contents = artifacts_with_digest_prefix(session, ref) if looks_like_digest_prefix(ref) else []
    digests = sorted({a.digest for a in contents})
    if run_ids and digests:
        raise AmbiguousReferenceError(ref, [f"run {r}" for r in run_ids] + [f"sha256 {d[:16]}…" for d in digests])
    if len(run_ids) > 1:
        raise AmbiguousRunError(ref, run_ids)
    if run_ids:
        return RunSubject(run_ids[0], {"run_id": run_ids[0]})
    if len(digests) > 1:
        raise AmbiguousReferenceError(ref, [f"sha256 {d[:16]}…" for d in digests])
    if contents:
        artifact = contents[0]
        return ContentSubject(Root(artifact.id), {"sha256": artifact.digest, "path": None})
    if looks_like_sha256(ref):
        raise LineageError(f"no file with sha256 {ref.lower()} in the lineage database")
    return None


def _recorded_path(session: Session, ref: str) -> ContentSubject:
    path = absolute(ref)
    recorded = artifact_at_path(session, path)
    if recorded is None:
        if os.sep in ref or len(ref) < MIN_PREFIX_LENGTH:
            raise LineageError(f"{path}: no such file, and no file was ever recorded at this path")
        raise LineageError(f"{ref!r} matches no run id, sha256 or prefix of one in the lineage database, and "
                           f"no file {path} exists or was ever recorded")
    return ContentSubject(root_at_path(session, recorded[0].id, path),
                          {"path": path, "sha256": recorded[0].digest,
                           "note": "file not on disk; traced what was recorded at this path"})
