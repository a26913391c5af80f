"""How lineage names file contents: the hash algorithm, and what digests and prefixes look like.

The bytes themselves are hashed by ``reshard_job.sources.file_digests`` (one hasher for the whole package);
this module only judges text: a digest handed over by the job, or a reference typed by a user.
The audit prints 12-character digests and 8-character run ids, and accepts any unique prefix
of at least ``MIN_PREFIX_LENGTH`` characters back: long enough that a prefix is rarely
ambiguous (one in four billion per pair of records), short enough to copy from a table.
"""

from __future__ import annotations

HASH_ALGO = "sha256"
SHA256_HEX_LENGTH = 64
MIN_PREFIX_LENGTH = 8

_HEX = frozenset("0123456789abcdefABCDEF")


def is_hex(text: str) -> bool:
    return bool(text) and all(c in _HEX for c in text)


def looks_like_sha256(text: str) -> bool:
    """Whether `text` is a whole sha256 hex digest (64 hex characters)."""
    return len(text) == SHA256_HEX_LENGTH and is_hex(text)


def looks_like_digest_prefix(text: str) -> bool:
    """Whether `text` may name a content by a prefix of its sha256 (8 to 64 hex characters)."""
    return MIN_PREFIX_LENGTH <= len(text) <= SHA256_HEX_LENGTH and is_hex(text)
