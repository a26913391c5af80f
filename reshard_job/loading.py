"""Resharding at load time: the tensors one target rank needs, read straight from the sources.

``load_rank(rank_id, src_checkpoints, src_strategy_file, dst_strategy_file)`` prepares the sources
as the job does (the same discovery, cross-checks and refusals, every source kind the job reads,
local or ``s3://``), plans that one target rank, and runs the rank task's own reading code into
memory instead of into a file: each array is byte-equal to the tensor the job writes for that rank,
and only the byte ranges the rank needs are read (coalesced by the readers' read-ahead).

What a load verifies (``verify``). The CRCs the formats carry cover whole files: a ``.ckpt``'s
trailer is the CRC32 of every byte before it, MindSpore safetensors' ``crc_num`` is chained over
every tensor in name order. No part of a file has a CRC of its own, so a rank that reads part of a
file cannot check one without reading the rest. The job can, because it reads every source file
whole anyway, to hash it. A load therefore checks, by default (``verify="read"``), all that needs
no byte the rank does not read:

- every check of the job's prepare stage: each file's structure (record framing, offsets and
  lengths within the file, dtypes and shapes against byte counts), the source kind's own
  cross-checks (a MindFormers ``metadata.json`` against every header, an export's index against
  its shards), and the job's refusals, with the same one-line errors;
- each file's identity (size, times, inode; an object's size and ETag) as listed, when it is
  opened and again after the last read, so bytes that changed under the load are refused rather
  than returned;
- the format's CRC, when the load is recorded in lineage: the record names each file by its
  sha256, so the files are read whole for it anyway, and the CRC is checked in that same read (or
  taken from the digest cache, for files unchanged since they were hashed).

``verify="full"`` adds what the job's extra read gives: before any tensor is returned, each file
the rank reads is read whole once, its CRC checked (its sha256 then serves the lineage record, so
it is not read again; the digest cache is not trusted), and the tensors the source strategy says
several of those files hold identically (replicas of one block) are compared by content, as the
job compares them; the rank reads one copy, by default the others are not looked at. It costs a read of every file the rank touches, which is why it is not the default.

What a recorded load keeps of the bytes it returned: the fingerprint *share* of each tensor
(``core.fingerprint_shares``), the ``poslin64x2-v1`` fingerprint of the slice the rank holds keyed
by where it lies in the parameter (its box in the target layout, ``plan.target_boxes``), computed
in one pass over the arrays as they are returned. ``merge_load_fingerprints`` adds up the shares
of the loads of all target ranks into each parameter's fingerprint, the value a conversion's
``manifest.json`` holds, and names the parameters that some ranks' loads leave incomplete.

Arrays come back in their own dtype; bfloat16 as ``ml_dtypes.bfloat16``; qint4x2 (Int4) as int8 of
its stored shape (two 4-bit values per byte); a dtype numpy has no type for as its raw bytes (uint8). A ``.ckpt``'s string entries are not tensors and
are left out. ``iter_rank`` yields ``(name, array)`` a few parameters at a time, for a rank that
does not want everything in memory at once. ``to_mindspore_parameters`` turns the arrays into
``mindspore.Parameter``s for ``load_param_into_net`` (MindSpore is imported there only).
"""

from __future__ import annotations

import os
from math import prod
from typing import Iterator

import numpy as np

import reshard_job.core.dtypes as dtypes
from reshard_job.formats.base import TensorDecl
from reshard_job.plan.model import UNMAPPED_CHOICES, UNMAPPED_OMIT, ParamPlans, RankPlan

BATCH_PARAMETERS = 256  # parameters read per step of ``iter_rank`` (small ones are most of a large model)
READ_MEMORY = 64 << 20  # in-flight buffer bound of the rank task's reads (``job.max_memory``)
CONSUMER_ENV_VAR = "RESHARD_JOB_CONSUMER"  # who loads, when load_rank is not told
VERIFY_READ = "read"  # check what the bytes read allow (module docstring)
VERIFY_FULL = "full"  # also read each file whole: its CRC, and replicas compared
VERIFY_LEVELS = (VERIFY_READ, VERIFY_FULL)


