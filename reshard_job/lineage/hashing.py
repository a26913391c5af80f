"""Content hashing of files for lineage: the sha256 and size that identify an artifact.

Files are read in 1 MiB blocks so hashing a multi-gigabyte checkpoint needs constant memory.
The job usually knows the hash already (its writer hashes while writing), so this is mostly
for inputs and for ``audit verify``/``audit trace``, which must re-read the disk by design.
"""

from __future__ import annotations

import hashlib
import os

HASH_ALGO = "sha256"
_BLOCK = 1 << 20


def hash_file(path: str | os.PathLike) -> tuple[str, int]:
    """Return ``(sha256 hex, size in bytes)`` of the file at `path`."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(_BLOCK)
            if not block:
                break
            digest.update(block)
            size += len(block)
    return digest.hexdigest(), size


def looks_like_sha256(text: str) -> bool:
    """Whether `text` is a 64-character hex string (and so is taken as a hash, not a path)."""
    return len(text) == 64 and all(c in "0123456789abcdefABCDEF" for c in text)
