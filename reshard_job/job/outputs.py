"""The output directory: guards, the lock, the resume journal and the manifest (the commit marker).

An output directory goes through three states: *fresh* (absent or empty), *partial* (a journal of
the target files written so far, no manifest), *complete* (``manifest.json`` present; it is written
last, so its presence means every file it lists was renamed into place). A rerun of the same job
(same fingerprint: source hashes, strategies, target settings) resumes a partial directory, keeping
files that still match the journal's size and sha256, and leaves a complete one untouched. A
directory holding anything else (files of another job, foreign files) is refused unless
``output.overwrite=true``. An ``fcntl`` lock keeps two jobs from writing one directory at once; the
kernel drops it when a process dies, so a killed job never leaves a stale lock behind.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import socket
from dataclasses import dataclass

from ..errors import OutputError
from ..storage.atomic import TMP_SUFFIX, fsync_dir, write_bytes_atomic
from ..hashing import digest_file

STATE_DIR = ".reshard_job"
LOCK_FILE = "lock"
JOURNAL_FILE = "journal.jsonl"
MANIFEST = "manifest.json"

# AtomicFile's temporary names: ".<final name>.<12 hex digits>.tmp"
TEMP_NAME = re.compile(r"^\..+\.[0-9a-f]{12}" + re.escape(TMP_SUFFIX) + "$", re.S)
RANK_DIR = re.compile(r"^rank_\d+$")

FRESH = "fresh"
PARTIAL = "partial"
COMPLETE = "complete"


@dataclass
class JournalEntry:
    rank: int
    path: str  # relative to the output directory
    size: int
    sha256: str
    tensors: dict[str, str]


def _inside(path: str, parent: str) -> bool:
    path, parent = os.path.realpath(path), os.path.realpath(parent)
    return path == parent or path.startswith(parent.rstrip(os.sep) + os.sep)


class OutputDir:
    def __init__(self, path: str, *, overwrite: bool = False):
        self.path = os.path.abspath(path)
        self.overwrite = overwrite
        self.state_dir = os.path.join(self.path, STATE_DIR)
        self.manifest_path = os.path.join(self.path, MANIFEST)
        self.journal_path = os.path.join(self.state_dir, JOURNAL_FILE)
        self._lock_fd: int | None = None

    # ------------------------------------------------------------------------------ guards
    def check_not_source(self, source_dirs: list[str], source_files: list[str]) -> None:
        """Refuse an output directory that is, or lies inside, a source directory, or is a source file."""
        for f in source_files:
            if os.path.realpath(f) == os.path.realpath(self.path):
                raise OutputError(f"output.dir {self.path} is a source file; choose a new directory")
        for d in source_dirs:
            if d and _inside(self.path, d):
                raise OutputError(
                    f"output.dir {self.path} is inside the source directory {d}; outputs must not be written "
                    "among the sources (choose a directory outside it)"
                )
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise OutputError(f"output.dir {self.path} exists and is not a directory")

    def check_not_overwriting(self, planned: list[str], source_files: list[str], source_dirs: list[str] = ()) -> None:
        """Refuse when a file this job would write is a source file, or lands in a source directory
        through a symbolic link, whatever ``output.overwrite`` says.

        A source strategy file kept next to its checkpoints as ``strategy.ckpt`` is the usual way to
        get here: writing the target strategy into that directory would replace it.
        """
        sources = {os.path.realpath(f): f for f in source_files}
        for p in planned:
            where = os.path.join(os.path.realpath(os.path.dirname(p)), os.path.basename(p))
            if where in sources:
                raise OutputError(
                    f"output.dir {self.path}: writing {os.path.relpath(p, self.path)} would replace the source file "
                    f"{sources[where]}; choose another output.dir"
                )
            for d in source_dirs:
                if d and _inside(where, d):
                    raise OutputError(
                        f"output.dir {self.path}: {os.path.relpath(p, self.path)} would be written into the source "
                        f"directory {d} (through a symbolic link); choose another output.dir"
                    )

    def check_writable(self) -> None:
        probe_dir = self.path
        while not os.path.exists(probe_dir):
            parent = os.path.dirname(probe_dir)
            if parent == probe_dir:
                break
            probe_dir = parent
        if not os.access(probe_dir, os.W_OK | os.X_OK):
            raise OutputError(f"output.dir {self.path} is not writable (no write permission on {probe_dir})")

    # ------------------------------------------------------------------------------ lock
    def lock(self) -> None:
        try:
            os.makedirs(self.state_dir, exist_ok=True)
        except OSError as e:
            raise OutputError(f"output.dir {self.path}: cannot create it ({e.strerror})") from None
        path = os.path.join(self.state_dir, LOCK_FILE)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = ""
            try:
                holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
            except OSError:
                pass
            os.close(fd)
            if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise OutputError(
                    f"output.dir {self.path} is being written by another job ({holder or 'unknown process'}); "
                    "wait for it to finish or choose another output.dir"
                ) from None
            raise OutputError(f"output.dir {self.path}: cannot lock ({e.strerror})") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            finally:
                os.close(self._lock_fd)
                self._lock_fd = None

    # ------------------------------------------------------------------------------ state
    def read_manifest(self) -> dict | None:
        try:
            with open(self.manifest_path, "rb") as f:
                return json.loads(f.read().decode("utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, UnicodeDecodeError):
            return {}  # unreadable: treated as another job's

    def read_journal(self) -> tuple[str | None, list[JournalEntry]]:
        try:
            with open(self.journal_path, "r", encoding="utf-8") as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            return None, []
        fingerprint = None
        entries = []
        for i, line in enumerate(lines):
            try:
                obj = json.loads(line)
            except ValueError:
                continue  # a line cut short by a crash
            if i == 0:
                fingerprint = obj.get("fingerprint")
            elif "rank" in obj:
                entries.append(JournalEntry(obj["rank"], obj["path"], obj["size"], obj["sha256"], obj.get("tensors", {})))
        return fingerprint, entries

    def _foreign_entries(self) -> list[str]:
        if not os.path.isdir(self.path):
            return []
        return sorted(e for e in os.listdir(self.path) if e != STATE_DIR)

    def state(self, fingerprint: str) -> str:
        """FRESH, PARTIAL or COMPLETE for this job; OutputError if the directory is not ours to use."""
        manifest = self.read_manifest()
        journal_fp, _ = self.read_journal()
        if manifest is not None:
            if manifest.get("fingerprint") == fingerprint:
                return COMPLETE
            return self._other(f"the outputs of a different conversion (run {manifest.get('run_id', '?')})")
        if journal_fp is not None:
            if journal_fp == fingerprint:
                return PARTIAL
            return self._other("the partial outputs of a different conversion")
        if self._foreign_entries():
            return self._other(self._foreign_description())
        return FRESH

    def _foreign_description(self) -> str:
        entries = self._foreign_entries()
        return f"files this tool did not produce ({', '.join(entries[:3])}{', ...' if len(entries) > 3 else ''})"

    def check_not_foreign(self) -> None:
        """Refuse a directory of someone else's files before writing anything into it, the lock included.

        Whether a directory of this tool's is this job's needs the source hashes, so that is decided
        later (``state``); a directory with neither manifest nor journal can be refused right away.
        """
        if self.overwrite or not os.path.isdir(self.path):
            return
        if self.read_manifest() is not None or self.read_journal()[0] is not None:
            return
        if self._foreign_entries():
            self._other(self._foreign_description())

    def _other(self, what: str) -> str:
        if not self.overwrite:
            raise OutputError(
                f"output.dir {self.path} holds {what}; choose another output.dir or set output.overwrite=true"
            )
        self.clear_previous()
        return FRESH

    def clear_previous(self) -> None:
        """Remove what earlier runs of this tool wrote here (files listed in its manifest/journal)."""
        manifest = self.read_manifest() or {}
        paths = [f.get("path") for f in manifest.get("target", {}).get("files", []) if isinstance(f, dict)]
        _, entries = self.read_journal()
        paths += [os.path.join(self.path, e.path) for e in entries]
        for p in paths:
            if p and _inside(p, self.path):
                try:
                    os.unlink(p)
                except OSError:
                    pass
        for name in (MANIFEST,):
            try:
                os.unlink(os.path.join(self.path, name))
            except OSError:
                pass
        try:
            os.unlink(self.journal_path)
        except OSError:
            pass

    def uncommit(self, fingerprint: str, entries: list[JournalEntry]) -> None:
        """Turn a complete directory back into a partial one, to redo (some of) its files.

        The journal (listing `entries`, the files a resume may keep) is written before the manifest
        goes, so a crash in between leaves a directory that is still complete, never one that is
        neither complete nor resumable.
        """
        os.makedirs(self.state_dir, exist_ok=True)
        lines = [json.dumps({"fingerprint": fingerprint})]
        lines += [json.dumps({"rank": e.rank, "path": e.path, "size": e.size, "sha256": e.sha256,
                              "tensors": e.tensors}) for e in entries]
        write_bytes_atomic(self.journal_path, ("\n".join(lines) + "\n").encode("utf-8"), mode=0o644)
        try:
            os.unlink(self.manifest_path)
        except FileNotFoundError:
            pass
        fsync_dir(self.path)

    # ------------------------------------------------------------------------------ journal
    def start_journal(self, fingerprint: str, keep: bool) -> None:
        """Begin (or, with `keep`, continue) the journal of files written for this job."""
        os.makedirs(self.state_dir, exist_ok=True)
        if keep and os.path.exists(self.journal_path):
            return
        with open(self.journal_path, "w", encoding="utf-8") as f:
            f.write(json.dumps({"fingerprint": fingerprint}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def append_journal(self, entry: JournalEntry) -> None:
        line = json.dumps({"rank": entry.rank, "path": entry.path, "size": entry.size,
                           "sha256": entry.sha256, "tensors": entry.tensors})
        with open(self.journal_path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def reusable(self, expected_paths: dict[int, str]) -> dict[int, JournalEntry]:
        """Journal entries whose file is still on disk with the recorded size and sha256."""
        _, entries = self.read_journal()
        keep: dict[int, JournalEntry] = {}
        for e in entries:
            full = os.path.join(self.path, e.path)
            if expected_paths.get(e.rank) != full:
                continue
            try:
                if os.path.getsize(full) != e.size:
                    continue
            except OSError:
                continue
            if digest_file(full).sha256 == e.sha256:
                keep[e.rank] = e
        return keep

    def remove_temp_files(self) -> int:
        """Delete temporary files left by a killed run (they never carry a final name).

        Only where this tool writes (the directory itself, its state directory and ``rank_<r>/``)
        and only names of the exact form ``AtomicFile`` creates: with ``output.overwrite=true`` the
        directory may hold the user's own files, ``.notes.tmp`` among them.
        """
        removed = 0
        dirs = [self.path, self.state_dir]
        try:
            dirs += [os.path.join(self.path, e) for e in os.listdir(self.path) if RANK_DIR.match(e)]
        except OSError:
            return 0
        for d in dirs:
            try:
                names = os.listdir(d)
            except OSError:
                continue
            for name in names:
                full = os.path.join(d, name)
                if TEMP_NAME.match(name) and os.path.isfile(full) and not os.path.islink(full):
                    try:
                        os.unlink(full)
                        removed += 1
                    except OSError:
                        pass
        return removed

    # ------------------------------------------------------------------------------ manifest
    def write_manifest(self, manifest: dict) -> tuple[int, str]:
        data = (json.dumps(manifest, indent=2, sort_keys=False) + "\n").encode("utf-8")
        result = write_bytes_atomic(self.manifest_path, data, mode=0o444)
        fsync_dir(self.path)
        return result

    def relative(self, path: str) -> str:
        return os.path.relpath(path, self.path)