class _Arrays:
    """The calls of a checkpoint writer, keeping each tensor as a numpy array."""

    writes_in_given_order = True

    def __init__(self):
        self.out: list[tuple[str, np.ndarray]] = []

    def arrange(self, tensors: list[TensorDecl]) -> list[str]:
        return [t.name for t in tensors]

    def add_bytes(self, name: str, dtype: str, dims, data, *_) -> None:
        buf = np.empty(memoryview(data).nbytes, np.uint8)
        buf[:] = np.frombuffer(memoryview(data).cast("B"), np.uint8)  # the caller's window is reused
        self.out.append((name, _typed(buf, dtype, dims)))

    def begin(self, name: str, dtype: str, dims, *_, **__) -> "_Filling":
        return _Filling(self, name, dtype, dims)

    def add_str(self, name: str, text: str, dims=(0,)) -> None:
        return None

    def add_map(self, name: str, records) -> None:
        return None


class _Filling:
    """One tensor's bytes, in order, into a buffer of its size (allocated once: the array returned
    is that buffer, so a large tensor costs its own size and no copy)."""

    def __init__(self, owner: _Arrays, name: str, dtype: str, dims):
        self.owner, self.name, self.dtype, self.dims = owner, name, dtype, tuple(dims)
        dt = dtypes.BY_NAME[dtype]
        self.buf = np.empty(prod(self.dims) * dt.itemsize, np.uint8) if dt.sliceable else None
        self.parts: list[np.ndarray] = []  # a packed dtype's size is known only once written
        self.done = 0

    def write(self, data) -> None:
        chunk = np.frombuffer(memoryview(data).cast("B"), np.uint8)
        if self.buf is None:
            self.parts.append(chunk.copy())
            return
        if self.done + chunk.size > self.buf.size:
            raise ValueError(f"parameter {self.name!r}: more bytes than its shape {list(self.dims)} holds")
        self.buf[self.done:self.done + chunk.size] = chunk
        self.done += chunk.size

    def close(self) -> None:
        if self.buf is None:
            self.buf = np.concatenate(self.parts) if self.parts else np.empty(0, np.uint8)
        elif self.done != self.buf.size:
            raise ValueError(f"parameter {self.name!r}: {self.done} of its {self.buf.size} bytes were read")
        self.parts = []
        self.owner.out.append((self.name, _typed(self.buf, self.dtype, self.dims)))


def _typed(raw: np.ndarray, dtype: str, dims) -> np.ndarray:
    """Raw little-endian bytes as an array of the tensor's dtype and shape."""
    dt = dtypes.BY_NAME[dtype]
    if not dt.sliceable:
        return raw  # an opaque dtype: numpy has no type for it
    if dt.name == "BFloat16":
        import ml_dtypes

        return raw.view(ml_dtypes.bfloat16).reshape(dims)
    return raw.view(dt.storage).reshape(dims)


def _prepared(rank_id: int, src_checkpoints, src_strategy_file, dst_strategy_file, storage_options, unmapped,
              verify: str = VERIFY_READ, selection: dict | None = None):
    from reshard_job.errors import ConfigError, MissingRankError
    from reshard_job.job.config.spec import SourceSpec, TargetSpec
    from reshard_job.job.stages.prepare import prepare_from
    from reshard_job.sources.base import reader_for
    from reshard_job.storage import StorageOptions

    def absolute(p):
        return None if p is None else str(p) if "://" in str(p) else os.path.abspath(os.fspath(p))

    if isinstance(rank_id, bool) or not isinstance(rank_id, (int, np.integer)) or rank_id < 0:
        raise ConfigError(f"rank_id must be a target rank (an integer >= 0), got {rank_id!r}")
    if unmapped not in UNMAPPED_CHOICES:
        raise ConfigError(f"unmapped must be {' or '.join(map(repr, UNMAPPED_CHOICES))}, got {unmapped!r:.80}")
    if verify not in VERIFY_LEVELS:
        raise ConfigError(f"verify must be {' or '.join(map(repr, VERIFY_LEVELS))}, got {verify!r}")
    for what, value in (("src_checkpoints", src_checkpoints), ("src_strategy_file", src_strategy_file),
                        ("dst_strategy_file", dst_strategy_file)):
        if not (isinstance(value, (str, os.PathLike)) or (value is None and what != "src_checkpoints")):
            raise ConfigError(f"{what} must be a path (a str or os.PathLike), got {type(value).__name__} "
                              f"{value!r:.80}")
    if not (storage_options is None or isinstance(storage_options, (dict, StorageOptions))):
        raise ConfigError(f"storage_options must be a dict of storage settings, got {storage_options!r:.80}")
    options = StorageOptions(**(storage_options or {})) if isinstance(storage_options, dict) else storage_options
    source = SourceSpec(absolute(src_checkpoints), absolute(src_strategy_file))
    target = TargetSpec(strategy=absolute(dst_strategy_file), unmapped=unmapped, **_selection_spec(selection))
    reader = reader_for(source, options)
    reader.check(source)
    found = _only_ranks_read(reader, reader.discover(source), source, target, int(rank_id), options)
    prepared = prepare_from(reader, found, source, target, ranks=(int(rank_id),), storage=options)
    try:
        if prepared.missing:
            raise MissingRankError(prepared.missing, prepared.source.checkpoints)
    except BaseException:
        prepared.close()
        raise
    return prepared


