"""The resume journal: which target files of an unfinished conversion are done.

``<output.dir>/.reshard_job/journal.jsonl`` starts with the conversion's fingerprint; each
finished target file adds one line (rank, path relative to the output directory, size, sha256,
and its storage identity right after it was written), durably, as soon as it lands, so a crash
loses at most the ranks in flight. Per-tensor digests, which are large for models with many
parameters, go to ``.reshard_job/tensors/rank_<r>.json`` before the line is added.

The identity lets a rerun trust a file without reading it again: as long as the file's identity
(inode, size, modification and change time) is the one journaled, its bytes are the ones hashed
(the argument of the source digest cache). A file whose identity changed is re-hashed.

The journal is checked, not trusted: each line carries a digest of its own fields (``check``) and
the sha256 of its rank's per-tensor file. A line that was damaged or edited, or whose per-tensor
file no longer has the journaled digest, is as if it were absent: its rank is written again, so a
manifest never lists a digest the files do not have.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from reshard_job.jsonchunks import iter_json
from reshard_job.storage import Storage

STATE_DIR = ".reshard_job"
JOURNAL_FILE = "journal.jsonl"
TENSORS_DIR = "tensors"
MAX_JOURNAL_BYTES = 1 << 30
READ_BLOCK = 1 << 20
MAX_LINE_BYTES = 1 << 16  # a journal line is a few hundred bytes
MAX_TENSORS_BYTES = 1 << 31


@dataclass
class JournalEntry:
    rank: int
    path: str  # relative to the output directory
    size: int
    sha256: str
    identity: tuple = ()
    tensors: dict[str, str] = field(default_factory=dict)  # filled from the tensors file when needed
    tensors_sha256: str = ""  # of the rank's per-tensor file as written

    def _fields(self) -> dict:
        return {"rank": self.rank, "path": self.path, "size": self.size, "sha256": self.sha256,
                "identity": list(self.identity), "tensors_sha256": self.tensors_sha256}

    def line(self) -> bytes:
        fields = self._fields()
        return (json.dumps(fields | {"check": _check(fields)}) + "\n").encode("utf-8")

    @classmethod
    def from_line(cls, obj: dict) -> "JournalEntry | None":
        """The entry a journal line holds, or None when the line is damaged or was edited."""
        try:
            entry = cls(obj["rank"], str(obj["path"]), int(obj["size"]), str(obj["sha256"]),
                        tuple(obj.get("identity") or ()), tensors_sha256=str(obj.get("tensors_sha256", "")))
        except (KeyError, TypeError, ValueError):
            return None
        fields = entry._fields()
        fields["identity"] = obj.get("identity") or []
        return entry if obj.get("check") == _check(fields) else None


def _check(fields: dict) -> str:
    """A digest of an entry's fields in one canonical spelling."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode("utf-8")).hexdigest()


class Journal:
    def __init__(self, storage: Storage, out_dir: str):
        self.storage = storage
        self.state_dir = storage.join(out_dir, STATE_DIR)
        self.path = storage.join(self.state_dir, JOURNAL_FILE)

    def _tensors_path(self, rank: int) -> str:
        return self.storage.join(self.state_dir, TENSORS_DIR, f"rank_{rank}.json")

    def read(self) -> tuple[str | None, list[JournalEntry]]:
        """(fingerprint, entries), or (None, []) when there is no journal; lines cut short by a crash,
        damaged or edited are skipped. Read a block at a time: memory follows the entries, not the
        file (a journal grown huge, or replaced by something else, is not read whole)."""
        fingerprint = None
        entries: dict[int, JournalEntry] = {}
        try:
            lines = self._lines()
            for i, line in enumerate(lines):
                try:
                    obj = json.loads(line)
                except (ValueError, RecursionError):
                    continue
                if i == 0 and isinstance(obj, dict):
                    fingerprint = obj.get("fingerprint") if isinstance(obj.get("fingerprint"), str) else None
                elif isinstance(obj, dict) and isinstance(obj.get("rank"), int):
                    entry = JournalEntry.from_line(obj)
                    if entry is not None:
                        entries[entry.rank] = entry
                    else:  # damaged or edited: the rank is not done (a later good line may still say it is)
                        entries.pop(obj["rank"], None)
        except FileNotFoundError:
            return None, []
        return fingerprint, list(entries.values())

    def _lines(self):
        """The journal's lines, a block at a time; a line longer than MAX_LINE_BYTES is skipped."""
        f = self.storage.open_read(self.path)
        try:
            block = bytearray(READ_BLOCK)
            carry = b""
            offset = 0
            while offset < min(f.size, MAX_JOURNAL_BYTES):
                n = f.pread_into(offset, memoryview(block))
                if n <= 0:
                    break
                offset += n
                *complete, carry = (carry + bytes(block[:n])).split(b"\n")
                yield from (line.decode("utf-8", "replace") for line in complete)
                if len(carry) > MAX_LINE_BYTES:
                    carry = b""  # no journal line is this long: not ours, skipped
            if carry:
                yield carry.decode("utf-8", "replace")
        finally:
            f.close()

    def start(self, fingerprint: str, keep: bool) -> None:
        """Begin (or, with `keep`, continue) the journal of files written for this conversion."""
        self.storage.makedirs(self.state_dir)
        if keep and self.read()[0] == fingerprint:
            return
        self.storage.write_bytes(self.path, (json.dumps({"fingerprint": fingerprint}) + "\n").encode(), mode=0o644)

    def rewrite(self, fingerprint: str, entries: list[JournalEntry]) -> None:
        """Replace the journal with these entries (turning a complete directory back into a partial one)."""
        self.storage.makedirs(self.state_dir)
        journaled = {e.rank: e for e in self.read()[1]}
        for e in entries:  # entries from a manifest: the per-tensor file's digest is the journal's
            old = journaled.get(e.rank)
            if not e.tensors_sha256 and old is not None and (old.path, old.sha256) == (e.path, e.sha256):
                e.tensors_sha256 = old.tensors_sha256
        data = (json.dumps({"fingerprint": fingerprint}) + "\n").encode() + b"".join(e.line() for e in entries)
        self.storage.write_bytes(self.path, data, mode=0o644)

    def append(self, entry: JournalEntry) -> None:
        self.storage.makedirs(self.storage.parent(self._tensors_path(entry.rank)))
        data = "".join(iter_json(entry.tensors)).encode()
        entry.tensors_sha256 = hashlib.sha256(data).hexdigest()
        self.storage.write_bytes(self._tensors_path(entry.rank), data, mode=0o644)
        self.storage.append(self.path, entry.line())

    def tensors(self, entry: JournalEntry) -> dict[str, str] | None:
        """The per-tensor digests of a journaled file; None when that record is missing, damaged
        or edited (its bytes are not the ones journaled)."""
        try:
            data = self.storage.read_bytes(self._tensors_path(entry.rank), MAX_TENSORS_BYTES)
        except FileNotFoundError:
            return None
        if hashlib.sha256(data).hexdigest() != entry.tensors_sha256:
            return None
        try:
            value = json.loads(data)
        except ValueError:
            return None
        return value if isinstance(value, dict) and all(isinstance(v, str) for v in value.values()) else None

    def remove(self) -> None:
        self.storage.remove(self.path)
