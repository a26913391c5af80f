"""Per-parameter fingerprints of a run in the lineage database, on SQLite and on PostgreSQL:
recorded in bulk, read back whole, replaced when recorded again, refused in one line when malformed."""

from __future__ import annotations

import math

import pytest
from sqlalchemy import delete, event, func, select
from sqlalchemy.exc import IntegrityError

from reshard_job.lineage import LineageError, RunStateError, UnknownRunError
from reshard_job.lineage import fingerprint_rows
from reshard_job.lineage.models import Run, RunFingerprint

ALGORITHM = "poslin64x2-v1"


def _start(store, tmp_path) -> str:
    return store.start_run(config={}, overrides=[], tool_version="0.1.0", output_dir=str(tmp_path / "out"),
                           source_devices=8, target_devices=4)


def _digest(i: int, salt: int = 0) -> str:
    return f"{(i * 2654435761 + salt) % 2**128:032x}"


def _digests(count: int, salt: int = 0, prefix: str = "layer") -> dict[str, str]:
    return {f"{prefix}.{i}.weight": _digest(i, salt) for i in range(count)}


def _rows_of(store, run_id: str) -> int:
    with store.read_session() as session:
        return session.scalar(select(func.count()).select_from(RunFingerprint).where(RunFingerprint.run_id == run_id))


def test_recorded_fingerprints_read_back_exactly(store, tmp_path):
    run_id = _start(store, tmp_path)
    source = _digests(51)
    target = dict(source)
    target["layer.3.weight"] = _digest(3, salt=1)  # recorded as given: the proof stage judges, the store keeps
    store.record_fingerprints(run_id, ALGORITHM, source, target)
    assert store.fingerprints(run_id) == {"algorithm": ALGORITHM, "source": source, "target": target}
    assert _rows_of(store, run_id) == 102


def test_outputs_not_read_back_record_the_sources_only(store, tmp_path):
    run_id = _start(store, tmp_path)
    store.record_fingerprints(run_id, ALGORITHM, {"w": "AB" * 16}, None)
    assert store.fingerprints(run_id) == {"algorithm": ALGORITHM, "source": {"w": "ab" * 16}, "target": {}}


def test_recording_again_replaces_the_runs_rows_and_leaves_other_runs_alone(store, tmp_path):
    run_id, other = _start(store, tmp_path), _start(store, tmp_path)
    store.record_fingerprints(other, ALGORITHM, _digests(5, prefix="other"), _digests(5, prefix="other"))
    store.record_fingerprints(run_id, ALGORITHM, _digests(30), _digests(30))
    again = _digests(10, salt=7)  # fewer parameters, other digests
    store.record_fingerprints(run_id, ALGORITHM, again, None)
    assert store.fingerprints(run_id) == {"algorithm": ALGORITHM, "source": again, "target": {}}
    assert _rows_of(store, run_id) == 10
    assert store.fingerprints(other)["target"] == _digests(5, prefix="other")


def test_rows_go_in_as_batched_executemany_not_one_statement_per_row(store, tmp_path, monkeypatch):
    monkeypatch.setattr(fingerprint_rows, "BATCH_ROWS", 7)
    inserts = []

    def count(conn, cursor, statement, parameters, context, executemany):
        if statement.lstrip().upper().startswith("INSERT INTO RUN_FINGERPRINTS"):
            inserts.append((executemany, len(parameters) if executemany else 1))

    event.listen(store.engine, "before_cursor_execute", count)
    try:
        run_id = _start(store, tmp_path)
        source, target = _digests(20), _digests(18)
        store.record_fingerprints(run_id, ALGORITHM, source, target)
    finally:
        event.remove(store.engine, "before_cursor_execute", count)
    if store.engine.dialect.driver == "psycopg":
        assert inserts == []  # one COPY, outside SQLAlchemy's statements
    else:
        assert sum(rows for _, rows in inserts) == 38
        assert len(inserts) == math.ceil(38 / 7) and all(many for many, _ in inserts[:-1])
    assert store.fingerprints(run_id) == {"algorithm": ALGORITHM, "source": source, "target": target}