def _selection_spec(selection: dict | None) -> dict:
    """TargetSpec's include/exclude/rename from the API's keywords (``plan.selection``)."""
    from reshard_job.plan.selection import include_value, patterns_value, rename_value

    selection = selection or {}
    include = selection.get("include")
    return {"include": None if include is None else include_value(include),
            "exclude": patterns_value(selection.get("exclude")), "rename": rename_value(selection.get("rename"))}


def _only_ranks_read(reader, found, source, target, rank_id: int, options):
    """The rank files the rank's plan can read, of sharded rank folders (their layouts say which):
    the other ranks' files are not even indexed, which would read their record heads (on an object
    store, the whole of files of small tensors). A MindFormers save or an export folder keeps its
    own, already lean, way."""
    from dataclasses import replace

    from reshard_job.job.stages.target import settle_target
    from reshard_job.plan.rank_list import source_ranks_for
    from reshard_job.sources.rank_folders import RankFolders

    if not isinstance(reader, RankFolders) or source.strategy is None or target.rename:
        return found  # (a renamed target strategy is matched once the names are known)
    layouts = reader.layouts(source.strategy)
    if any(r >= layouts.topology.devices for r in found.files):
        return found  # rank folders beyond the strategy's ranks: refused by the job's cross-check, as the job does
    dst = settle_target(target, layouts, {}, options)
    needed = set(source_ranks_for(layouts.topology, dst.topology, rank_id, unmapped=target.unmapped))
    if not needed or not needed <= set(found.files):
        return found  # the plan says what is missing, in its own words
    keep = {r: v for r, v in found.files.items() if r in needed}
    return replace(found, files=keep, identities={r: v for r, v in found.identities.items() if r in needed},
                   sizes={r: v for r, v in found.sizes.items() if r in needed})


def iter_rank(rank_id: int, src_checkpoints, src_strategy_file=None, dst_strategy_file=None, *,
              storage_options=None, unmapped: str = UNMAPPED_OMIT, verify: str = VERIFY_READ,
              include=None, exclude=None, rename=None) -> Iterator[tuple[str, np.ndarray]]:
    """``(name, array)`` of every tensor target rank `rank_id` holds, in the order the job writes
    them, read a few parameters at a time (see the module docstring, ``verify`` included). A file
    found changed after the last read raises then, after the arrays were yielded: a caller that
    must not use such arrays keeps them until the iteration ends."""
    from reshard_job.storage.s3file import lean_index

    with lean_index():  # an object store: fetch record heads and the rank's ranges, not what it skips
        prepared = _prepared(rank_id, src_checkpoints, src_strategy_file, dst_strategy_file, storage_options,
                             unmapped, verify, {"include": include, "exclude": exclude, "rename": rename})
        with prepared:
            if verify == VERIFY_FULL:
                check_whole_files(prepared)
            yield from _read(prepared, int(rank_id))
            prepared.readers.check_unchanged()


def check_whole_files(prepared, *, use_cache: bool = False):
    """The job's integrity pass over the files this rank reads (``job.stages.integrity``): each read
    whole once for its sha256, its format's CRC checked in that read, and the tensors the rank
    loads that several of those files hold as replicas compared by the CRCs taken in it. Returns
    the digests (``SourceDigests``), which name the files in the lineage record."""
    from reshard_job.job.stages.integrity import hash_sources

    return hash_sources(prepared, use_cache=use_cache, progress=False, storage=prepared.readers.storage)


