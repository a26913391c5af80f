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

Reading is bounded by what the journal can describe, whatever the file has become: the first line
alone answers which conversion it belongs to; entries are found by a scan over blocks, lines longer
than an entry can be are skipped, only the ranks asked about are checked and kept (a line repeated
many times is checked once), and a journal larger than one job's entries can make (or listing more
units than a job writes) counts as damaged: its files are redone. A per-tensor record larger than
the digests of a file of the journaled size can be is damaged too, and is parsed only once its
sha256 is the journaled one.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Container, Iterator
from dataclasses import dataclass, field

from reshard_job.errors import OutputError
from reshard_job.jsonchunks import iter_json
from reshard_job.json_stream import JsonProblem, JsonStream, file_reader
from reshard_job.storage import Storage

STATE_DIR = ".reshard_job"
JOURNAL_FILE = "journal.jsonl"
TENSORS_DIR = "tensors"
READ_BLOCK = 1 << 20
# A line is a few hundred bytes: rank, a path of at most ~1.3 KiB (a 200-character prefix, escaped),
# three digests and an identity (a store's version id may take 1 KiB).
MAX_LINE_BYTES = 8 << 10
MAX_UNITS = 1 << 16  # target files one job writes (job.config.settle.MAX_TARGET_RANKS)
# One line per finished file, again for each file a resumed run redid: 2 KiB per unit is far more
# than any run of this tool appends. A larger journal is not one: none of its entries count.
MAX_JOURNAL_BYTES = MAX_UNITS * (2 << 10)
MAX_SEEN_LINES = 4096
# A rank's per-tensor digests take at most this many bytes per byte of its file (a tensor's entry,
# its name escaped and a digest, is at most ~12 times what the tensor takes in the file), plus this
TENSORS_BYTES_PER_BYTE = 16
TENSORS_SLACK = 1 << 20
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


_ENTRY_START = re.compile(rb'\{"rank": (\d{1,20}), ')
_UNSEEN = object()


def _lines_in(data: bytes, cut: int, at_line_start: bool) -> Iterator[tuple[int, bytes]]:
    """(rank, line) of the entry lines in ``data[:cut]`` (whose first byte begins a line when
    `at_line_start`)."""
    for m in _ENTRY_START.finditer(data, 0, cut):
        s = m.start()
        if (s == 0 and not at_line_start) or (s and data[s - 1] != 0x0A):
            continue
        end = data.find(b"\n", s, cut)
        end = cut if end < 0 else end
        if end - s <= MAX_LINE_BYTES:
            yield int(m.group(1)), data[s:end]


def _sha256_of(f) -> str:
    h = hashlib.sha256()
    block = bytearray(READ_BLOCK)
    offset = 0
    while offset < f.size:
        n = f.pread_into(offset, memoryview(block))
        if n <= 0:
            break
        h.update(memoryview(block)[:n])
        offset += n
    return h.hexdigest()


def _entry_of(line: bytes) -> JournalEntry | None:
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return JournalEntry.from_line(obj) if isinstance(obj, dict) else None


