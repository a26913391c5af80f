"""Recording a conversion in the lineage database, in a background thread.

The run is opened (schema check, runs left "started" by killed processes marked abandoned, new run)
as the job starts, while the sources are indexed and planned, and before any output is written, so
a killed job leaves a run to mark abandoned. The plan and the inputs are recorded while ranks
convert; the outputs and the final status last, in one transaction. A refused, failed or interrupted
conversion is recorded as such, with its one-line reason and no outputs. Database failures (disk
full, locked, unreachable) become one ``LineageError`` line naming the database without its password.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from reshard_job import __version__
from reshard_job.errors import ReshardError
from reshard_job.secrets import mask_text, mask_url
from reshard_job.job.config.spec import JobSpec

log = logging.getLogger("reshard_job")

FAILURE_RECORD_SECONDS = 5.0  # how long a failed or refused job waits for a locked database to record it


class LineageRecorder:
    """The lineage side of one conversion; every call is queued on one background thread."""

    def __init__(self, spec: JobSpec):
        self.spec = spec
        self.url = spec.lineage.url
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lineage")
        self._opened: Future = self._pool.submit(self._open)
        self._pending: list[Future] = []

    # ------------------------------------------------------------------------------ opening
    def _open(self):
        from reshard_job.lineage import LineageError, LineageStore
        from reshard_job.storage.local_files import make_folder

        logging.getLogger("alembic").setLevel(logging.WARNING)  # migration chatter is not the job's news
        if self.url.startswith("sqlite:///"):
            db_dir = os.path.dirname(self.url[len("sqlite:///"):]) or "."
            try:
                make_folder(db_dir)
            except OSError as e:
                raise LineageError(f"lineage database {mask_url(self.url)}: cannot create {db_dir} ({e.strerror}); "
                                   "lineage.enabled=false runs without recording") from None
        store = LineageStore(self.url)
        try:
            store.ensure_schema()
            abandoned = store.mark_abandoned_runs()
            if abandoned:
                log.warning("lineage: marked %d run(s) left 'started' by killed processes as abandoned: %s",
                            len(abandoned), ", ".join(a[:8] for a in abandoned))
            ctx = self.spec.context
            run_id = store.start_run(config=recorded_config(self.spec),
                                     overrides=[mask_text(o) for o in ctx.overrides],
                                     tool_version=__version__, output_dir=mask_url(self.spec.output.dir),
                                     source_devices=None, target_devices=None, sweep_id=ctx.sweep_id,
                                     job_num=ctx.job_num)
        except BaseException:
            store.close()
            raise
        return store, run_id

    def _opened_store(self):
        try:
            return self._opened.result()
        except BaseException as e:
            raise self.translate(e) from None

    def ensure_open(self) -> str:
        """Wait until the run exists (before any output is written); raise the database's error if not."""
        return self._opened_store()[1]

    @property
    def run_id(self) -> str | None:
        """The run's id once opened; None if opening failed."""
        try:
            return self._opened.result()[1]
        except BaseException:
            return None

    # ------------------------------------------------------------------------------ recording
    def submit(self, call: Callable[..., None], *args) -> None:
        """Queue ``call(store, run_id, *args)`` behind the run's creation."""
        def task():
            store, run_id = self._opened_store()
            call(store, run_id, *args)

        self._pending.append(self._pool.submit(task))

    def record_plan(self, plan_json: Callable[[], dict]) -> None:
        self.submit(lambda store, run_id: store.record_plan(run_id, plan_json()))

    def record_inputs(self, files) -> None:
        self.submit(lambda store, run_id: store.record_inputs(run_id, files))

    def record_fingerprints(self, proof) -> None:
        """Queue the per-parameter fingerprints of the sources and outputs (``stages.proof.ProofResult``)."""
        self.submit(lambda store, run_id: store.record_fingerprints(run_id, proof.algorithm, proof.source,
                                                                     proof.target))

    def complete(self, outputs) -> str:
        """Wait for everything queued, then record the outputs and mark the run completed."""
        self._drain()
        store, run_id = self._opened_store()
        from reshard_job.job.run.signals import committing

        try:
            with committing():  # a Ctrl-C landing just as the run is marked completed must not say otherwise
                store.complete_run(run_id, outputs=outputs)
        except BaseException as e:
            raise self.translate(e) from None
        return run_id

    def fail(self, error: BaseException) -> None:
        """Mark the run failed (or interrupted) with the error's one line; never raises over it. A
        database another process holds locked is waited for ``FAILURE_RECORD_SECONDS`` at most: a
        refusal is told within seconds, not after the minute a conversion would wait to record."""
        from reshard_job.lineage import waiting

        timer = threading.Timer(FAILURE_RECORD_SECONDS, waiting.request_stop,
                                args=(f"{mask_url(self.url)} stayed locked by another process for "
                                      f"{FAILURE_RECORD_SECONDS:g} s",))
        timer.daemon = True
        timer.start()
        try:
            self._record_failure(error)
        finally:
            timer.cancel()

    def _record_failure(self, error: BaseException) -> None:
        for f in self._pending:
            f.cancel()
        try:
            store, run_id = self._opened.result()
        except BaseException as le:
            told = self.translate(le)
            if le is not error and str(told) != str(error):  # the job's own error line already says it
                log.error("could not record the run in the lineage database: %s", told)
            return
        reason = _error_text(error)
        try:
            interrupt = getattr(store, "interrupt_run", None)
            if getattr(error, "exit_code", 0) in (130, 143) and interrupt is not None:
                interrupt(run_id, reason)
            else:
                store.fail_run(run_id, reason)
        except BaseException as le:  # the original error matters more
            log.error("could not record the failure in the lineage database: %s", self.translate(le))

    def _drain(self) -> None:
        for f in self._pending:
            try:
                f.result()
            except BaseException as e:
                raise self.translate(e) from None
        self._pending.clear()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._opened.done() and self._opened.exception() is None:
            from reshard_job.job.run.signals import held

            with held():  # a signal inside SQLAlchemy's close would be logged with a traceback
                self._opened.result()[0].close()

    # ------------------------------------------------------------------------------ errors
    def translate(self, e: BaseException) -> BaseException:
        """A database failure as a one-line LineageError naming the database (no password); else `e`."""
        if isinstance(e, ReshardError):
            return e
        try:
            from sqlalchemy.exc import SQLAlchemyError
        except ImportError:
            return e
        if not isinstance(e, SQLAlchemyError):
            return e
        from reshard_job.lineage import LineageError

        cause = getattr(e, "orig", None) or e
        detail = next((ln.strip() for ln in str(cause).splitlines() if ln.strip()), type(cause).__name__)
        return LineageError(f"lineage database {mask_url(self.url)}: {mask_url(detail)} "
                            "(lineage.enabled=false runs without recording)")


