"""Uses by other programs: a run that read some files (and wrote others) recorded as lineage.

The question an auditor asks is which checkpoint fed a *model*, and the model is trained or
evaluated by another program after the conversion. ``record_use(consumer, inputs, outputs)`` lets
that program (or ``audit record``) say "I read these, I wrote those": one completed run whose
inputs and outputs are hashed artifacts like the job's, so ``audit trace`` of the model reaches the
conversion's sources and ``--descendants`` of a source reaches the model. A load-time reshard
(``reshard_job.load_rank``) records its loads through the same ``record_run`` core, with the
fingerprint shares of what it returned (``lineage.load_shares``).

Choices:

* A folder stands for every file under it (sorted; names starting with ``.`` are left out: a
  conversion's ``.reshard_job/`` journal and editor or VCS debris are not what was used).
* Kinds are inferred from names, within the kinds the schema knows: ``manifest.json`` is a
  manifest, a name holding ``strategy`` a strategy file, any other file read a source checkpoint
  and any other file written a target checkpoint; a ``rank_<r>`` folder on the path gives its rank.
* Digests come from the job's digest cache where a file is unchanged since it was hashed (a
  fine-tuning run that reads the conversion's outputs pays no second read), else are computed now.
* The run is recorded whole, in one go, after hashing: a use that cannot be hashed records nothing.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from reshard_job.errors import ConfigError
from reshard_job.lineage.file_records import FileRecord
from reshard_job.lineage.errors import LineageError, driver_detail
from reshard_job.secrets import mask_url

_RANK_FOLDER = re.compile(r"^rank_(\d+)$")
INPUT = "input"
OUTPUT = "output"


@dataclass(frozen=True)
class UseRun:
    """One run of another program (or a load), as recorded: who, what it read, what it wrote."""

    consumer: str
    inputs: list[FileRecord]
    outputs: list[FileRecord] = field(default_factory=list)
    details: dict = field(default_factory=dict)  # the run's recorded config
    where: str | None = None  # the run's output directory (shown by ``audit runs``)
    plan: dict | None = None  # a load's plan; none for another program's use
    source_devices: int | None = None
    target_devices: int | None = None
    shares: Iterable | None = None  # a load's fingerprint shares (``core.fingerprint_shares.Share``), name order


def record_run(url: str, use: UseRun) -> str:
    """Record `use` as one completed run in the lineage database at `url`; return its id."""
    from reshard_job import __version__
    from reshard_job.lineage.store import LineageStore

    from sqlalchemy.exc import SQLAlchemyError

    where = use.where or _common_folder([f.path for f in use.outputs]) or f"(read by {use.consumer})"
    check_names_recordable(f.path for f in [*use.inputs, *use.outputs])
    try:
        with LineageStore(url) as store:
            store.ensure_schema()
            run_id = store.start_run(config=use.details, overrides=[], tool_version=__version__, output_dir=where,
                                     source_devices=use.source_devices, target_devices=use.target_devices)
            store.record_inputs(run_id, use.inputs)
            if use.shares is not None:
                store.record_load_shares(run_id, use.shares)
            store.complete_run(run_id, outputs=use.outputs, plan=use.plan or {"consumer": use.consumer, "ranks": []})
    except SQLAlchemyError as exc:  # unreachable, refused, full: the driver's first line, no password
        raise LineageError(f"cannot record in the lineage database {mask_url(url)}: "
                           f"{mask_url(driver_detail(exc))}") from None
    return run_id


def check_names_recordable(paths: Iterable[str]) -> None:
    """Refuse, before anything is recorded, a file whose name is not valid UTF-8 (the database
    takes names as text): one line naming it, not an encoding traceback with the run left started."""
    from reshard_job.text import undecodable_name

    for path in paths:
        shown = undecodable_name(path)
        if shown is not None:
            raise ConfigError(f"{shown}: the name is not valid UTF-8, and files are recorded by name (manifest.json, "
                              "the lineage database); rename it")


def digest_records(files: Sequence[tuple[str, str, int | None]], storage_options=None) -> list[FileRecord]:
    """``(path, kind, rank)`` → FileRecords with sha256 and size, through the user's digest cache."""
    from reshard_job.sources.file_digests import HashCache, HashRequest, default_cache_path, digest_files

    cache = HashCache(default_cache_path(), storage_options)
    digests = digest_files([HashRequest(path) for path, _, _ in files], threads=2, cache=cache,
                           storage_options=storage_options)
    cache.save()
    return [FileRecord(d.path, d.sha256, d.size, kind, rank) for d, (_, kind, rank) in zip(digests, files)]


