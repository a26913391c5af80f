"""A sweep's jobs starting together against one database: no lock errors, nothing lost.

Real processes (spawn, as a launcher would start them), released at the same instant by a
barrier, each doing what a job does: ensure_schema, start_run, record_inputs, complete_run.
They share the same eight source files, so they also race to insert the same artifacts. The
database is fresh, or holds a run recorded under the first schema revision, so the jobs also
race to migrate it (on SQLite that rebuilds the runs table, which must not lose a row; PostgreSQL
alters the table in place, and its upgrade from the first revision is tested in the migrations).
"""

from __future__ import annotations

import multiprocessing
import traceback
from pathlib import Path

from sqlalchemy import func, select

from alembic import command

from reshard_job.audit.queries import run_details
from reshard_job.lineage import FileRecord, LineageStore
from reshard_job.lineage.database import writer
from reshard_job.lineage.migrate import alembic_config, current_revision, head_revision
from reshard_job.lineage.models import Artifact, ArtifactLocation, Run

JOBS = 4


def _job(url: str, root: str, job_num: int, barrier, results) -> None:
    try:
        store = LineageStore(url)
        sources = [FileRecord.from_file(str(Path(root) / "src" / f"rank_{r}.ckpt"), "source_checkpoint", r)
                   for r in range(8)]
        out = Path(root) / f"out_{job_num}"
        out.mkdir()
        outputs = []
        for r in range(2):
            path = out / f"checkpoint_{r}.ckpt"
            path.write_bytes(f"job {job_num} rank {r}".encode())
            outputs.append(FileRecord.from_file(str(path), "target_checkpoint", r))
        barrier.wait(timeout=60)
        store.ensure_schema()
        store.mark_abandoned_runs()
        run_id = store.start_run(config={"job": job_num}, overrides=[f"target.devices={job_num}"],
                                 tool_version="0.1.0", output_dir=str(out), source_devices=8, target_devices=2,
                                 sweep_id="sweep", job_num=job_num)
        store.record_inputs(run_id, sources)
        store.complete_run(run_id, outputs=outputs,
                           plan={"ranks": [{"target_rank": r, "source_ranks": list(range(4 * r, 4 * r + 4)),
                                            "bytes_read": 1} for r in range(2)]})
        store.close()
        results.put(("ok", run_id))
    except BaseException:
        results.put(("error", traceback.format_exc()))


def _write_sources(root: Path) -> None:
    (root / "src").mkdir(parents=True)
    for r in range(8):
        (root / "src" / f"rank_{r}.ckpt").write_bytes(f"shared source {r}".encode() * 32)


def _run_jobs(url: str, root: Path) -> list[str]:
    if not (root / "src").exists():
        _write_sources(root)
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(JOBS)
    results = context.Queue()
    processes = [context.Process(target=_job, args=(url, str(root), n, barrier, results)) for n in range(JOBS)]
    for process in processes:
        process.start()
    outcomes = [results.get(timeout=120) for _ in processes]
    for process in processes:
        process.join(timeout=60)
    errors = [detail for status, detail in outcomes if status != "ok"]
    assert not errors, "\n".join(errors)
    return [detail for _, detail in outcomes]


def _check(url: str, run_ids: list[str], earlier: dict | None = None) -> None:
    with LineageStore(url) as store, store.read_session() as session:
        statuses = dict(session.execute(select(Run.id, Run.status)).all())
        expected = {run_id: "completed" for run_id in run_ids}
        if earlier is not None:
            expected[earlier["id"]] = "completed"
        assert statuses == expected
        # 8 shared sources recorded once each, plus 2 distinct outputs per job (and the earlier run's).
        artifacts = 8 + 2 * JOBS + (0 if earlier is None else 1)
        assert session.scalar(select(func.count()).select_from(Artifact)) == artifacts
        assert session.scalar(select(func.count()).select_from(ArtifactLocation)) == artifacts
        for run_id in run_ids:
            run = run_details(session, run_id).to_json()
            assert len(run["inputs"]) == 8 and len(run["outputs"]) == 2 and len(run["rank_map"]) == 2
        if earlier is not None:
            # every row of it survived the migration
            assert run_details(session, earlier["id"]).to_json() == earlier
        assert current_revision(session.connection()) == head_revision()


def _database_at_first_revision_with_a_run(url: str, root: Path) -> dict:
    """A database as the first release left it: schema revision 0001, one completed run (recorded at
    the head, whose models the store writes, then migrated down with its rows)."""
    root.mkdir(parents=True)
    (root / "old_output.ckpt").write_bytes(b"written before the upgrade")
    with LineageStore(url) as store:
        store.ensure_schema()
        run_id = store.start_run(config={}, overrides=[], tool_version="0.0.9", output_dir=str(root),
                                 source_devices=8, target_devices=2)
        store.record_inputs(run_id, [
            FileRecord.from_file(str(root.parent / "src" / f"rank_{r}.ckpt"), "source_checkpoint", r)
            for r in range(8)])
        output = FileRecord.from_file(str(root / "old_output.ckpt"), "target_checkpoint", 0)
        store.complete_run(run_id, outputs=[output],
                           plan={"ranks": [{"target_rank": 0, "source_ranks": list(range(8)), "bytes_read": 8}]})
        with store.read_session() as session:
            details = run_details(session, run_id).to_json()
        with writer(store.engine).connect() as connection:
            command.downgrade(alembic_config(connection), "0001")
            connection.commit()
    return details


def test_concurrent_jobs_on_one_fresh_sqlite_file(tmp_path):
    url = f"sqlite:///{tmp_path / 'runs' / 'lineage.db'}"
    _check(url, _run_jobs(url, tmp_path / "files"))


def test_concurrent_jobs_on_one_fresh_postgres_database(postgres_url, tmp_path):
    _check(postgres_url, _run_jobs(postgres_url, tmp_path / "files"))


def test_concurrent_jobs_migrate_a_first_revision_sqlite_file_without_losing_rows(tmp_path):
    url = f"sqlite:///{tmp_path / 'runs' / 'lineage.db'}"
    _write_sources(tmp_path / "files")
    earlier = _database_at_first_revision_with_a_run(url, tmp_path / "files" / "old")
    _check(url, _run_jobs(url, tmp_path / "files"), earlier)
