"""A load's fingerprint shares in the lineage database, on SQLite and on PostgreSQL: recorded in bulk
(more rows than one batch), read back exactly and in name order across loads, replaced when
recorded again, deleted with their run, refused in one line when malformed."""

from __future__ import annotations

import pytest
from sqlalchemy import delete, func, select

from reshard_job.core.fingerprint_shares import Share
from reshard_job.lineage import LineageError
from reshard_job.lineage.fingerprint_rows import BATCH_ROWS
from reshard_job.lineage.load_shares import box_text, count_shares, parse_box, parse_shape, read_shares, shape_text
from reshard_job.lineage.models import LoadFingerprint, Run

ALGORITHM = "poslin64x2-v1"


def _load(store, rank: int) -> str:
    return store.start_run(config={"load": {"rank": rank}}, overrides=[], tool_version="0.1.0",
                           output_dir=f"(loaded into memory by test, target rank {rank})", source_devices=8,
                           target_devices=2)


def _shares(count: int, rank: int, salt: int = 0) -> list[Share]:
    return [Share(f"layer.{i:05d}.weight", "BFloat16", (64, 2 * (i % 3 + 1)), ((32 * rank, 32 * rank + 32),
                  (0, 2 * (i % 3 + 1))), f"{(i * 2654435761 + rank + salt) % 2**128:032x}", rank=rank)
            for i in range(count)]


def test_shares_read_back_exactly_in_name_order_across_loads(store):
    count = BATCH_ROWS * 2 + 7
    loads = {_load(store, rank): rank for rank in (1, 0)}
    recorded = {run_id: _shares(count, rank) for run_id, rank in loads.items()}
    for run_id, shares in recorded.items():
        assert store.record_load_shares(run_id, reversed(shares)) == count  # any order in, key order stored
    with store.read_session() as session:
        read = list(read_shares(session, loads))
        assert count_shares(session, next(iter(loads))) == (count, ALGORITHM)
    assert sorted(read, key=lambda s: (s.name, s.rank)) == sorted(
        [s for shares in recorded.values() for s in shares], key=lambda s: (s.name, s.rank))
    names = [s.name for s in read]
    assert names == sorted(names)  # one parameter's shares together, for merge_shares


def test_recording_again_replaces_a_loads_shares_and_deleting_the_run_deletes_them(store):
    run_id, other = _load(store, 0), _load(store, 1)
    store.record_load_shares(other, _shares(3, 1))
    store.record_load_shares(run_id, _shares(40, 0))
    store.record_load_shares(run_id, _shares(5, 0, salt=9))
    with store.read_session() as session:
        assert list(read_shares(session, {run_id: 0})) == _shares(5, 0, salt=9)
        assert count_shares(session, other) == (3, ALGORITHM)
    with store.engine.begin() as connection:
        connection.execute(delete(Run).where(Run.id == run_id))
    with store.read_session() as session:
        left = session.scalar(select(func.count()).select_from(LoadFingerprint))
    assert left == 3


def test_a_malformed_share_is_refused_in_one_line_and_nothing_is_written(store):
    run_id = _load(store, 0)
    bad = _shares(3, 0) + [Share("w", "Float32", (4,), ((0, 4),), "ab" * 40)]
    with pytest.raises(LineageError, match=r"^load fingerprint of parameter 'w' is 'abab"):
        store.record_load_shares(run_id, bad)
    with store.read_session() as session:
        assert count_shares(session, run_id) == (0, None)


@pytest.mark.parametrize("shape,box", [((4096, 1024), ((0, 1024), (512, 1024))), ((), ()), ((7,), ((3, 4),))])
def test_shapes_and_boxes_as_text_and_back(shape, box):
    assert parse_shape(shape_text(shape)) == shape and parse_box(box_text(box)) == box
    assert box_text(((0, 1024), (512, 1024))) == "0:1024,512:1024"


def test_shares_streamed_out_of_name_order_are_refused_naming_the_parameter(store):
    class Streamed:  # what a load hands over: every iteration gives the shares again, lazily
        def __iter__(self):
            yield from reversed(_shares(3, 0))

    run_id = _load(store, 0)
    with pytest.raises(LineageError, match=r"parameter 'layer.00001.weight' comes after 'layer.00002.weight'"):
        store.record_load_shares(run_id, Streamed())
    assert store.record_load_shares(run_id, iter(_shares(3, 0)[::-1])) == 3  # a one-time iterator is sorted first
