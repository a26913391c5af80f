"""The source index cache: what walking a local `.ckpt` file's records found, kept by file identity.

Opening a checkpoint walks its records to learn where every tensor lies (``CheckpointReader``):
0.13 s for an 8-rank 2 GB model here, paid again by every ``job.mode=plan``, every rerun that finds
its output complete and every resumed run. The walk's result depends on the file's bytes only, so it is kept,
like the source digests (``sources.file_digests.HashCache``), under the file's identity (device, inode, size,
modification and change times): a file that changed in any way gets a new identity and is walked
again. The same trust as the digest cache, which already lets a rerun skip hashing unchanged files.

Only files whose walk is slow are kept: those of large records (``worth_keeping``), where the walk
reads each record's head with its own read (about 20 µs a record). Files of small records are
parsed from large windows at 2-3 µs a record, which is what reading a document back costs too:
measured on 8 files of 300,000 small records, planning took 15.1 s walking and 17.0 s from kept
documents (and writing them 5 s more), so they are walked.

One compressed JSON document per source file (zlib's checksum refuses a damaged one), in the
user's cache folder beside the digests; at most ``MAX_FILES`` documents and ``MAX_BYTES`` are kept
(the least recently used go). A cache never fails a job: a document that cannot be read, does not match or does not fit the file
is ignored and the file walked (``CheckpointReader._load_index`` checks every range against the file),
and so is one that inflates beyond ``MAX_DOCUMENT_BYTES`` or holds an integer of over 20 digits.
Only local files: an object's walk is also its hashing read (``sources.file_digests.DigestingReader``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import zlib

from reshard_job.json_stream import MAX_INT_DIGITS
from reshard_job.sources.file_digests import default_cache_path
from reshard_job.storage.cache_files import mark_used, remove_least_recently_used, write_cache_file

MAX_FILES = 512  # documents kept; the least recently used beyond are removed
MAX_BYTES = 256 * 1024 * 1024  # and their bytes
LARGE_RECORDS = 32 * 1024  # mean bytes per tensor from which a file's walk reads record heads one by one
MAX_DOCUMENT_BYTES = 64 * 1024 * 1024  # an index document (some 100 bytes a tensor) read back: larger is ignored
# scanned for in the text rather than checked per integer while parsing (a Python callback per
# number made reading the 8 documents of a 2 GB model cost 0.25 s, a sixth of a no-op rerun)
_LONG_DIGITS = re.compile(rb"\d{%d}" % (MAX_INT_DIGITS + 1))


def worth_keeping(file_size: int, tensors: int) -> bool:
    """Whether a file's index is worth keeping: its records are large on average (see above)."""
    return tensors > 0 and file_size / tensors >= LARGE_RECORDS


class IndexCache:
    """Index documents of local source files by path and identity (see the module docstring)."""

    def __init__(self, folder: str | None = None):
        self.folder = folder or os.path.join(os.path.dirname(default_cache_path()), "source-index.d")

    def _file(self, path: str) -> str:
        key = hashlib.sha256(os.path.abspath(path).encode("utf-8", "surrogateescape")).hexdigest()[:32]
        return os.path.join(self.folder, key + ".json.z")

    def get(self, path: str, identity: tuple) -> dict | None:
        """The index document kept for `path` as it is now (`identity`), or None."""
        if not identity:
            return None
        doc_path = self._file(path)
        try:
            with open(doc_path, "rb") as f:
                inflate = zlib.decompressobj()
                text = inflate.decompress(f.read(MAX_DOCUMENT_BYTES), MAX_DOCUMENT_BYTES)
            if inflate.unconsumed_tail or not inflate.eof:
                return None  # larger than any document kept, or cut short: walk the file
            if _LONG_DIGITS.search(text):  # an integer of absurd length (or such digits in a name): walk
                return None
            doc = json.loads(text)
            mark_used(doc_path)  # recently used: kept when older ones are removed
        except (OSError, ValueError, RecursionError, zlib.error):
            return None
        if not isinstance(doc, dict) or doc.get("path") != os.path.abspath(path) or \
                doc.get("identity") != list(identity) or not isinstance(doc.get("index"), dict):
            return None
        return doc["index"]

    def put(self, path: str, identity: tuple, index: dict) -> None:
        """Keep `index` (``CheckpointReader.index_document``) for `path` as it is (`identity`)."""
        if not identity:
            return
        payload = zlib.compress(json.dumps({"path": os.path.abspath(path), "identity": list(identity),
                                            "index": index}, separators=(",", ":")).encode(), 1)
        if write_cache_file(self._file(path), payload):
            self._trim()

    def _trim(self) -> None:
        remove_least_recently_used(self.folder, ".json.z", max_files=MAX_FILES, max_bytes=MAX_BYTES)
