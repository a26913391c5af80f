"""The output directory: guards, the lock, its state, and the manifest (the commit marker).

An output directory goes through three states: *fresh* (absent or empty), *partial* (a journal of
the target files written so far, no manifest), *complete* (``manifest.json`` present; it is written
last, so its presence means every file it lists was published). A rerun of the same job (same
fingerprint: source hashes, strategies, target settings) resumes a partial directory, keeping files
that still verify, and leaves a complete one untouched once its files verify. A directory holding
anything else (files of another job, foreign files) is refused unless ``output.overwrite=true``.
One job writes a directory at a time (``Storage.lock``).

Nothing is written or deleted outside the directory: a planned output whose folder resolves
elsewhere (a symbolic link planted at ``output.dir/rank_0``) is refused before anything is written,
and files are only ever removed where they resolve inside the directory.

Local places are compared by what they are, not by how they are named: a folder or file is the
same as a source when its device and inode are (a bind mount or a second mount of the source's
file system shows the same folder under another path, which no path comparison can see).
"""

from __future__ import annotations

import json
import logging
import os
import socket

from reshard_job.errors import OutputError
from reshard_job.formats.manifest_file import MANIFEST_FILE
from reshard_job.sources.file_digests import digest_file
from reshard_job.jsonchunks import iter_json, plain
from reshard_job.storage import LockedError, Storage
from reshard_job.storage.s3errors import StoreUnresponsiveError
from reshard_job.text import one_line_of
from reshard_job.job.output.journal import STATE_DIR, TENSORS_DIR, Journal, JournalEntry
from reshard_job.job.output.manifest_reading import read_manifest_summary
from reshard_job.job.output.places import (inside, place, places, real_paths, self_and_ancestors, source_folder_around,
                                           under, url_key)

FRESH = "fresh"
PARTIAL = "partial"
COMPLETE = "complete"


def still_holds(storage: Storage, path: str, size: int, sha256: str, identity: tuple) -> bool:
    """Whether the file at `path` still holds what was recorded: the same identity as when written,
    else the same sha256 read now."""
    info = storage.info(path)
    if info is None or not info.is_file or info.size != size:
        return False
    if identity and tuple(info.identity) == tuple(identity):
        return True
    try:
        return digest_file(path).sha256 == sha256
    except Exception:  # noqa: BLE001 - unreadable or changing: it does not verify
        return False


