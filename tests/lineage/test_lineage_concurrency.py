"""A sweep's jobs starting together against one fresh database: no lock errors, nothing lost.

Real processes (spawn, as a launcher would start them), released at the same instant by a
barrier, each doing what a job does: ensure_schema, start_run, record_inputs, complete_run.
They share the same eight source files, so they also race to insert the same artifacts.
"""

from __future__ import annotations

import multiprocessing
import traceback
from pathlib import Path

from sqlalchemy import func, select

from reshard_job.lineage import FileRecord, LineageStore
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


def _run_jobs(url: str, root: Path) -> list[str]:
    (root / "src").mkdir(parents=True)
    for r in range(8):
        (root / "src" / f"rank_{r}.ckpt").write_bytes(f"shared source {r}".encode() * 32)
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


def _check(url: str, run_ids: list[str]) -> None:
    with LineageStore(url) as store, store.read_session() as session:
        statuses = dict(session.execute(select(Run.id, Run.status)).all())
        assert statuses == {run_id: "completed" for run_id in run_ids}
        # 8 shared sources recorded once each, plus 2 distinct outputs per job.
        assert session.scalar(select(func.count()).select_from(Artifact)) == 8 + 2 * JOBS
        assert session.scalar(select(func.count()).select_from(ArtifactLocation)) == 8 + 2 * JOBS
        for run_id in run_ids:
            run = store.get_run(run_id)
            assert len(run["inputs"]) == 8 and len(run["outputs"]) == 2 and len(run["rank_map"]) == 2


def test_concurrent_jobs_on_one_fresh_sqlite_file(tmp_path):
    url = f"sqlite:///{tmp_path / 'runs' / 'lineage.db'}"
    _check(url, _run_jobs(url, tmp_path / "files"))


def test_concurrent_jobs_on_one_fresh_postgres_database(postgres_url, tmp_path):
    _check(postgres_url, _run_jobs(postgres_url, tmp_path / "files"))