def test_a_row_the_database_refuses_is_a_database_error_and_changes_nothing(store, tmp_path, monkeypatch):
    run_id = _start(store, tmp_path)
    kept = _digests(3)
    store.record_fingerprints(run_id, ALGORITHM, kept, kept)
    rows = fingerprint_rows._rows

    def one_bad_row(*arguments):
        yield from rows(*arguments)
        yield run_id, "middle", "w", "ab", ALGORITHM  # no such side: the CHECK constraint refuses it

    monkeypatch.setattr(fingerprint_rows, "_rows", one_bad_row)
    with pytest.raises(IntegrityError, match="ck_run_fingerprints_side"):  # SQLAlchemy's, COPY's included
        store.record_fingerprints(run_id, ALGORITHM, _digests(9, salt=1), None)
    assert store.fingerprints(run_id) == {"algorithm": ALGORITHM, "source": kept, "target": kept}


def test_more_parameters_than_one_batch(store, tmp_path):
    run_id = _start(store, tmp_path)
    source = _digests(fingerprint_rows.BATCH_ROWS + 1234)
    store.record_fingerprints(run_id, ALGORITHM, source, source)
    recorded = store.fingerprints(run_id)
    assert recorded["source"] == source and recorded["target"] == source


@pytest.mark.parametrize("source, target, message", [
    ({"layer.w": "not-hex"}, None, r"source fingerprint of parameter 'layer.w' is 'not-hex', not a hex digest"),
    ({"w": "ab"}, {"layer.b": "f" * 65}, r"target fingerprint of parameter 'layer.b' is 'f{65}'"),
    ({"w": "ab"}, {"": "ab"}, r"target fingerprints: parameter name '' is not a non-empty string"),
    ({7: "ab"}, None, r"source fingerprints: parameter name '7' is not a non-empty string"),
    (["w"], None, r"source fingerprints are a list, not a mapping"),
])
def test_malformed_fingerprints_are_one_line_and_change_nothing(store, tmp_path, source, target, message):
    run_id = _start(store, tmp_path)
    kept = _digests(3)
    store.record_fingerprints(run_id, ALGORITHM, kept, kept)
    with pytest.raises(LineageError, match=message) as refused:
        store.record_fingerprints(run_id, ALGORITHM, source, target)
    assert "\n" not in str(refused.value)
    assert store.fingerprints(run_id) == {"algorithm": ALGORITHM, "source": kept, "target": kept}


def test_a_bad_algorithm_name_is_refused(store, tmp_path):
    run_id = _start(store, tmp_path)
    with pytest.raises(LineageError, match="fingerprint algorithm 'x{33}' is not a name of 1 to 32 characters"):
        store.record_fingerprints(run_id, "x" * 33, {"w": "ab"}, None)
    assert _rows_of(store, run_id) == 0


def test_unknown_and_finished_runs_are_refused(store, tmp_path, make_plan):
    with pytest.raises(UnknownRunError):
        store.record_fingerprints("00000000-0000-0000-0000-000000000000", ALGORITHM, {"w": "ab"}, None)
    with pytest.raises(UnknownRunError):
        store.fingerprints("00000000-0000-0000-0000-000000000000")
    run_id = _start(store, tmp_path)
    store.complete_run(run_id, outputs=[], plan=make_plan(8, 4))
    with pytest.raises(RunStateError, match=f"cannot record fingerprints for run {run_id}: it is already completed"):
        store.record_fingerprints(run_id, ALGORITHM, {"w": "ab"}, None)


def test_a_run_without_fingerprints_reads_as_none_recorded(store, tmp_path):
    run_id = _start(store, tmp_path)
    assert store.fingerprints(run_id) == {"algorithm": None, "source": {}, "target": {}}


def test_deleting_a_run_deletes_its_fingerprints(store, tmp_path):
    run_id, kept = _start(store, tmp_path), _start(store, tmp_path)
    for run in (run_id, kept):
        store.record_fingerprints(run, ALGORITHM, _digests(4), _digests(4))
    with store._writer.begin() as session:
        session.execute(delete(Run).where(Run.id == run_id))
    assert _rows_of(store, run_id) == 0 and _rows_of(store, kept) == 8
