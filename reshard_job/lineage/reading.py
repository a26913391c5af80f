"""How lineage reads the files it is asked about: a content digest, a size, a small text file.

``audit trace`` and ``audit verify`` must look at the bytes as they are now, never at a cache,
so they read through these few functions and nothing else. They take local paths today; an
object-store URL will be served by routing them through ``reshard_job.storage.storage_for``
without touching their callers. The digest is the job's own (``reshard_job.hashing``), so the
audit and the job cannot disagree about what a file's sha256 is.
"""

from __future__ import annotations

import os

from ..hashing import digest_file

# A manifest lists every output with its digest: tens of kilobytes for thousands of ranks.
MAX_SMALL_FILE = 64 * 1024 * 1024


def content_digest(path: str) -> tuple[str, int]:
    """``(sha256 hex, size in bytes)`` of the file at `path`, read in full now.

    Raises ``OSError`` (``FileNotFoundError``, ``IsADirectoryError``, ...) as ``open`` does.
    """
    digest = digest_file(path)
    return digest.sha256, digest.size


def file_size(path: str) -> int:
    """The size of the file at `path`; ``OSError`` if it cannot be seen."""
    return os.stat(path).st_size


def exists(path: str) -> bool:
    return os.path.exists(path)


def is_directory(path: str) -> bool:
    return os.path.isdir(path)


def read_small_file(path: str) -> bytes:
    """The whole content of a small file (a manifest); ``OSError`` if unreadable or too large."""
    with open(path, "rb") as handle:
        data = handle.read(MAX_SMALL_FILE + 1)
    if len(data) > MAX_SMALL_FILE:
        raise OSError(27, f"larger than {MAX_SMALL_FILE} bytes", path)
    return data