class NoRecorder:
    """Lineage off (or plan mode): the same calls, recording nothing."""

    run_id = None

    def ensure_open(self) -> None:
        return None

    def record_plan(self, plan_json) -> None: ...

    def record_inputs(self, files) -> None: ...

    def record_fingerprints(self, proof) -> None: ...

    def complete(self, outputs) -> None:
        from reshard_job.job.run.signals import committing

        with committing():  # the manifest is written: that is the commit here
            return None

    def fail(self, error) -> None: ...

    def close(self) -> None: ...


def recorded_config(spec: JobSpec) -> dict:
    """The config as recorded: where an object store was reached at an endpoint the environment named
    (``AWS_ENDPOINT_URL``), that endpoint too (``storage.endpoint_from: environment``), so that
    ``audit verify`` finds the outputs again from anywhere. Credentials are never part of it."""
    from reshard_job.storage import is_url
    from reshard_job.storage.s3errors import strip_userinfo

    config = spec.config
    places = (spec.source.checkpoints, spec.source.strategy, spec.target.strategy, spec.output.dir)
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if spec.storage.endpoint_url or not endpoint or not isinstance(config, dict) \
            or not any(p and is_url(str(p)) for p in places):
        return config
    storage = dict(config.get("storage") or {})
    storage.update(endpoint_url=strip_userinfo(endpoint.strip()), endpoint_from="environment")
    return {**config, "storage": storage}


def _error_text(e: BaseException) -> str:
    if isinstance(e, KeyboardInterrupt):
        return "interrupted"
    return mask_url(str(e) or type(e).__name__)