class OutputDir:
    def __init__(self, path: str, storage: Storage, *, overwrite: bool = False):
        self.path = path
        self.storage = storage
        self.local = storage.scheme == "file"
        self.overwrite = overwrite
        self.state_dir = storage.join(path, STATE_DIR)
        self.manifest_path = storage.join(path, MANIFEST_FILE)
        self.seal_path = storage.join(self.state_dir, "manifest.sha256")
        self.journal = Journal(storage, path)
        self._lock = None
        self._manifest_seen: tuple[tuple, dict] | None = None  # (identity, summary) of the last read
        self._manifest_problem = "a manifest.json that cannot be read"  # why the last read gave {}

    # ------------------------------------------------------------------------------ guards
    def check_not_source(self, source_dirs: list[str], source_files: list[str]) -> None:
        """Refuse an output directory that is, or lies inside, a source directory, or is a source file."""
        if self.local:  # the same real path (a URL is never a local output)
            real, local = os.path.realpath(self.path), [f for f in source_files if "://" not in f]
            is_source = real in real_paths(local)
        else:
            is_source = any(under(self.path, f) for f in source_files)
        if is_source:
            raise OutputError(f"output.dir {self.path} is a source file; choose a new directory")
        for d in source_dirs:
            if d and under(self.path, d):
                raise OutputError(
                    f"output.dir {self.path} is inside the source directory {d}; outputs must not be written "
                    "among the sources (choose a directory outside it)"
                )
        if self.local:
            self._check_not_source_place(source_dirs, source_files)
        info = self.storage.info(self.path)
        if info is not None and not info.is_dir:
            raise OutputError(f"output.dir {self.path} exists and is not a directory")

    def _check_not_source_place(self, source_dirs: list[str], source_files: list[str]) -> None:
        """The same refusals by device and inode: output.dir, or a folder above it, is a source under
        another path."""
        files, dirs = places(source_files), places(source_dirs)
        for p in self_and_ancestors(self.path):
            key = place(p)
            if key in files:
                raise OutputError(f"output.dir {self.path} is the source file {files[key]} under another path; "
                                  "choose a new directory")
            if key in dirs:
                raise OutputError(
                    f"output.dir {self.path} is inside the source directory {dirs[key]} (the same folder under "
                    "another path); outputs must not be written among the sources (choose a directory outside it)"
                )

    def check_planned(self, planned: list[str], source_files: list[str], source_dirs: list[str] = ()) -> None:
        """Refuse when a file this job would write is a source file, lands in a source directory or
        outside the output directory through a symbolic link, whatever ``output.overwrite`` says.

        A source strategy file kept next to its checkpoints as ``strategy.ckpt`` is the usual way to
        meet the first: writing the target strategy into that directory would replace it.
        """
        keys = real_paths(source_files) if self.local else [url_key(f) for f in source_files]
        sources = dict(zip(keys, source_files))
        root = os.path.realpath(self.path) if self.local else self.path
        for p in planned:
            rel = self.relative(p)
            where = (os.path.join(os.path.realpath(os.path.dirname(p)), os.path.basename(p)) if self.local
                     else url_key(p))
            if where in sources:
                raise OutputError(f"output.dir {self.path}: writing {rel} would replace the source file "
                                  f"{sources[where]}; choose another output.dir")
            for d in source_dirs:
                if d and under(where, d):
                    linked = self.local and where != os.path.abspath(p)
                    raise OutputError(f"output.dir {self.path}: {rel} would be written into the source directory "
                                      f"{d}{' (through a symbolic link)' if linked else ''}; choose another output.dir")
            if self.local and not inside(os.path.dirname(where), root):
                raise OutputError(f"output.dir {self.path}: {rel} would be written to {where}, outside output.dir "
                                  "(a symbolic link inside it points elsewhere); remove the link or choose another "
                                  "output.dir")
        if self.local:
            self._check_planned_places(planned, source_files, source_dirs)

    def _check_planned_places(self, planned: list[str], source_files: list[str], source_dirs) -> None:
        """No planned file is a source file (a bind mount, a hard link) or lands in a source folder,
        as devices and inodes say."""
        files, dirs = places(source_files), places(source_dirs)
        seen: dict[str, str | None] = {}
        for p in planned:
            rel = self.relative(p)
            key = place(p)
            if key in files:
                raise OutputError(f"output.dir {self.path}: writing {rel} would replace the source file "
                                  f"{files[key]} (the same file under another path); choose another output.dir")
            holder = source_folder_around(os.path.dirname(p), dirs, seen)
            if holder is not None:
                raise OutputError(f"output.dir {self.path}: {rel} would be written into the source directory "
                                  f"{holder} (the same folder under another path); choose another output.dir")

    def check_writable(self) -> None:
        if not self.local:
            return  # an object store answers on the first write; that error names the URL
        probe_dir = self.path
        while not os.path.exists(probe_dir):
            parent = os.path.dirname(probe_dir)
            if parent == probe_dir:
                break
            probe_dir = parent
        if not os.access(probe_dir, os.W_OK | os.X_OK):
            raise OutputError(f"output.dir {self.path} is not writable (no write permission on {probe_dir})")

    def check_not_foreign(self) -> None:
        """Refuse a directory of someone else's files before writing anything into it, the lock included.

        Whether a directory of this tool's is this job's needs the source hashes, so that is decided
        later (``state``); a directory with neither manifest nor journal can be refused right away.
        """
        if self.overwrite or not self._is_dir():
            return
        manifest = self.read_manifest()
        if manifest == {}:  # one this tool did not write, or damaged: refused before the lock is written
            self._other(self._manifest_problem)
        if manifest is not None or self.journal.fingerprint() is not None:
            return
        if self._foreign_entries():
            self._other(self._foreign_description())

    # ------------------------------------------------------------------------------ lock
    def lock(self) -> None:
        try:
            self.storage.makedirs(self.path)
            self._lock = self.storage.lock(self.path, f"pid {os.getpid()} on {socket.gethostname()}")
        except LockedError as e:
            raise locked_error(self.path, e.holder) from None

    def unlock(self) -> None:
        if self._lock is not None:
            lock, self._lock = self._lock, None
            lock.release()

    def refuse_if_locked(self) -> None:
        """Refuse now if another job holds the lock: before a conversion reads its sources, which
        in a bucket it also hashes, a whole read of every source. Writes nothing; ``lock`` still
        decides."""
        holder = self.storage.held_by(self.path)
        if holder:
            raise locked_error(self.path, holder)

    # ------------------------------------------------------------------------------ state
    def _is_dir(self) -> bool:
        info = self.storage.info(self.path)
        return info is not None and info.is_dir

    def read_manifest(self) -> dict | None:
        """What the job needs of the directory's manifest (``manifest_reading``: read past the rest,
        bounded by what it lists); None when there is none, {} when it is damaged or unreadable
        (treated as another job's). A store that does not answer is an error of its own.
        Read again only when its identity changed since the last read (a run asks up to three
        times, and for a large model one read costs a third of a second); the result is shared:
        do not modify it."""
        info = self._manifest_info()
        if info is not None and self._manifest_seen is not None and self._manifest_seen[0] == info.identity:
            return self._manifest_seen[1]
        summary = self._read_manifest_once()
        self._manifest_seen = (info.identity, summary) if info is not None and summary else None
        return summary

    def _manifest_info(self):
        try:
            info = self.storage.info(self.manifest_path)
        except StoreUnresponsiveError:
            raise
        except Exception:  # noqa: BLE001 - unreadable: the read itself says what it is
            return None
        return info if info is not None and not info.is_dir and info.identity else None

    def _read_manifest_once(self) -> dict | None:
        try:
            f = self.storage.open_read(self.manifest_path)
        except FileNotFoundError:
            return None
        except StoreUnresponsiveError:
            raise
        except Exception:  # noqa: BLE001 - a FIFO, a folder, no permission: not ours to trust
            self._manifest_problem = "a manifest.json that cannot be read (not a regular file, or no permission)"
            return {}
        try:
            summary = read_manifest_summary(f)[0]
        except StoreUnresponsiveError:
            raise
        except Exception as e:  # noqa: BLE001 - damaged (ManifestDamaged), or a storage error reading it
            self._manifest_problem = f"a manifest.json that cannot be read ({one_line_of(str(e))[:160]})"
            return {}
        finally:
            f.close()
        if "fingerprint" not in summary:
            self._manifest_problem = "a manifest.json this tool did not write (it has no 'fingerprint')"
            return {}
        return summary

    def _foreign_entries(self) -> list[str]:
        if not self._is_dir():
            return []
        return sorted(e.name for e in self.storage.listdir(self.path) if e.name != STATE_DIR)

    def state(self, fingerprint: str) -> str:
        """FRESH, PARTIAL or COMPLETE for this job; OutputError if the directory is not ours to use."""
        manifest = self.read_manifest()
        journal_fp = self.journal.fingerprint()
        if manifest is not None:
            if manifest.get("fingerprint") == fingerprint:
                return COMPLETE
            if not manifest:  # read_manifest's word for one that cannot be read, or is not ours
                return self._other(self._manifest_problem)
            return self._other(f"the outputs of a different conversion (run {manifest.get('run_id') or 'not recorded'})")
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

    def _other(self, what: str) -> str:
        if not self.overwrite:
            raise OutputError(
                f"output.dir {self.path} holds {what}; choose another output.dir or set output.overwrite=true"
            )
        self.clear_previous()
        return FRESH

    def _remove_inside(self, path: str) -> None:
        """Delete a file only where it really lies inside the directory (never through a link out of it)."""
        if self.local and not inside(os.path.dirname(path), self.path):
            return
        try:
            self.storage.remove(path)
        except OSError:
            pass

    def clear_previous(self) -> None:
        """Remove what earlier runs of this tool wrote here (files listed in its manifest/journal)."""
        manifest = self.read_manifest() or {}
        paths = [self.storage.join(self.path, self._rel_listed(f)) for f in manifest.get("target", {}).get("files", [])
                 if isinstance(f, dict) and isinstance(f.get("path"), str)]
        paths += [self.storage.join(self.path, e.path) for e in self.journal.read()[1]]
        for p in paths:
            self._remove_inside(p)
        for folder in sorted({self.storage.parent(p) for p in paths}):  # rank folders left empty: gone too
            if folder.rstrip("/") != self.path.rstrip("/") and (not self.local or inside(folder, self.path)):
                self.storage.remove_empty_folder(folder)
        self._remove_inside(self.manifest_path)
        self.journal.remove()

    @staticmethod
    def _rel_listed(f: dict) -> str:
        """A manifest's file relative to the directory (its ``file``, else ``rank_<r>/<name>``), however
        the directory was moved since."""
        if isinstance(f.get("file"), str) and f["file"] and not f["file"].startswith(("/", "..")):
            return f["file"]
        p = f["path"].rstrip("/")
        head, name = p.rsplit("/", 1) if "/" in p else ("", p)
        return f"{head.rsplit('/', 1)[-1]}/{name}" if head else name

    def listed_outputs(self, manifest: dict) -> list[JournalEntry]:
        """The target files a complete directory's manifest lists, with their journaled identities."""
        files = manifest.get("target", {}).get("files", [])
        keys = {f["part"] if isinstance(f.get("part"), int) else f["rank"] for f in files}
        # a journaled identity vouches for a file only where the journal says what the manifest says
        journaled = {e.rank: e for e in self.journal.read(keys)[1]}
        out = []
        for f in files:
            key = f["part"] if isinstance(f.get("part"), int) else f["rank"]  # an export's files: their number
            j = journaled.get(key)
            same = j is not None and (j.size, j.sha256) == (f["size"], f["sha256"])
            out.append(JournalEntry(key, self._rel_listed(f), f["size"], f["sha256"], j.identity if same else (),
                                    tensors_sha256=j.tensors_sha256 if same else ""))
        return out

    def uncommit(self, fingerprint: str, entries: list[JournalEntry]) -> None:
        """Turn a complete directory back into a partial one, to redo (some of) its files.

        The journal (listing `entries`, the files a resume may keep) is written before the manifest
        goes, so a crash in between leaves a directory that is still complete, never one that is
        neither complete nor resumable.
        """
        self.journal.rewrite(fingerprint, entries)
        removing(self.storage, self.manifest_path)
        removing(self.storage, self.seal_path)

    # ------------------------------------------------------------------------------ seal
    def seal_manifest(self, size: int, sha256: str) -> None:
        """Record the manifest just committed (size and sha256) beside the journal: a later run
        takes it for this tool's own only while it is still that file (an edited manifest was
        adopted by a rerun, its digests trusted and recorded)."""
        try:
            self.storage.write_bytes(self.seal_path, f"{size} {sha256}\n".encode("ascii"), mode=0o644)
        except Exception as e:  # noqa: BLE001 - the outputs are committed: unsealed, a rerun rewrites the manifest
            logging.getLogger("reshard_job").warning("%s: not sealed (%s); a rerun writes the manifest again",
                                                     self.manifest_path, e)

    def manifest_sealed(self, size: int, sha256: str) -> bool:
        """Whether the manifest of `size` bytes and `sha256` is the one this tool committed here."""
        try:
            return self.storage.read_bytes(self.seal_path, 200).decode("ascii", "replace").split() == \
                [str(size), sha256]
        except Exception:  # noqa: BLE001 - absent (a run killed just after the manifest, an older version)
            return False

    # ------------------------------------------------------------------------------ verification
    def verify(self, entry: JournalEntry) -> bool:
        """Whether the file still holds what was recorded: same identity, else the same sha256 re-read."""
        return still_holds(self.storage, self.storage.join(self.path, entry.path), entry.size, entry.sha256,
                           entry.identity)

    def reusable(self, expected_paths: dict[int, str]) -> dict[int, JournalEntry]:
        """Journal entries whose file is where this job would write it and still verifies."""
        keep: dict[int, JournalEntry] = {}
        for e in self.journal.read(expected_paths)[1]:
            if expected_paths.get(e.rank) == self.storage.join(self.path, e.path) and self.verify(e):
                tensors = self.journal.tensors(e)
                if tensors is None:
                    continue  # its per-tensor record is not the one journaled: the rank is redone
                e.tensors = tensors
                keep[e.rank] = e
        return keep

    def remove_temp_files(self) -> int:
        """Delete what writers of a killed run left (temporary files, unfinished uploads)."""
        try:
            # a pattern, not the listed rank folders: on an object store a folder holding nothing
            # but an unfinished upload is in no listing
            return self.storage.remove_incomplete(self.path, ["rank_*", STATE_DIR, f"{STATE_DIR}/{TENSORS_DIR}"])
        except Exception:  # noqa: BLE001 - nothing to clean in a directory that cannot be listed
            return 0

    # ------------------------------------------------------------------------------ manifest
    def write_manifest(self, manifest: dict) -> tuple[int, str]:
        """``json.dumps(manifest, indent=2)`` and a newline, atomically; locally written piece by
        piece (a manifest of a million per-tensor digests is hundreds of MB as one string)."""
        if not self.local:
            data = (json.dumps(manifest, indent=2, sort_keys=False, default=plain) + "\n").encode("utf-8")
            return self.storage.write_bytes(self.manifest_path, data, mode=0o444)
        with self.storage.create(self.manifest_path, mode=0o444) as f:
            for piece in iter_json(manifest, indent=2):
                f.write(piece.encode("utf-8"))
            f.write(b"\n")
        return f.result

    def relative(self, path: str) -> str:
        if self.local:
            return os.path.relpath(path, self.path)
        return path[len(self.path.rstrip("/")) + 1:] if path.startswith(self.path.rstrip("/") + "/") else path


def removing(storage: Storage, path: str) -> bool:
    """``storage.remove(path)``, a failure (a file system turned read-only) as one line naming it."""
    try:
        return storage.remove(path)
    except OSError as e:
        raise OutputError(f"{path}: cannot remove it ({e.strerror or e})") from None


def locked_error(path: str, holder: str) -> OutputError:
    return OutputError(f"output.dir {path} is being written by another job ({holder}); "
                       "wait for it to finish or choose another output.dir")