class Journal:
    def __init__(self, storage: Storage, out_dir: str):
        self.storage = storage
        self.state_dir = storage.join(out_dir, STATE_DIR)
        self.path = storage.join(self.state_dir, JOURNAL_FILE)

    def _tensors_path(self, rank: int) -> str:
        return self.storage.join(self.state_dir, TENSORS_DIR, f"rank_{rank}.json")

    def fingerprint(self) -> str | None:
        """The conversion the journal belongs to (its first line), or None when there is no journal or
        its first line is not one; reads that line only."""
        try:
            f = self.storage.open_read(self.path)
        except FileNotFoundError:
            return None
        try:
            head = bytearray(min(f.size, MAX_LINE_BYTES))
            head = bytes(head[:f.pread_into(0, memoryview(head))])
        finally:
            f.close()
        try:
            obj = json.loads(head.split(b"\n", 1)[0])
        except (ValueError, RecursionError):
            return None
        value = obj.get("fingerprint") if isinstance(obj, dict) else None
        return value if isinstance(value, str) else None

    def read(self, ranks: Container[int] | None = None) -> tuple[str | None, list[JournalEntry]]:
        """(fingerprint, entries), or (None, []) when there is no journal; lines cut short by a crash,
        damaged or edited are skipped. `ranks`: the only ranks (or export parts) asked about, whose
        entries alone are checked and kept. See ``_entries`` for the bounds."""
        return self.fingerprint(), list(self._entries(ranks).values())

    def _entries(self, ranks: Container[int] | None) -> dict[int, JournalEntry]:
        """The journaled entries by rank, a block at a time: memory follows the entries kept, not
        the file. A journal larger than MAX_JOURNAL_BYTES, or listing more units than one job
        writes when every rank is asked for, describes no conversion of this tool: none of its
        entries count (their files are redone)."""
        entries: dict[int, JournalEntry] = {}
        seen: dict[bytes, JournalEntry | None] = {}  # lines met already (a journal appended to many times)
        for rank, line in self._candidates():
            if ranks is not None and rank not in ranks:
                continue
            entry = seen.get(line, _UNSEEN)
            if entry is _UNSEEN:
                entry = _entry_of(line)
                if len(seen) >= MAX_SEEN_LINES:
                    seen.clear()
                seen[line] = entry
            if entry is None or entry.rank != rank:  # damaged or edited: the rank is not done (a later
                entries.pop(rank, None)               # good line may still say it is)
            else:
                entries[rank] = entry
            if len(entries) > MAX_UNITS:
                return {}
        return entries

    def _candidates(self) -> Iterator[tuple[int, bytes]]:
        """(rank, line) of each line that begins as this tool writes entries (``{"rank": <n>, ``),
        found by a regular expression over blocks of the file (never line by line in Python: a
        journal of millions of junk lines costs a scan, not millions of steps); lines longer than
        MAX_LINE_BYTES are skipped."""
        try:
            f = self.storage.open_read(self.path)
        except FileNotFoundError:
            return
        try:
            if f.size > MAX_JOURNAL_BYTES:
                return
            offset, carry, at_line_start = 0, b"", True
            block = bytearray(READ_BLOCK)
            while offset < f.size:
                n = f.pread_into(offset, memoryview(block))
                if n <= 0:
                    break
                offset += n
                data = carry + bytes(block[:n])
                last = offset >= f.size
                cut = len(data) if last else data.rfind(b"\n") + 1
                yield from _lines_in(data, cut, at_line_start)
                carry = data[cut:]
                at_line_start = at_line_start or cut > 0
                if len(carry) > MAX_LINE_BYTES:  # no entry is this long: skip to the next line
                    carry, at_line_start = b"", False
        finally:
            f.close()

    def start(self, fingerprint: str, keep: bool) -> None:
        """Begin (or, with `keep`, continue) the journal of files written for this conversion."""
        self.storage.makedirs(self.state_dir)
        if keep and self.fingerprint() == fingerprint:
            return
        self.storage.write_bytes(self.path, (json.dumps({"fingerprint": fingerprint}) + "\n").encode(), mode=0o644)

    def rewrite(self, fingerprint: str, entries: list[JournalEntry]) -> None:
        """Replace the journal with these entries (turning a complete directory back into a partial one)."""
        self.storage.makedirs(self.state_dir)
        journaled = {e.rank: e for e in self.read({e.rank for e in entries})[1]}
        for e in entries:  # entries from a manifest: the per-tensor file's digest is the journal's
            old = journaled.get(e.rank)
            if not e.tensors_sha256 and old is not None and (old.path, old.sha256) == (e.path, e.sha256):
                e.tensors_sha256 = old.tensors_sha256
        data = (json.dumps({"fingerprint": fingerprint}) + "\n").encode() + b"".join(e.line() for e in entries)
        self.storage.write_bytes(self.path, data, mode=0o644)

    def append(self, entry: JournalEntry) -> None:
        path = self._tensors_path(entry.rank)
        self.storage.makedirs(self.storage.parent(path))
        # written a piece at a time (600,000 digests are 70 MB as one buffer), hashed as written
        with self.storage.create(path, mode=0o644) as f:
            for piece in iter_json(entry.tensors):
                f.write(piece.encode())
        entry.tensors_sha256 = f.result[1]
        self.storage.append(self.path, entry.line())

    def tensors(self, entry: JournalEntry) -> dict[str, str] | None:
        """The per-tensor digests of a journaled file; None when that record is missing, damaged
        or edited (its bytes are not the ones journaled), or larger than the per-tensor digests of
        a file of the journaled size can be. Its sha256 is checked in one pass before a second
        one reads it (a digest at a time): nothing but the record the journal names is parsed."""
        limit = min(MAX_TENSORS_BYTES, TENSORS_SLACK + TENSORS_BYTES_PER_BYTE * max(0, entry.size))
        try:
            f = self.storage.open_read(self._tensors_path(entry.rank))
        except FileNotFoundError:
            return None
        try:
            if f.size > limit or _sha256_of(f) != entry.tensors_sha256:
                return None
            stream = JsonStream(file_reader(f))
            value = {key: digest for key, digest, _ in stream.items()}
            stream.end()
        except JsonProblem:
            return None
        finally:
            f.close()
        return value if all(isinstance(v, str) for v in value.values()) else None

    def remove(self) -> None:
        try:
            self.storage.remove(self.path)
        except OSError as e:  # a file system turned read-only: one line naming the file
            raise OutputError(f"{self.path}: cannot remove it ({e.strerror or e})") from None
