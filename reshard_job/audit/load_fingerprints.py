"""A model loaded rank by rank, put back together: the loads' fingerprint shares merged per parameter.

Each recorded load (``reshard_job.load_rank`` with a lineage database) keeps, per parameter, the
fingerprint of the part its rank holds (``lineage.load_shares``). Given the loads of every target
rank of one consumer, the shares add up to each parameter's whole fingerprint: the value a
conversion of the same sources to the same layout records in ``manifest.json``
(``fingerprints.target``), so a model loaded without a copy can be compared with any checkpoint.
Loads of some ranks only leave parameters incomplete, and the answer says which.
"""

from __future__ import annotations

from typing import Iterable

from sqlalchemy.orm import Session

from reshard_job.audit.lookup import resolve_run_id
from reshard_job.core.fingerprint_shares import MergedFingerprints, merge_shares
from reshard_job.lineage.errors import LineageError
from reshard_job.lineage.load_shares import count_shares, read_shares
from reshard_job.lineage.models import Run


def load_ranks(session: Session, refs: Iterable[str]) -> dict[str, int | None]:
    """Run id -> target rank of each load `refs` names (whole ids or unique prefixes); a run that
    is not a load, or a load recorded before loads kept fingerprints, is refused in one line."""
    ranks: dict[str, int | None] = {}
    for ref in refs:
        run_id = resolve_run_id(session, str(ref))
        config = session.get(Run, run_id).config
        load = config.get("load") if isinstance(config, dict) else None
        if not isinstance(load, dict):
            raise LineageError(f"run {run_id} is not a load (it was not recorded by reshard_job.load_rank)")
        if count_shares(session, run_id)[0] == 0:
            raise LineageError(f"load {run_id} recorded no fingerprints (it was recorded before loads kept them)")
        rank = load.get("rank")
        ranks[run_id] = rank if isinstance(rank, int) else None
    if not ranks:
        raise LineageError("no loads given: name the run ids of the loads to put together")
    return ranks


def merge_loads(session: Session, refs: Iterable[str]) -> MergedFingerprints:
    """The whole-parameter fingerprints of the loads `refs` names, read a parameter at a time."""
    return merge_shares(read_shares(session, load_ranks(session, refs)))
