"""Whether two checkpoints hold the same model: ``audit compare A B``, parameter by parameter.

A side is fingerprinted (``core.fingerprint``: one digest per parameter, the same under any
sharding, rank count, pipeline split or file format), so the two sides are compared as sets of
parameters, never file by file: eight pipeline-parallel ``.ckpt`` ranks and a two-shard
safetensors export of one model are equal. A side is

- an output directory of the job: the fingerprints its ``manifest.json`` recorded for the outputs,
  while the record still describes the files (every file it lists, the strategy included, has the
  listed size and was not modified after the manifest, which the job writes last); otherwise they
  are read from the files, with the target strategy the manifest lists;
- a run id (or a unique prefix) of the lineage database: the output directory that run wrote, as above;
- any folder the job reads as a source (``rank_<r>/`` folders with their strategy, none for an
  unsharded one; a MindFormers 2.x save; an export folder), or a single checkpoint file of a whole
  model: read from the files. A strategy given
  for an output directory means "read it with this strategy", so its record is not used.

Reading is the job's own (``job.stages.proof.checkpoint_fingerprints``: the checkpoint planned onto
one unsharded device, each piece read once in bounded row blocks), so memory is one read window
and every source kind is covered. Fingerprints made by different algorithms are never compared:
a record of another algorithm than the other side's is read again from the files.

Trade-off: trusting a record by size and modification time, as make and rsync do, makes comparing
outputs of the job instant; a file rewritten at the same size with its old time put back deceives
it (``audit verify`` re-hashes every file against its recorded sha256). Fingerprints are not
cryptographic: they catch corruption and resharding mistakes, not a forger.
"""

from __future__ import annotations

import datetime as dt
import os
import re
from dataclasses import dataclass, field
from typing import Callable

from reshard_job.core.fingerprint import ALGORITHM
from reshard_job.errors import ReshardError
from reshard_job.formats.manifest_file import MANIFEST_FILE
from reshard_job.lineage.errors import LineageError, driver_detail
from reshard_job.lineage.hash_names import MIN_PREFIX_LENGTH
from reshard_job.plan.export_shards import is_training_state
from reshard_job.storage import is_url, storage_for
from reshard_job.audit.manifests import OutputListing, read_listing
from reshard_job.audit.reading import (absolute, exists, file_size, is_directory, join, json_document, read_small_file,
                                       relative_to)

READ_RECORDED = "recorded"
READ_FILES = "files"


class CompareError(ReshardError):
    """A side cannot be compared: it names nothing, or what it names cannot be read."""


@dataclass(frozen=True)
class Side:
    """One side as the user named it: `label` ('A' or 'B'), the reference, its strategy (if given)."""

    label: str
    ref: str
    strategy: str | None = None


@dataclass
class _Located:
    """What a side names: the folder or file to read, and an output directory's record, if usable."""

    path: str
    strategy: str | None
    record: dict[str, str] | None = None
    algorithm: str | None = None
    origin: str = ""  # the manifest the record comes from
    note: str | None = None  # why a record was not used


@dataclass
class SideFingerprints:
    digests: dict[str, str]
    algorithm: str
    read: str  # READ_RECORDED | READ_FILES
    origin: str
    note: str | None = None

    def to_json(self, ref: str) -> dict:
        out = {"ref": ref, "read": self.read, "from": self.origin}
        if self.note:
            out["note"] = self.note
        return out


@dataclass
class Comparison:
    algorithm: str
    differ: list[str]
    only_a: list[str]
    only_b: list[str]
    compared: int  # parameters on both sides
    weights: bool = False
    sides: dict[str, dict] = field(default_factory=dict)  # label -> how it was read

    @property
    def equal(self) -> bool:
        return not (self.differ or self.only_a or self.only_b)

    def to_json(self) -> dict:
        return {"equal": self.equal, "algorithm": self.algorithm, "differ": self.differ, "only_a": self.only_a,
                "only_b": self.only_b, "compared": self.compared, "weights_only": self.weights,
                "a": self.sides.get("A"), "b": self.sides.get("B")}

    def to_text(self) -> str:
        lines = [f"{what:<9}  {shown(name)}" for what, names in
                 (("differs", self.differ), ("only in A", self.only_a), ("only in B", self.only_b)) for name in names]
        what = "weights" if self.weights else "parameters"
        if self.equal:
            lines.append(f"equal: {self.compared} {what} ({self.algorithm})")
        else:
            lines.append(f"different: {len(self.differ)} of {self.compared} {what} differ, {len(self.only_a)} only "
                         f"in A, {len(self.only_b)} only in B ({self.algorithm})")
        return "\n".join(lines)


