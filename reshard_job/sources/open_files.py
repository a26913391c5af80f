"""The source checkpoint files of a conversion, by global rank: opened lazily and read-only
through their storage, indexed, and checked against the identities the job hashed.
"""

from __future__ import annotations

import os

from typing import Callable, Collection, Mapping

from reshard_job.core.tensor_meta import TensorMeta
from reshard_job.errors import FormatError, PlanError
from reshard_job.formats.ckpt.records import CRC_TRAILER_LEN
from reshard_job.formats.base import TensorReader
from reshard_job.formats.multifile import MultiFileReader
from reshard_job.formats.index import reader_index
from reshard_job.formats.registry import CKPT as KIND_CKPT, SAFETENSORS as KIND_SAFETENSORS, kind_of, open_reader
from reshard_job.sources.file_digests import DigestingReader, StreamedDigest, stream_block
from reshard_job.storage import SourceChangedError, StorageOptions, storage_for

OPEN_THREADS = 8  # remote source files indexed at once (SourceFiles.open_all)


def files_of(paths: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The files of one source rank, whether it is one file or several."""
    return (os.fspath(paths),) if isinstance(paths, (str, os.PathLike)) else tuple(map(os.fspath, paths))


class SourceFiles:
    """The source checkpoint files by global rank, opened lazily, read-only, through their storage.

    A rank is one file, or a tuple of files read together as that rank (a MindFormers rank's
    ``-model-`` and ``-opt-`` files) through ``MultiFileReader``. `identities` (rank ->
    ``FileInfo.identity``, for a tuple of files the tuple of their identities) are what the job
    saw when it hashed the files: a file that no longer matches is refused when opened and when
    ``check_unchanged`` is called after the last read, so bytes that changed under the job never
    reach a recorded output.
    """

    def __init__(self, paths: dict[int, str | tuple[str, ...]], *, verify_crc: bool = True,
                 identities: dict[int, tuple] | None = None, storage: StorageOptions | None = None,
                 digest_ranks: Collection[int] = (), digest_progress=None, index_cache=None,
                 names: Mapping[str, str] | None = None, only_named: bool = False,
                 parsed: Mapping[str, object] | None = None, record_taps: Callable[[int], object] | None = None):
        self.paths = {r: p if isinstance(p, str) else tuple(p) for r, p in paths.items()}
        self.verify_crc = verify_crc
        self.identities = dict(identities or {})
        self.storage = storage
        # Remote ranks hashed as they are indexed (one read of the object instead of two, see
        # ``sources.file_digests.DigestingReader``): their digests, by path, for the job's hash pass.
        # `digest_progress` (``add_bytes(n)``, ``step_done()``) hears of the bytes and files.
        self.digest_ranks = frozenset(digest_ranks)
        self.digest_progress = digest_progress
        self.digests: dict[str, StreamedDigest] = {}
        # rank -> a tap taking the partial fingerprints of its records in that read (``proof.stream_taps``)
        self.record_taps = record_taps
        # ``index_cache.IndexCache``: local `.ckpt` files whose identity it knows are not walked
        self.index_cache = index_cache
        self._readers: dict[int, TensorReader] = {}
        # ``target.include``/``exclude``/``rename`` (``plan.selection``): new name -> the files' name.
        # With `only_named`, the readers hold those names only; else the others keep their own.
        self.names = names
        self.only_named = only_named
        self._views: dict[int, TensorReader] = {}
        # safetensors files whose headers were parsed already (a MindFormers save's), by path
        self.parsed = parsed
        self._twin_headers: dict = {}  # local one-file ranks' safetensors headers, by digest

    def select(self, names: Mapping[str, str] | None, *, only_named: bool = True) -> None:
        """See the files through a selection from now on (``reader`` answers under the new names)."""
        self.names, self.only_named = names, only_named
        self._views.clear()

    def reader(self, rank: int) -> TensorReader:
        """A rank's reader, under the selection's names where there is one."""
        raw = self.raw_reader(rank)
        if self.names is None:
            return raw
        view = self._views.get(rank)
        if view is None or view.inner is not raw:
            from reshard_job.sources.renamed import RenamedReader

            view = self._views[rank] = RenamedReader(raw, self.names, only_stored=self.only_named)
        return view

    def raw_reader(self, rank: int) -> TensorReader:
        """A rank's reader under the files' own names."""
        r = self._readers.get(rank)
        if r is None:
            if rank not in self.paths:
                raise PlanError(f"source rank {rank} has no checkpoint file")
            entry = self.paths[rank]
            raws = [self._open(path) for path in files_of(entry)]
            try:
                identity = raws[0].identity if isinstance(entry, str) else tuple(tuple(f.identity) for f in raws)
                self._check_identity(rank, identity)
            except BaseException:
                for raw in raws:
                    raw.close()
                raise
            if isinstance(entry, str) and rank in self.digest_ranks and storage_for(entry, self.storage).scheme != "file":
                r = self._open_digesting(rank, raws[0])
            elif isinstance(entry, str):
                r = self._open_file(entry, raws[0])
            else:
                r = MultiFileReader(raws, verify_crc=self.verify_crc, parsed=self.parsed)
            self._readers[rank] = r
        return r

    def _open_file(self, path: str, raw) -> TensorReader:
        """A one-file rank's reader; a local `.ckpt` file's index from the index cache where it has it
        (and kept there after walking it where not)."""
        cache, kind = self.index_cache, kind_of(path) or KIND_CKPT
        local = storage_for(path, self.storage).scheme == "file"
        if kind == KIND_SAFETENSORS and local:  # replicas' headers are parsed once (``SafetensorsReader``)
            from reshard_job.formats.safetensors import SafetensorsReader

            return SafetensorsReader(raw, verify_crc=self.verify_crc, twins=self._twin_headers)
        if cache is None or kind != KIND_CKPT or not local:
            return open_reader(raw, verify_crc=self.verify_crc)
        from reshard_job.formats.ckpt import CheckpointReader
        from reshard_job.sources.index_cache import worth_keeping

        r = CheckpointReader(raw, verify_crc=self.verify_crc, known_index=cache.get(path, raw.identity))
        # nothing kept yet, or a document that did not fit the file: keep the walk's, where it was slow
        if r.walked and worth_keeping(r.size, len(r.entries)):
            cache.put(path, raw.identity, r.index_document())
        return r

    def _open_digesting(self, rank: int, raw) -> TensorReader:
        """Index a remote rank and hash it in the same front-to-back read of the object."""
        path = self.paths[rank]
        ckpt = (kind_of(path) or KIND_CKPT) == KIND_CKPT and raw.size >= CRC_TRAILER_LEN
        streams = min(OPEN_THREADS, len(self.digest_ranks))  # objects read at once (open_all)
        stream = DigestingReader(raw, crc_end=raw.size - CRC_TRAILER_LEN if ckpt else None, block=stream_block(streams),
                                 progress=self.digest_progress.add_bytes if self.digest_progress else None,
                                 tap=self.record_taps(rank) if self.record_taps is not None else None)
        r = open_reader(stream, verify_crc=self.verify_crc)  # closes `stream` if it fails
        try:
            digest = stream.finish()
            if not same_identity(self.current_identity(rank), digest.digest.identity):
                raise SourceChangedError(f"{path}: changed while it was being hashed; rerun once it is stable")
        except BaseException:
            r.close()
            raise
        self.digests[path] = digest
        if self.digest_progress is not None:
            self.digest_progress.step_done()
        return r

    def _open(self, path: str):
        try:
            return storage_for(path, self.storage).open_read(path)
        except FileNotFoundError:
            raise FormatError(path, "file not found (it was there when the job started)") from None

    def _check_identity(self, rank: int, identity: tuple) -> None:
        want = self.identities.get(rank)
        if want is not None and not same_identity(identity, want):
            shown = self.paths[rank] if isinstance(self.paths[rank], str) else _changed_file(self.paths[rank],
                                                                                              identity, want)
            raise SourceChangedError(f"{shown}: source file of rank {rank} changed while the job was "
                                     "running (size, time or inode differ); rerun once it is stable")

    def current_identity(self, rank: int) -> tuple:
        """A rank's identity as its storage reports it now (``()`` for a file that is gone)."""
        return current_identity(self.paths[rank], self.storage)

    def check_unchanged(self) -> None:
        """Raise SourceChangedError if a file read so far changed since it was hashed."""
        for rank in self._readers:
            self._check_identity(rank, self.current_identity(rank))

    def index(self) -> dict[int, dict[str, TensorMeta]]:
        self.open_all()
        return {rank: reader_index(self.reader(rank)) for rank in sorted(self.paths)}

    def open_all(self) -> None:
        """Open (index) every rank's files, several at once where they are remote objects.

        Indexing an object walks its record headers with ranged reads one after the other: most of
        the time is round trips, which objects of several ranks can overlap. Local files are walked
        one after the other (the walk is Python work; threads would only take turns at it). The
        first failure in rank order is raised, as opening one after the other would raise it."""
        todo = [r for r in sorted(self.paths) if r not in self._readers]
        first = files_of(self.paths[todo[0]])[0] if todo else None
        if len(todo) < 2 or storage_for(first, self.storage).scheme == "file":
            return
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=min(OPEN_THREADS, len(todo)), thread_name_prefix="index") as pool:
            futures = [pool.submit(self.raw_reader, r) for r in todo]
        failures = [f.exception() for f in futures if f.exception() is not None]
        if failures:
            raise failures[0]

    def close(self) -> None:
        for r in self._readers.values():
            r.close()
        self._readers.clear()
        self._views.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def current_identity(paths: str | tuple[str, ...], storage: StorageOptions | None = None) -> tuple:
    """The identity of one source rank's file, or the tuple of its files' identities, as stored now."""
    def one(path: str) -> tuple:
        info = storage_for(path, storage).info(path)
        return tuple(info.identity) if info is not None else ()

    if isinstance(paths, str):
        return one(paths)
    return tuple(one(p) for p in paths)


def _plain(identity) -> tuple:
    return tuple(_plain(v) if isinstance(v, (list, tuple)) else v for v in identity)


def same_identity(a, b) -> bool:
    """Whether two identities (of a file, or tuples of them) are equal; lists compare as tuples."""
    return _plain(a) == _plain(b)


def _changed_file(paths: tuple[str, ...], identity: tuple, want: tuple) -> str:
    """The first file of a multi-file rank whose identity differs (all of them if that is unclear)."""
    if len(identity) == len(want) == len(paths):
        for path, now, then in zip(paths, identity, want):
            if not same_identity(now, then):
                return path
    return ", ".join(paths)
