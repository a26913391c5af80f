"""The resume journal: which target files of an unfinished conversion are done.

``<output.dir>/.reshard_job/journal.jsonl`` starts with the conversion's fingerprint; each
finished target file adds one line (rank, path relative to the output directory, size, sha256,
and its storage identity right after it was written), durably, as soon as it lands, so a crash
loses at most the ranks in flight. Per-tensor digests, which are large for models with many
parameters, go to ``.reshard_job/tensors/rank_<r>.json`` before the line is added.

The identity lets a rerun trust a file without reading it again: as long as the file's identity
(inode, size, modification and change time) is the one journaled, its bytes are the ones hashed
(the argument of the source digest cache). A file whose identity changed is re-hashed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from reshard_job.jsonchunks import iter_json
from reshard_job.storage import Storage

STATE_DIR = ".reshard_job"
JOURNAL_FILE = "journal.jsonl"
TENSORS_DIR = "tensors"
MAX_JOURNAL_BYTES = 1 << 30
MAX_TENSORS_BYTES = 1 << 31


@dataclass
class JournalEntry:
    rank: int
    path: str  # relative to the output directory
    size: int
    sha256: str
    identity: tuple = ()
    tensors: dict[str, str] = field(default_factory=dict)  # filled from the tensors file when needed

    def line(self) -> bytes:
        return (json.dumps({"rank": self.rank, "path": self.path, "size": self.size, "sha256": self.sha256,
                            "identity": list(self.identity)}) + "\n").encode("utf-8")


class Journal:
    def __init__(self, storage: Storage, out_dir: str):
        self.storage = storage
        self.state_dir = storage.join(out_dir, STATE_DIR)
        self.path = storage.join(self.state_dir, JOURNAL_FILE)

    def _tensors_path(self, rank: int) -> str:
        return self.storage.join(self.state_dir, TENSORS_DIR, f"rank_{rank}.json")

    def read(self) -> tuple[str | None, list[JournalEntry]]:
        """(fingerprint, entries), or (None, []) when there is no journal; lines cut short by a crash are skipped."""
        try:
            text = self.storage.read_bytes(self.path, MAX_JOURNAL_BYTES).decode("utf-8", "replace")
        except FileNotFoundError:
            return None, []
        fingerprint = None
        entries: dict[int, JournalEntry] = {}
        for i, line in enumerate(text.splitlines()):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if i == 0 and isinstance(obj, dict):
                fingerprint = obj.get("fingerprint")
            elif isinstance(obj, dict) and isinstance(obj.get("rank"), int):
                try:
                    entries[obj["rank"]] = JournalEntry(obj["rank"], str(obj["path"]), int(obj["size"]),
                                                        str(obj["sha256"]), tuple(obj.get("identity") or ()))
                except (KeyError, TypeError, ValueError):
                    continue
        return fingerprint, list(entries.values())

    def start(self, fingerprint: str, keep: bool) -> None:
        """Begin (or, with `keep`, continue) the journal of files written for this conversion."""
        self.storage.makedirs(self.state_dir)
        if keep and self.read()[0] == fingerprint:
            return
        self.storage.write_bytes(self.path, (json.dumps({"fingerprint": fingerprint}) + "\n").encode(), mode=0o644)

    def rewrite(self, fingerprint: str, entries: list[JournalEntry]) -> None:
        """Replace the journal with these entries (turning a complete directory back into a partial one)."""
        self.storage.makedirs(self.state_dir)
        data = (json.dumps({"fingerprint": fingerprint}) + "\n").encode() + b"".join(e.line() for e in entries)
        self.storage.write_bytes(self.path, data, mode=0o644)

    def append(self, entry: JournalEntry) -> None:
        self.storage.makedirs(self.storage.parent(self._tensors_path(entry.rank)))
        self.storage.write_bytes(self._tensors_path(entry.rank), "".join(iter_json(entry.tensors)).encode(), mode=0o644)
        self.storage.append(self.path, entry.line())

    def tensors(self, rank: int) -> dict[str, str]:
        try:
            data = self.storage.read_bytes(self._tensors_path(rank), MAX_TENSORS_BYTES)
            value = json.loads(data)
        except (FileNotFoundError, ValueError):
            return {}
        return value if isinstance(value, dict) else {}

    def remove(self) -> None:
        self.storage.remove(self.path)