# Parameter names are anyone's text: one name must stay one line, and control characters are
# shown, not obeyed (the CLI escapes the rest of its output the same way, newlines apart).
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def shown(name: str) -> str:
    """`name` with every control character, newline and tab included, written as ``\\xNN``."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", name)


class _Weights:
    """The names ``target.include=weights`` keeps, as the ``wanted`` container of
    ``checkpoint_fingerprints``: training state is then not even read."""

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and not is_training_state(name)


def compare(a: Side, b: Side, *, weights: bool = False, open_store: Callable | None = None,
            progress: bool | None = None, note: Callable[[str], None] | None = None) -> Comparison:
    """Compare the parameters of `a` and `b`. `open_store`: opens the lineage database (read-only),
    called only when a side is a run id; `progress`: a bar per side read from its files (None: when
    stderr is a terminal); `note`: told, in one line, why a side's record was not used."""
    located = [_on_side(side, lambda side=side: _locate(side, open_store)) for side in (a, b)]
    recorded = [loc.algorithm for loc in located if loc.record is not None]
    # both recorded alike: compare the records; otherwise both must come out of this version's algorithm
    algorithm = recorded[0] if len(recorded) == 2 and recorded[0] == recorded[1] else ALGORITHM
    wanted = _Weights() if weights else None
    found = []
    for side, loc in zip((a, b), located):
        if loc.record is not None and loc.algorithm != algorithm:
            loc.note = (f"recorded with {loc.algorithm}, the other side with {algorithm}; read again from the files")
            loc.record = None
        found.append(_on_side(side, lambda side=side, loc=loc: _fingerprints(side, loc, wanted, progress)))
    for side, loc in zip((a, b), located):  # told once both sides were read: a refusal is its one line alone
        if loc.note and note is not None:
            note(f"note: {side.label}: {loc.note}")
    return _diff(found[0], found[1], weights, {"A": found[0].to_json(a.ref), "B": found[1].to_json(b.ref)})


def _diff(a: SideFingerprints, b: SideFingerprints, weights: bool, sides: dict) -> Comparison:
    da, db = a.digests, b.digests
    if weights:
        da = {n: d for n, d in da.items() if not is_training_state(n)}
        db = {n: d for n, d in db.items() if not is_training_state(n)}
    both = da.keys() & db.keys()
    return Comparison(algorithm=a.algorithm, differ=sorted(n for n in both if da[n] != db[n]),
                      only_a=sorted(da.keys() - db.keys()), only_b=sorted(db.keys() - da.keys()),
                      compared=len(both), weights=weights, sides=sides)


def _on_side(side: Side, action: Callable):
    """`action()`, its failures made one line naming the side."""
    try:
        return action()
    except CompareError:
        raise
    except ReshardError as exc:
        hint = ""
        if side.strategy is None and "source.strategy" in str(exc):  # the job's words for the same thing
            hint = f" (here: --{side.label.lower()}-strategy FILE)"
        raise CompareError(f"{side.label}: {exc}{hint}") from None
    except OSError as exc:
        where = exc.filename if exc.filename is not None else side.ref
        raise CompareError(f"{side.label}: {where}: cannot read ({exc.strerror or exc})") from None


def _fingerprints(side: Side, loc: _Located, wanted, progress: bool | None) -> SideFingerprints:
    if loc.record is not None:
        return SideFingerprints(loc.record, loc.algorithm or ALGORITHM, READ_RECORDED, loc.origin)
    from reshard_job.job.config.spec import SourceSpec
    from reshard_job.job.stages.proof import checkpoint_fingerprints

    # a folder of any kind the job reads, or a single checkpoint file (one whole model)
    found = checkpoint_fingerprints(SourceSpec(loc.path, loc.strategy), wanted=wanted, progress=progress,
                                    desc=f"fingerprinting {side.label}", check_replicas=True)
    return SideFingerprints(found.digests, found.algorithm, READ_FILES, loc.path, loc.note)


# -- what a side names ---------------------------------------------------------------------------

def _locate(side: Side, open_store: Callable | None) -> _Located:
    ref = side.ref.strip()
    if ref and exists(side.ref):
        path = absolute(side.ref)
    elif is_url(ref) or os.sep in ref or len(ref) < MIN_PREFIX_LENGTH:
        raise CompareError(f"{side.label}: {side.ref}: no such file or directory")
    else:
        path = _run_output_dir(ref, open_store)
    if side.strategy is None and is_directory(path) and exists(join(path, MANIFEST_FILE)):
        return _output_directory(path)
    return _Located(path, absolute(side.strategy) if side.strategy else None)