def _read(prepared, rank_id: int, shares: "_Shares | None" = None) -> Iterator[tuple[str, np.ndarray]]:
    from reshard_job.execute.rank_task import write_params

    params = prepared.plan.rank(rank_id).params
    for start in range(0, len(params), BATCH_PARAMETERS):
        arrays = _Arrays()
        write_params(arrays, RankPlan(rank_id, _slice(params, start)), prepared.readers, max_memory=READ_MEMORY)
        if shares is not None:
            for name, array in arrays.out:
                shares.add(name, array)
        yield from arrays.out


class _Shares:
    """The fingerprint share of each tensor a rank loads (``core.fingerprint_shares``): its bytes
    keyed by where they lie in the parameter, the box the target layout gives the rank. One pass
    over the arrays as they are returned; nothing is read again. Iterating gives the ``Share``s in
    name order, made as they are recorded (a model of many parameters holds no list of them)."""

    def __init__(self, prepared, rank_id: int):
        from reshard_job.core.fingerprint_shares import ShareBatch
        from reshard_job.plan.target_boxes import TargetBoxes, planned_tensors

        planned = list(planned_tensors(prepared.plan.rank(rank_id).params))
        self.rank = rank_id
        self.planned = {t.name: (t, shape) for t, shape in planned}
        self.boxes = TargetBoxes(prepared.target.topology, rank_id, {t.name: tuple(t.global_shape) for t, _ in planned})
        self.box_of: dict[str, tuple] = {}
        self.batch = ShareBatch()

    def add(self, name: str, array: np.ndarray) -> None:
        tensor, target_shape = self.planned[name]
        box = self.box_of[name] = self.boxes.box(tensor, target_shape)
        self.batch.add(name, tensor.dtype, tensor.global_shape, box, array)

    def __iter__(self):
        from reshard_job.core.fingerprint_shares import Share

        digests = self.batch.flush()
        for name in sorted(self.box_of):
            tensor = self.planned[name][0]
            yield Share(name, tensor.dtype, tuple(tensor.global_shape), self.box_of[name], digests[name],
                        rank=self.rank)


def _slice(params, start: int):
    stop = start + BATCH_PARAMETERS
    if isinstance(params, ParamPlans):
        return ParamPlans(params.tensors[start:stop], params.slices[start:stop])
    return list(params[start:stop])


def load_rank(rank_id: int, src_checkpoints, src_strategy_file=None, dst_strategy_file=None, *,
              consumer: str | None = None, lineage_url: str | None = None, storage_options=None,
              unmapped: str = UNMAPPED_OMIT, verify: str = VERIFY_READ, include=None, exclude=None,
              rename=None) -> dict[str, np.ndarray]:
    """The tensors target rank `rank_id` needs, as the job would write them for that rank.

    `src_checkpoints`: a folder of ``rank_<r>/`` files, a MindFormers save, an export folder, or a
    single ``.ckpt``/``.safetensors`` file of a whole model, local or ``s3://``; `src_strategy_file`:
    its strategy file or per-stage folder (None: unsharded, or the layouts a MindFormers save
    holds); `dst_strategy_file`: the target's (None: one whole model). `storage_options`: ``{"endpoint_url": ..., "options": {...}}`` for object stores.
    `consumer` and `lineage_url` name who loads and where the load is recorded (see README).
    `verify`: ``"read"`` checks what the bytes the rank reads allow (and the CRCs, when the load is
    recorded), ``"full"`` also reads each file whole for its CRC and compares replicas (module
    docstring); a file that fails is refused in one line naming it, and nothing is returned.
    `include`, `exclude`, `rename`: part of the model, or new names, as ``transform_checkpoints``'s."""
    from reshard_job.lineage.database import url_from_environment

    if consumer is not None and not isinstance(consumer, str):
        from reshard_job.errors import ConfigError

        raise ConfigError(f"consumer must be a name (a str), got {consumer!r:.80}")
    url = lineage_url or url_from_environment()
    if url is None:
        return dict(iter_rank(rank_id, src_checkpoints, src_strategy_file, dst_strategy_file,
                              storage_options=storage_options, unmapped=unmapped, verify=verify, include=include,
                              exclude=exclude, rename=rename))
    from reshard_job.storage.s3file import lean_index

    with lean_index():
        prepared = _prepared(rank_id, src_checkpoints, src_strategy_file, dst_strategy_file, storage_options,
                             unmapped, verify, {"include": include, "exclude": exclude, "rename": rename})
        with prepared:
            digests = check_whole_files(prepared) if verify == VERIFY_FULL else None
            shares = _Shares(prepared, int(rank_id))
            arrays = dict(_read(prepared, int(rank_id), shares))
            prepared.readers.check_unchanged()
            record_load(prepared, int(rank_id), consumer or _consumer_from_environment(), url, digests,
                        shares=shares)
    return arrays


