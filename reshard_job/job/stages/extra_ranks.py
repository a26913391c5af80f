"""Rank folders beyond what the source strategy describes: leftovers of another save (refused),
shards of a model saved without its strategy (refused), or copies of one whole model
(``source.unsharded=true``: compared by content unless ``source.verify_replicas=false``)."""

from __future__ import annotations

import hashlib
import logging

from reshard_job.errors import PlanError, ReshardError
from reshard_job.formats.tensorfile import KIND_TENSOR
from reshard_job.sources.open_files import SourceFiles
from reshard_job.sources.rank_folders import LoadedStrategy, RankFiles
from reshard_job.storage import storage_for
from reshard_job.text import shorten
from reshard_job.job.config.spec import SourceSpec

log = logging.getLogger("reshard_job")
SAMPLE_BYTES = 4096  # per probe when telling shards from copies


def cross_check(found: RankFiles, strategy: LoadedStrategy, source: SourceSpec, index, storage) -> list[str]:
    checks = []
    extra = sorted(r for r in found.files if r >= strategy.topology.devices)
    if source.strategy is None and extra and not source.unsharded:
        _refuse_shards_without_strategy(found, index, extra, storage)
        checks.append("rank folders without a strategy hold copies of one model (sampled)")
    elif extra and source.strategy is None:
        log.info("source.unsharded=true: rank_%d is the model; rank folders %s are taken as copies of it",
                 min(index), ", ".join(f"rank_{r}" for r in extra[:8]))
        if source.verify_replicas:
            _compare_copies(found, index, extra, storage)
            checks.append("rank folders declared copies (source.unsharded) hold the same tensors, compared by content")
    elif extra:
        _check_extra_ranks(found, strategy, source, index, extra, storage)  # raises
    elif source.strategy is not None:
        checks.append("no rank folder beyond the ranks the source strategy describes")
    return checks


def _extra_readers(found: RankFiles, ranks: list[int], storage):
    return SourceFiles({r: found.files[r] for r in ranks}, verify_crc=False, identities=found.identities,
                       storage=storage)


def _check_extra_ranks(found, strategy, source, index, extra, storage) -> None:
    """Ignoring rank directories beyond the strategy's devices is safe only when they hold nothing
    the others lack; otherwise (a pipeline strategy directory missing its last stage, the strategy
    of another run) their parameters would silently be missing from the outputs."""
    known = set().union(*index.values()) if index else set()
    with _extra_readers(found, extra, storage) as readers:
        for r in extra:
            try:
                unknown = [n for n in readers.reader(r).names() if n not in known]
            except ReshardError as e:
                log.warning("rank_%d is ignored and cannot be read either: %s", r, e)
                continue
            if not unknown:
                continue
            is_dir = storage_for(source.strategy, storage).info(source.strategy)
            hint = (f"is a pipeline stage's strategy file missing from {source.strategy}?" if is_dir and is_dir.is_dir
                    else "was source.strategy saved with these checkpoints?")
            raise PlanError(
                f"{found.files[r]}: rank {r} lies beyond the {strategy.topology.devices} rank(s) the source strategy "
                f"describes, but holds {len(unknown)} parameter(s) that no rank within it holds "
                f"(e.g. {shorten(unknown[0], 80)!r}); {hint}"
            )
    # A strategy describes every rank of the run it was saved with: more rank folders mean another
    # run's strategy (whose layouts may still fit the first ranks' shapes) or another save's leftovers.
    names = ", ".join(f"rank_{r}" for r in extra[:8]) + (", ..." if len(extra) > 8 else "")
    raise PlanError(f"{found.root}: rank folders {names} lie beyond the {strategy.topology.devices} rank(s) the "
                    f"source strategy describes; a strategy describes every rank of the run it was saved with, so "
                    "either it belongs to another run (use the one saved with these checkpoints) or these folders "
                    "are leftovers of another save (move them away)")


def _refuse_shards_without_strategy(found: RankFiles, index, extra: list[int], storage) -> None:
    """Without source.strategy the source is one whole model (rank_0). Several rank folders are
    fine when they are copies (pure data parallel); when they differ they are shards, and rank 0's
    shard written out as "the model" would be wrong: refuse, naming the remedy."""
    first = index[min(index)]
    with _extra_readers(found, extra, storage) as readers, _extra_readers(found, [min(index)], storage) as base:
        for r in extra:
            reader = readers.reader(r)
            for name, meta in first.items():
                other = reader.entries.get(name)
                differs = other is None or other.dtype != meta.dtype or tuple(other.shape) != meta.shape
                if not differs and meta.kind == KIND_TENSOR:
                    differs = _sample(base.reader(min(index)), name) != _sample(reader, name)
                if differs:
                    raise PlanError(
                        f"{found.root}: source.strategy is not set, but the {len(found.files)} rank folders hold "
                        f"different tensors (e.g. {shorten(name, 80)!r} differs between rank_{min(index)} and "
                        f"rank_{r}): they look like shards of one model; set source.strategy to the strategy file "
                        "saved with them, or source.unsharded=true if each rank folder is a whole copy")


def _sample(reader, name: str) -> str:
    """A digest of a tensor's first, middle and last bytes: enough to tell shards from copies."""
    entry = reader.entries[name]
    size = entry.stored_bytes
    h = hashlib.sha256()
    for start in sorted({0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)}):
        n = min(SAMPLE_BYTES, size - start)
        buf = bytearray(n)
        reader.read_logical(entry, start, memoryview(buf))
        h.update(buf)
    return h.hexdigest()


def _compare_copies(found: RankFiles, index, extra: list[int], storage) -> None:
    """Rank folders the user declares copies of rank 0's whole model: the same names, dtypes,
    shapes and bytes, every tensor read (a copy that differs is not one to convert from in silence)."""
    first = min(index)
    with _extra_readers(found, extra, storage) as readers, _extra_readers(found, [first], storage) as base:
        model = base.reader(first)
        model_digests: dict[str, str] = {}  # rank 0's, read once however many copies are compared
        for r in extra:
            reader = readers.reader(r)
            names = set(reader.entries)
            for name, meta in index[first].items():
                other = reader.entries.get(name)
                if other is None:
                    why = "lacks it"
                elif other.dtype != meta.dtype or tuple(other.shape) != tuple(meta.shape):
                    why = f"holds it as {other.dtype} {list(other.shape)}, not {meta.dtype} {list(meta.shape)}"
                elif meta.kind == KIND_TENSOR and tensor_digest(reader, name) != (
                        model_digests.get(name) or model_digests.setdefault(name, tensor_digest(model, name))):
                    why = "holds other values"
                else:
                    continue
                _not_a_copy(found, first, r, f"{shorten(name, 80)!r}: rank_{r} {why}")
            more = sorted(names - set(index[first]))
            if more:
                _not_a_copy(found, first, r, f"rank_{r} holds {shorten(more[0], 80)!r}, which rank_{first} lacks")


def _not_a_copy(found: RankFiles, first: int, r: int, what: str) -> None:
    raise PlanError(f"{found.files[r]}: source.unsharded=true says each rank folder is a copy of rank_{first}'s "
                    f"whole model, but {what}; convert from rank_{first} alone, or give source.strategy if the "
                    "folders are shards (source.verify_replicas=false skips this comparison)")


def tensor_digest(reader, name: str) -> str:
    h = hashlib.sha256()
    for block in reader.iter_content(name):
        h.update(block)
    return h.hexdigest()