def _run_output_dir(ref: str, open_store: Callable | None) -> str:
    """The output directory of the run `ref` names (a run id or a unique prefix)."""
    from sqlalchemy.exc import SQLAlchemyError

    from reshard_job.audit.lookup import resolve_run_id
    from reshard_job.lineage.migrate import check_at_head
    from reshard_job.lineage.models import Run

    if open_store is None:
        raise LineageError(f"{ref}: no such file or directory")
    try:
        store = open_store()
    except LineageError as exc:
        raise LineageError(f"{ref}: no such file or directory, nor a run id ({exc})") from None
    except SQLAlchemyError as exc:
        raise LineageError(f"{ref}: no such file or directory, and the lineage database cannot be opened to look "
                           f"it up as a run id ({str(exc).strip().splitlines()[0]})") from None
    try:
        with store.read_session() as session:
            check_at_head(session.connection())
            session.rollback()
            try:
                run_id = resolve_run_id(session, ref)
            except LineageError as exc:
                raise LineageError(f"{ref}: no such file or directory, nor a run id ({exc})") from None
            output_dir = session.get(Run, run_id).output_dir
    except SQLAlchemyError as exc:
        detail = driver_detail(exc)
        raise LineageError(f"cannot read the lineage database: {detail}") from None
    finally:
        store.close()
    if not output_dir or not is_directory(output_dir):
        raise LineageError(f"run {run_id} wrote into {output_dir}, which is no longer there")
    return absolute(output_dir)


def _output_directory(path: str) -> _Located:
    """An output directory: its manifest's record of the outputs' fingerprints, when it still holds."""
    try:
        listing = read_listing(path)
    except LineageError as exc:  # someone else's manifest.json: the folder is read as any other
        return _Located(path, None, note=f"{exc}; read from the files")
    strategy = next((f.path for f in listing.files if f.kind == "strategy"), None)
    located = _Located(path, strategy, origin=listing.manifest_path)
    why = _stale(listing, _written_at(listing.created_at))
    if why is None:
        try:
            manifest = json_document(read_small_file(listing.manifest_path))
        except (ValueError, UnicodeDecodeError):
            manifest = {}
        located.record, located.algorithm, why = _record_of(manifest)
    if why is not None:
        located.note = f"{listing.manifest_path}: {why}; read from the files"
    return located


def _record_of(manifest: dict) -> tuple[dict | None, str | None, str | None]:
    """The outputs' fingerprints a manifest recorded, their algorithm, or why there are none."""
    section = manifest.get("fingerprints") if isinstance(manifest, dict) else None
    if not isinstance(section, dict):
        return None, None, "records no fingerprints"
    if section.get("target_unchecked"):
        return None, None, f"the outputs were not read back when written ({section['target_unchecked']})"
    target, algorithm = section.get("target"), section.get("algorithm")
    if not (isinstance(target, dict) and target and isinstance(algorithm, str)
            and all(isinstance(n, str) and isinstance(d, str) for n, d in target.items())):
        return None, None, "its fingerprints are not readable"
    return dict(target), algorithm, None


def _written_at(created_at: str | None) -> int | None:
    """When the job wrote the manifest, in ns, as it recorded in it (``created_at``): a touch of
    manifest.json moves its file time, not this."""
    try:
        written = dt.datetime.fromisoformat(created_at)
    except (TypeError, ValueError):
        return None
    if written.tzinfo is None:
        return None
    return int(written.timestamp()) * 1_000_000_000 + written.microsecond * 1000


def _stale(listing: OutputListing, written: int | None) -> str | None:
    """Why the files no longer are what the manifest describes (None: they still are, by size and
    time). The job publishes every file before it writes the manifest, so a file changed later
    (its modification or its change time: ``cp -a`` and ``touch`` set the first, not the second)
    was changed after it."""
    if written is None:
        return "records no time it was written (created_at)"
    for listed in listing.files:
        name = relative_to(listed.path, listing.directory) or listed.path
        try:
            size, when = file_size(listed.path), _changed(listed.path)
        except FileNotFoundError:
            return f"lists {name}, which is missing"
        except IsADirectoryError:
            return f"lists {name}, which is now a folder"
        if size != listed.size:
            return f"lists {name} with {listed.size} bytes, it now has {size}"
        if when > written:
            return f"{name} was changed after the manifest was written"
    return None


def _changed(path: str) -> int:
    """The last change of a file in ns (its modification or inode change time, the later); an
    object's in whole seconds (what its Last-Modified carries)."""
    if not is_url(path):
        st = os.stat(path)
        return max(st.st_mtime_ns, st.st_ctime_ns)
    info = storage_for(path).info(absolute(path))
    if info is None:
        raise FileNotFoundError(2, "no such object", path)
    return int(info.identity[-1]) * 1_000_000_000  # a remote identity is (size, etag, Last-Modified seconds)