def _consumer_from_environment() -> str:
    import sys

    return os.environ.get(CONSUMER_ENV_VAR) or os.path.basename(sys.argv[0] or "") or "python"


def record_load(prepared, rank_id: int, consumer: str, url: str, digests=None, shares=None) -> str:
    """Record in the lineage database at `url` that `consumer` loaded target rank `rank_id` from
    the source files the rank read, with their sha256: `digests` (``check_whole_files``'s), else
    taken now by the job's integrity pass, CRCs and replicas checked as the job checks them (from
    the digest cache where the files are unchanged since hashed, else in one read of each file);
    returns the run id. ``audit trace --descendants`` of any of those files lists it. The same
    core as ``record_use`` records it (``lineage.uses``): a load is a use whose plan is the rank's.
    `shares`: the fingerprint share of each tensor returned (``_Shares``), recorded with the load."""
    from reshard_job.lineage import FileRecord
    from reshard_job.lineage.uses import UseRun, record_run
    from reshard_job.sources.file_digests import HashRequest, digest_files

    storage = prepared.readers.storage
    if digests is None:
        digests = check_whole_files(prepared, use_cache=True)
    strategies = list(digests.strategies)
    target_strategy = prepared.target.strategy_from
    if target_strategy and target_strategy not in prepared.strategy.files and (
            "://" in target_strategy or os.path.isfile(target_strategy)):
        strategies += digest_files([HashRequest(target_strategy)], threads=1, storage_options=storage)
    inputs = [FileRecord(f["path"], f["sha256"], f["size"], "source_checkpoint", f["rank"]) for f in digests.files]
    inputs += [FileRecord(d.path, d.sha256, d.size, "strategy") for d in strategies]
    load = {"consumer": consumer, "rank": rank_id, "source": prepared.source.checkpoints,
            "source_strategy": prepared.source.strategy, "target_strategy": prepared.target.strategy_from}
    return record_run(url, UseRun(consumer, inputs, details={"load": load},
                                  where=f"(loaded into memory by {consumer}, target rank {rank_id})",
                                  plan=prepared.plan.to_json(), source_devices=prepared.strategy.topology.devices,
                                  target_devices=prepared.target.devices, shares=shares))


def merge_load_fingerprints(loads, *, lineage_url: str | None = None):
    """Whole-parameter fingerprints of a model loaded rank by rank: the recorded loads `loads` (run
    ids, or unique prefixes of 8+ characters; one per target rank) put back together.

    Each load recorded the fingerprint of the part of each parameter its rank returned; the parts
    of all target ranks add up to the parameter's fingerprint, equal to what a conversion of the
    same sources to the same layout records in ``manifest.json`` (``fingerprints.target``). Returns
    ``MergedFingerprints``: ``fingerprints`` (name -> hex) of every parameter the loads cover,
    ``incomplete`` (name -> what is missing: loads of some ranks only), ``conflicts`` (name -> why
    its parts disagree: replicas that loaded different bytes), ``complete``, ``to_json()``. The
    database: `lineage_url`, else ``$RESHARD_JOB_LINEAGE_URL``, else ``runs/lineage.db``."""
    from reshard_job.audit.commands.database import open_store
    from reshard_job.audit.load_fingerprints import merge_loads
    from reshard_job.lineage.database import default_url, sqlite_url
    from reshard_job.lineage.migrate import check_at_head

    url = lineage_url or default_url()
    store = open_store(url if "://" in url else sqlite_url(os.path.abspath(url)))
    try:
        with store.read_session() as session:
            check_at_head(session.connection())
            return merge_loads(session, [loads] if isinstance(loads, str) else list(loads))
    finally:
        store.close()


def to_mindspore_parameters(arrays: dict[str, np.ndarray]) -> dict:
    """``{name: mindspore.Parameter}`` for ``mindspore.load_param_into_net(net, ...)``."""
    import mindspore  # only here: the rest of the package never needs it

    out = {}
    for name, array in arrays.items():
        if array.dtype.name == "bfloat16":
            tensor = mindspore.Tensor(array.astype(np.float32), mindspore.bfloat16)
        else:
            tensor = mindspore.Tensor(array)
        out[name] = mindspore.Parameter(tensor, name=name)
    return out
