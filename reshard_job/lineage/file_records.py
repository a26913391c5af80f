"""What the job tells the lineage store about a file: its path, content hash, size, kind, rank.

Kept free of SQLAlchemy so that a job can describe its files without importing the database
layer (which is opened in a thread while the job works).
"""

from __future__ import annotations

from dataclasses import dataclass

from reshard_job.sources.file_digests import digest_file
from reshard_job.lineage.hash_names import looks_like_sha256

ARTIFACT_KINDS = ("source_checkpoint", "target_checkpoint", "strategy", "merged_strategy", "manifest")


@dataclass(frozen=True)
class FileRecord:
    """One file on disk, as the job read or wrote it."""

    path: str  # absolute path
    sha256: str  # hex
    size: int
    kind: str  # source_checkpoint | target_checkpoint | strategy | merged_strategy | manifest
    rank: int | None = None
    # An output the run copied byte for byte from one of its inputs (the target strategy file it was
    # given), not one it made from its sources: lineage must not join the runs that copied the same bytes.
    copied: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ARTIFACT_KINDS:
            raise ValueError(f"{self.path}: unknown artifact kind {self.kind!r} "
                             f"(expected one of {', '.join(ARTIFACT_KINDS)})")
        if not looks_like_sha256(self.sha256):
            raise ValueError(f"{self.path}: sha256 must be 64 hex characters, got {self.sha256!r}")
        if self.size < 0:
            raise ValueError(f"{self.path}: negative size {self.size}")

    @classmethod
    def from_file(cls, path: str, kind: str, rank: int | None = None, *, copied: bool = False) -> "FileRecord":
        """Hash the file at `path` (made absolute; a URL as it is) and describe it."""
        from reshard_job.storage import absolute

        digest = digest_file(absolute(path))
        return cls(path=digest.path, sha256=digest.sha256, size=digest.size, kind=kind, rank=rank, copied=copied)