def record_use(consumer: str, inputs: Iterable, outputs: Iterable = (), *, lineage_url: str | None = None) -> str:
    """Record that `consumer` (a fine-tuning run, an evaluation) read `inputs` and wrote `outputs`
    (files or folders); return the run id. The database: `lineage_url`, else
    ``$RESHARD_JOB_LINEAGE_URL``, else ``runs/lineage.db`` under the current directory."""
    from reshard_job.lineage.database import default_url, sqlite_url

    consumer = str(consumer or "").strip()
    if not consumer:
        raise ConfigError("record_use: consumer must name the program that used the files (got nothing)")
    read, written = expand(inputs, INPUT), expand(outputs, OUTPUT)
    if not read:
        raise ConfigError("record_use: no input files given (name the files or folders the program read)")
    records = digest_records(read + written)
    details = {"use": {"consumer": consumer, "inputs": sorted({p for p, _, _ in read}),
                       "outputs": sorted({p for p, _, _ in written})}}
    url = lineage_url or default_url()
    url = url if "://" in url else sqlite_url(os.path.abspath(url))
    return record_run(url, UseRun(consumer, records[:len(read)], records[len(read):], details))


def expand(paths: Iterable, direction: str) -> list[tuple[str, str, int | None]]:
    """Every file named by `paths` (a folder: the files under it), as ``(absolute path, kind, rank)``."""
    from reshard_job.storage import absolute, storage_for

    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    found: dict[str, tuple[str, str, int | None]] = {}
    for given in paths:
        path = absolute(os.fspath(given))
        storage = storage_for(path)
        info = storage.info(path)
        if info is None:
            given_as = "an input" if direction == INPUT else "an output"
            raise ConfigError(f"{path}: no such file or folder (given as {given_as})")
        files = [path] if info.is_file else list(_files_under(storage, path))
        if not files:
            raise ConfigError(f"{path}: folder holds no files to record")
        check_names_recordable(files)
        for file in files:
            found.setdefault(file, (file, kind_of(file, direction), rank_of(file)))
    return list(found.values())


def _files_under(storage, folder: str):
    """The files below `folder`, walked without following links to folders (``find``'s way): a link
    to a parent folder made the walk record one file under ever longer paths, or never end."""
    from reshard_job.storage import is_url

    pending = [folder]
    while pending:
        current = pending.pop()
        for entry in storage.listdir(current):
            if entry.name.startswith("."):
                continue
            child = storage.join(current, entry.name)
            if entry.is_dir:
                if is_url(child) or not os.path.islink(child):
                    pending.append(child)
            elif entry.is_file:
                yield child


def kind_of(path: str, direction: str) -> str:
    name = os.path.basename(path).lower()
    if name == "manifest.json":
        return "manifest"
    if "strategy" in name:
        return "strategy"
    return "source_checkpoint" if direction == INPUT else "target_checkpoint"


def rank_of(path: str) -> int | None:
    for part in reversed(path.replace("\\", "/").split("/")[:-1]):
        match = _RANK_FOLDER.match(part)
        if match:
            return int(match.group(1))
    return None


def _common_folder(paths: list[str]) -> str | None:
    if not paths:
        return None
    try:
        common = os.path.commonpath(paths)
    except ValueError:
        return None
    return os.path.dirname(common) if len(paths) == 1 else common
