"""The lineage store: the calls a job makes to record what it read, wrote and why.

A job's life in the store::

    store = LineageStore(url)                    # engine only, no I/O yet
    store.ensure_schema()                        # migrate to head (safe with many jobs at once)
    store.mark_abandoned_runs()                  # runs left "started" by killed processes here
    run_id = store.start_run(config=..., ...)    # status "started"
    store.record_inputs(run_id, [FileRecord...])
    store.record_fingerprints(run_id, algorithm, source={...}, target={...})   # per parameter
    store.record_load_shares(run_id, shares)     # a load: what each parameter's share held
    store.complete_run(run_id, outputs=[...], plan=plan)   # or fail_run(run_id, error),
                                                           # or interrupt_run(run_id, "SIGTERM")

Every call is one short transaction, retried on transient contention (see ``database``), so a
sweep's jobs interleave their writes instead of holding the database for a whole conversion.
``complete_run`` writes outputs, plan, rank map and the final status in a single transaction:
a run is either completed with all its outputs or has none, and a failed or interrupted run's
partial files are never recorded as outputs because ``fail_run`` and ``interrupt_run`` record
no files at all.

Artifacts are upserted by content with ``INSERT ... ON CONFLICT DO NOTHING`` (SQLite and
PostgreSQL), in a fixed order, because concurrent sweep jobs typically record the very same
source files at the very same moment.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import uuid
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar

from sqlalchemy import Table, select, update
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError
from sqlalchemy.orm import Session, defer, sessionmaker

from reshard_job.jsonchunks import iter_json
from reshard_job.lineage.database import (check_sqlite_file, create_lineage_engine, default_url, normalize_url,
                                          retry_transient, sqlite_file, writer)
from reshard_job.lineage.hash_names import HASH_ALGO
from reshard_job.lineage.errors import LineageError, RunStateError, SchemaError, UnknownRunError
from reshard_job.lineage.fingerprint_rows import read_fingerprints, replace_fingerprints
from reshard_job.lineage.load_shares import replace_shares
from reshard_job.lineage.migrate import upgrade_to_head
from reshard_job.lineage.models import Artifact, ArtifactLocation, Event, Run, RunPlan, RunRank
from reshard_job.lineage.file_records import FileRecord
from reshard_job.lineage.runtime import current_host, current_pid, current_user, pid_is_alive
from reshard_job.lineage.status import RunStatus
from reshard_job.lineage.waiting import LockWait, LockWaitError, WaitStopped

_T = TypeVar("_T")
log = logging.getLogger("reshard_job")


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


class LineageStore:
    """Records runs, their input and output files, and their plans in a lineage database."""

    def __init__(self, url: str | None = None, *, read_only: bool = False):
        """`read_only`: for reading only (the audit): a database file nobody may write (a copy an
        auditor was given, a read-only mount) opens as it is, and nothing is ever written to it."""
        self.url = normalize_url(url or default_url())
        shown = self.url.render_as_string(hide_password=True)
        database_file = sqlite_file(self.url)
        if database_file is not None:  # a checkpoint given as the database, say: said in those words
            check_sqlite_file(database_file, shown,
                              "" if read_only else " (lineage.enabled=false runs without recording)")
        self._wait = LockWait(shown)  # all of this store's lock waits together
        self.engine = create_lineage_engine(self.url, read_only=read_only, wait=self._wait)
        self._reader = sessionmaker(self.engine, expire_on_commit=False)
        self._writer = sessionmaker(writer(self.engine), expire_on_commit=False)

    # -- lifecycle ---------------------------------------------------------------------------

    def ensure_schema(self) -> None:
        """Bring the database to the newest schema (Alembic head); safe with concurrent jobs."""
        upgrade_to_head(self.engine)

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> LineageStore:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LineageStore({self.url.render_as_string(hide_password=True)!r})"

    # -- recording ---------------------------------------------------------------------------

    def start_run(self, *, config: dict, overrides: list[str], tool_version: str,
                  output_dir: str, source_devices: int | None, target_devices: int | None,
                  sweep_id: str | None = None, job_num: int | None = None,
                  run_id: str | None = None) -> str:
        """Record a new run in status "started" for this process; return its id (a uuid4 string)."""
        run_id = run_id or str(uuid.uuid4())
        if len(run_id) > 36:
            raise LineageError(f"run id {run_id!r} is longer than 36 characters")
        values = dict(
            id=run_id, status=RunStatus.STARTED, started_at=utc_now(), ended_at=None,
            tool_version=str(tool_version), host=current_host(), pid=current_pid(), user=current_user(),
            overrides=[str(o) for o in overrides], config=_config_as_json(config),
            sweep_id=None if sweep_id is None else str(sweep_id), job_num=job_num,
            output_dir=str(output_dir), source_devices=source_devices, target_devices=target_devices,
            error=None,
        )

        def insert(session: Session) -> None:
            if session.get(Run, run_id) is not None:
                raise RunStateError(f"run {run_id} already exists in the lineage database")
            session.add(Run(**values))

        try:
            self._write(insert)
        except IntegrityError:
            raise RunStateError(f"run {run_id} already exists in the lineage database") from None
        return run_id

    def record_inputs(self, run_id: str, files: list[FileRecord]) -> None:
        """Record the files a run reads (checkpoints, strategies). Recording again is harmless."""

        def record(session: Session) -> None:
            run = self._reportable_run(session, run_id, "record inputs for")
            run.status = RunStatus.STARTED
            self._record_files(session, run_id, "input", files)

        self._write(record)

    def record_plan(self, run_id: str, plan: dict) -> None:
        """Record the plan a run executes and its rank map (before or while it converts)."""
        rank_rows = _rank_map(plan)
        text = _plan_text(plan)

        def record(session: Session) -> None:
            run = self._reportable_run(session, run_id, "record the plan of")
            self._store_plan(session, run, text, rank_rows)

        self._write(record)

    def record_fingerprints(self, run_id: str, algorithm: str, source: dict[str, str],
                            target: dict[str, str] | None) -> None:
        """Record the per-parameter fingerprints of a run's sources and outputs (`target` None: the
        outputs were not read back), in one transaction; recording again replaces them."""
        def record(session: Session) -> None:
            self._reportable_run(session, run_id, "record fingerprints for")
            replace_fingerprints(session, run_id, algorithm, source, target)

        self._write(record)

    def record_load_shares(self, run_id: str, shares) -> int:
        """Record a load's fingerprint shares (``lineage.load_shares``) in one transaction, replacing
        any; return how many. `shares`: a list, or an iterable giving them in name order each time."""
        shares = list(shares) if iter(shares) is shares else shares  # a retry iterates them again

        def record(session: Session) -> int:
            self._reportable_run(session, run_id, "record load fingerprints for")
            return replace_shares(session, run_id, shares)

        return self._write(record)

    @staticmethod
    def _store_plan(session: Session, run: Run, plan: "JSONText", rank_rows: list[dict]) -> None:
        existing_plan = session.scalar(select(RunPlan).where(RunPlan.run_id == run.id)
                                       .options(defer(RunPlan.plan)))  # its old text is not needed
        if existing_plan is None:
            session.add(RunPlan(run_id=run.id, plan=plan))
        else:
            existing_plan.plan = plan
        plan = plan.value
        for row in session.scalars(select(RunRank).where(RunRank.run_id == run.id)):
            session.delete(row)
        session.flush()
        session.add_all(RunRank(run_id=run.id, **row) for row in rank_rows)
        run.source_devices = run.source_devices or _devices(plan, "source")
        run.target_devices = run.target_devices or _devices(plan, "target")

    def complete_run(self, run_id: str, *, outputs: list[FileRecord], plan: dict | None = None) -> None:
        """Record a run's outputs (and its plan and rank map, unless recorded already with
        ``record_plan``) and mark it completed — all at once."""
        rank_rows = None if plan is None else _rank_map(plan)
        plan = None if plan is None else _plan_text(plan)

        def complete(session: Session) -> None:
            run = self._reportable_run(session, run_id, "complete")
            self._record_files(session, run_id, "output", outputs)
            if plan is not None:
                self._store_plan(session, run, plan, rank_rows)
            elif session.scalar(select(RunPlan.run_id).where(RunPlan.run_id == run_id)) is None:
                # (asked by key alone: loading the row would parse a plan of millions of entries)
                raise LineageError(f"run {run_id} has no plan: pass plan= or call record_plan first")
            run.status = RunStatus.COMPLETED
            run.error = None
            run.ended_at = utc_now()

        self._write(complete)

    def fail_run(self, run_id: str, error: str) -> None:
        """Mark a run failed with its error. Its files, complete or not, are not recorded."""
        self._end_run(run_id, RunStatus.FAILED, error)

    def interrupt_run(self, run_id: str, reason: str) -> None:
        """Mark a run interrupted: its job was stopped by a signal (SIGINT, SIGTERM), `reason`
        says which. Like ``fail_run``, no files are recorded; running the same job again resumes
        from the output directory as a new run."""
        self._end_run(run_id, RunStatus.INTERRUPTED, reason)

    def _end_run(self, run_id: str, status: RunStatus, error: str) -> None:
        """Best effort where the database is locked: a job failing or being stopped must not wait for it."""
        def end(session: Session) -> None:
            run = session.get(Run, run_id)
            if run is None:
                raise UnknownRunError(run_id)
            if run.status == status:
                return  # reported twice (a second signal, a retry): the first word stays
            if not run.status.may_still_report:
                raise RunStateError(f"cannot mark run {run_id} {status}: it is already {run.status}")
            run.status = status
            run.error = str(error)
            run.ended_at = utc_now()

        try:
            self._write(end)
        except (LockWaitError, WaitStopped) as e:
            # The database stays locked by another process (or the job is being stopped while it waits):
            # the run stays "started", and the next job on this host marks it abandoned, its process gone.
            log.warning("lineage: run %s left 'started', not marked %s: %s", run_id, status, e)

    def mark_abandoned_runs(self) -> list[str]:
        """Mark "started" runs of this host whose process is gone as abandoned; return their ids."""
        host, me = current_host(), current_pid()

        def mark(session: Session) -> list[str]:
            candidates = session.execute(
                select(Run.id, Run.pid).where(Run.status == RunStatus.STARTED, Run.host == host)
                .order_by(Run.started_at)
            ).all()
            marked: list[str] = []
            now = utc_now()
            for run_id, pid in candidates:
                if pid == me or pid_is_alive(pid):
                    continue
                # Conditional on "started": the run may have reported since it was selected.
                result = session.execute(
                    update(Run)
                    .where(Run.id == run_id, Run.status == RunStatus.STARTED)
                    .values(status=RunStatus.ABANDONED, ended_at=now,
                            error=f"process {pid} on {host} ended without completing the run")
                )
                if result.rowcount:
                    marked.append(run_id)
            return marked

        return self._write(mark)

    # -- reading -----------------------------------------------------------------------------

    @contextmanager
    def read_session(self) -> Iterator[Session]:
        """A session for queries; it never writes and is rolled back at the end.

        The questions themselves are ``reshard_job.audit``'s (``audit.queries.run_details`` and
        the rest): the store records, the read side asks, and the write side never imports it."""
        session = self._reader()
        try:
            yield session
        finally:
            session.rollback()
            session.close()

    def fingerprints(self, run_id: str) -> dict[str, Any]:
        """``{"algorithm", "source": {name: hex}, "target": {name: hex}}`` as recorded for the run
        (``algorithm`` None and both empty when none were: a run recorded before fingerprints were)."""
        with self.read_session() as session:
            if session.get(Run, run_id) is None:
                raise UnknownRunError(run_id)
            return read_fingerprints(session, run_id)

    # -- internals ---------------------------------------------------------------------------

    def _write(self, operation: Callable[[Session], _T]) -> _T:
        def attempt() -> _T:
            with self._writer.begin() as session:
                return operation(session)

        try:
            return retry_transient(attempt, wait=self._wait)
        except (OperationalError, ProgrammingError) as exc:
            if _is_missing_table(exc):
                raise SchemaError(f"{self.url.render_as_string(hide_password=True)} has no lineage "
                                  f"schema; call ensure_schema() first") from None
            raise

    @staticmethod
    def _reportable_run(session: Session, run_id: str, action: str) -> Run:
        run = session.get(Run, run_id)
        if run is None:
            raise UnknownRunError(run_id)
        if not run.status.may_still_report:
            raise RunStateError(f"cannot {action} run {run_id}: it is already {run.status}")
        return run

    def _record_files(self, session: Session, run_id: str, direction: str, files: list[FileRecord]) -> None:
        now = utc_now()
        # A fixed order makes concurrent jobs that share files take row locks in the same
        # order (no deadlocks on PostgreSQL).
        for record in sorted(files, key=lambda f: (f.sha256.lower(), f.size, f.path)):
            artifact_id = _upsert_artifact(session, record, now)
            _upsert_location(session, artifact_id, record.path, now)
            event = session.scalar(select(Event).where(
                Event.run_id == run_id, Event.direction == direction, Event.path == record.path))
            if event is None:
                session.add(Event(run_id=run_id, artifact_id=artifact_id, direction=direction, role=record.kind,
                                  rank=record.rank, path=record.path, recorded_at=now, copied=record.copied))
            else:  # recorded again (a resumed job): the latest content at that path wins
                event.artifact_id, event.role, event.rank, event.recorded_at, event.copied = (
                    artifact_id, record.kind, record.rank, now, record.copied)
        session.flush()


def _upsert_artifact(session: Session, record: FileRecord, now: dt.datetime) -> int:
    identity = {"hash_algo": HASH_ALGO, "digest": record.sha256.lower(), "size": record.size}
    lookup = select(Artifact.id).filter_by(**identity)
    found = session.scalar(lookup)
    if found is not None:
        return found
    _insert_unless_present(session, Artifact.__table__,
                           {**identity, "kind": record.kind, "rank": record.rank, "first_recorded_at": now},
                           ["hash_algo", "digest", "size"])
    found = session.scalar(lookup)
    assert found is not None
    return found


def _upsert_location(session: Session, artifact_id: int, path: str, now: dt.datetime) -> None:
    values = {"artifact_id": artifact_id, "path": path, "first_seen": now, "last_seen": now}
    dialect = session.get_bind().dialect.name
    table = ArtifactLocation.__table__
    if dialect in ("sqlite", "postgresql"):
        insert = _dialect_insert(dialect)(table).values(**values)
        session.execute(insert.on_conflict_do_update(index_elements=["artifact_id", "path"],
                                                     set_={"last_seen": insert.excluded.last_seen}))
        return
    location = session.scalar(select(ArtifactLocation).filter_by(artifact_id=artifact_id, path=path))
    if location is not None:
        location.last_seen = now
    else:
        _insert_unless_present(session, table, values, ["artifact_id", "path"])


def _insert_unless_present(session: Session, table: Table, values: dict[str, Any], key: list[str]) -> None:
    dialect = session.get_bind().dialect.name
    if dialect in ("sqlite", "postgresql"):
        session.execute(_dialect_insert(dialect)(table).values(**values).on_conflict_do_nothing(index_elements=key))
        return
    try:  # other backends: let the unique constraint arbitrate the race
        with session.begin_nested():
            session.execute(table.insert().values(**values))
    except IntegrityError:
        pass


def _dialect_insert(dialect: str):
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    return insert


def _as_json(value: Any, what: str) -> Any:
    """`value` itself, once checked to be plain JSON data; a clear error if it is not.

    No copy is made: a plan can be tens of megabytes of Python objects, and the caller does not
    change it after handing it over.
    """
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise LineageError(f"the run's {what} is not plain JSON data: {exc}") from None
    return value


class JSONText(str):
    """A value already serialized as JSON text (``value``: the value it is the text of): the
    lineage engine stores it as it is instead of serializing it again (``database.json_text``)."""

    value: Any

    def __new__(cls, text: str, value: Any) -> "JSONText":
        self = super().__new__(cls, text)
        self.value = value
        return self


def _plan_text(plan: Any) -> JSONText:
    """A plan as JSON text, made in pieces (a plan's tables may be written as they are iterated,
    see ``jsonchunks.LazyList``), checked to be plain JSON data on the way."""
    try:
        return JSONText("".join(iter_json(plan, allow_nan=False)), plan)
    except (TypeError, ValueError) as exc:
        raise LineageError(f"the run's plan is not plain JSON data: {exc}") from None


def _config_as_json(config: Any) -> Any:
    """The resolved config as JSON. Unlike the plan (our own plain data), a config may carry an
    OmegaConf container or values such as paths; recording them as text beats failing the job."""
    if type(config).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        config = OmegaConf.to_container(config, resolve=True)
    return _as_json(json.loads(json.dumps(config, default=str)), "config")


def _rank_map(plan: dict) -> list[dict[str, Any]]:
    rows = []
    for entry in plan.get("ranks") or []:
        try:
            rows.append({
                "target_rank": int(entry["target_rank"]),
                "source_ranks": [int(r) for r in entry.get("source_ranks", [])],
                "bytes_read": entry.get("bytes_read"),
                "bytes_written": entry.get("bytes_written"),
            })
        except (KeyError, TypeError, ValueError):
            raise LineageError(f"plan rank entry has no valid target_rank: {str(entry)[:200]}") from None
    targets = [row["target_rank"] for row in rows]
    if len(set(targets)) != len(targets):
        raise LineageError("plan lists a target rank more than once")
    return rows


def _devices(plan: dict, side: str) -> int | None:
    section = plan.get(side)
    devices = section.get("devices") if isinstance(section, dict) else None
    return devices if isinstance(devices, int) else None


def _is_missing_table(exc: Exception) -> bool:
    message = str(getattr(exc, "orig", exc)).lower()
    return "no such table" in message or ("relation" in message and "does not exist" in message)
