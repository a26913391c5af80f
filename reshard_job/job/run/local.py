"""Running rank tasks: in this process, or spread over a pool of worker processes.

Each target rank is an independent ``RankTask``, so ranks are spread over a process pool; a process
per worker sidesteps the GIL for the numpy and hashing work and keeps each worker's memory bounded
by its own buffers. An executor calls ``on_done`` in the caller's thread as each rank lands, so the
job journals it at once and a crash loses at most the ranks in flight; ``on_bytes`` feeds one
progress bar. The same interface is implemented by the Ray executor for many machines.

Workers report bytes through a shared counter, not a queue: a worker never blocks on a pipe that
nobody reads, so stopping is always prompt. Workers ignore SIGINT (a Ctrl-C reaches the whole
process group; the job, not each worker, reacts to it) and die with the job, even by SIGKILL.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import signal
import sys
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, ThreadPoolExecutor, wait
from typing import Callable, Protocol, Sequence

from reshard_job.sources.open_files import SourceFiles

from reshard_job.execute.rank_task import run_rank_task
from reshard_job.execute.tasks import RankResult, RankTask

OnBytes = Callable[[int], None]
OnDone = Callable[[RankResult], None]
POLL_S = 0.2
# Finished files published together, at most this many bytes (a crash loses at most this much work
# besides the rank in flight), from at most PUBLISH_THREADS threads.
PUBLISH_BATCH = 4 * 1024 ** 3
PUBLISH_THREADS = 16
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


class Executor(Protocol):
    def run(self, tasks: Sequence[RankTask], *, on_bytes: OnBytes, on_done: OnDone) -> None:
        """Run every task; call on_done in the caller's thread as each result lands. The first task
        that fails for good stops the rest and is raised as a ReshardError naming the rank."""


WORKER_BYTES = 256 * 1024 ** 2  # a worker process pays for itself with at least this much to write


def default_workers(n_tasks: int, bytes_to_write: int | None = None) -> int:
    """One process per CPU, no more than there are target ranks, and no more than one per
    ``WORKER_BYTES`` to write: a small conversion (many small parameters included, where the work
    is per parameter and each worker would hold its own copy of what it touches) runs in one."""
    workers = max(1, min(os.cpu_count() or 1, n_tasks))
    if bytes_to_write is not None:
        workers = min(workers, max(1, -(-bytes_to_write // WORKER_BYTES)))
    return workers


# Workers per CPU that job.workers may start: past the CPUs, more processes only wait for them
# (a few per CPU overlap waits on slow storage), while each still holds its own memory (256
# workers for 256 small ranks on 2 CPUs summed 1.45 GB; no quicker than 8).
WORKERS_PER_CPU = 4


def useful_workers(asked: int, n_tasks: int) -> int:
    """The worker processes `asked` for (``job.workers``), no more than there are tasks and no more
    than ``WORKERS_PER_CPU`` per CPU of this machine."""
    return max(1, min(asked, n_tasks, WORKERS_PER_CPU * (os.cpu_count() or 1)))


class LocalExecutor:
    """Tasks in this process (one worker) or in a pool of forked worker processes.

    `sources`, if given, are open, indexed readers of the source files: this process and forked
    workers reuse them (positioned reads on a shared descriptor are safe), so no source file is
    indexed twice.
    """

    def __init__(self, workers: int = 1, sources: SourceFiles | None = None):
        self.workers = max(1, workers)
        self.sources = sources

    def run(self, tasks: Sequence[RankTask], *, on_bytes: OnBytes, on_done: OnDone) -> None:
        if not tasks:
            return
        if self.workers <= 1 or len(tasks) == 1:
            self._run_here(tasks, on_bytes, on_done)
            return
        _run_pool(tasks, min(self.workers, len(tasks)), self.sources, on_bytes, on_done)

    def _run_here(self, tasks: Sequence[RankTask], on_bytes: OnBytes, on_done: OnDone) -> None:
        """Ranks one after the other, published in batches: finished files wait (complete, hashed,
        under their temporary names) until PUBLISH_BATCH bytes or the last rank, then are made
        durable together — one device flush for the batch instead of one per file — and land in
        order. A failure or an interruption still publishes and lands what was finished."""
        batch: list[_Sealed] = []
        size = 0
        try:
            for t in tasks:
                result, handle = run_rank_task(t, sources=self._sources_for(t), progress=on_bytes,
                                               publish_later=True)
                size += _finished(batch, result, handle, on_done)
                if size >= PUBLISH_BATCH:
                    _publish(batch, on_done)
                    size = 0
            _publish(batch, on_done)
        finally:
            _land_what_is_finished(batch, on_done)

    def _sources_for(self, task: RankTask) -> SourceFiles | None:
        if self.sources is None:
            return None
        self.sources.identities.update(task.source_identities)
        return self.sources


class _Sealed:
    """A finished rank waiting in a batch: its result, its sealed file, and how publishing went
    (kept here, so publishing interrupted half-way and retried never publishes a file twice)."""

    __slots__ = ("result", "handle", "published", "error")

    def __init__(self, result: RankResult, handle):
        self.result, self.handle = result, handle
        self.published = False
        self.error: Exception | None = None

    def publish(self) -> None:
        if self.published or self.error is not None:
            return
        try:
            self.handle.publish()
            self.published = True
        except Exception as e:  # noqa: BLE001 (raised by _publish after the others landed)
            self.error = e


def _finished(batch: list, result: RankResult, handle, on_done: OnDone) -> int:
    """A rank is written: a sealed file joins the batch (its bytes are returned); one already
    published (handle None: an object-store upload, another format's writer) lands at once."""
    if handle is None:
        on_done(result)
        return 0
    batch.append(_Sealed(result, handle))
    return result.size


def _land_what_is_finished(batch: list, on_done: OnDone) -> None:
    """Unwinding (an error, an interruption): publish and journal the finished files, so a rerun
    resumes after them; if that fails too, drop what was not published (the rerun redoes it)."""
    if not batch:
        return
    try:
        _publish(batch, on_done)
    except Exception:  # noqa: BLE001 (the error being unwound is the one to report)
        for entry in batch:
            if not entry.published:
                entry.handle.abort()
        batch.clear()


def _publish(batch: list, on_done: OnDone) -> None:
    """Publish the batch's files from as many threads (their fsyncs share the device flushes), then
    land them in order; emptied as they land. The first failure is raised after the others landed."""
    todo = [e for e in batch if not e.published and e.error is None]
    if len(todo) > 1:
        with ThreadPoolExecutor(max_workers=min(PUBLISH_THREADS, len(todo)), thread_name_prefix="publish") as ex:
            list(ex.map(_Sealed.publish, todo))
    else:
        for e in todo:
            e.publish()
    first = None
    while batch:
        entry = batch[0]
        if entry.error is not None:  # publish aborted it: its temporary file is gone
            first = first or entry.error
        else:
            on_done(entry.result)
        batch.pop(0)
    if first is not None:
        raise first


# ------------------------------------------------------------------------------- worker side
_counter = None  # shared byte counter (multiprocessing.Value)
_shared_sources: SourceFiles | None = None  # the parent's readers, inherited by fork
_shared_tasks: list[RankTask] | None = None  # the tasks, inherited by fork instead of pickled to each worker


def _init_worker(counter, parent_pid: int) -> None:
    """A forked worker starts with the job's handlers, which would raise the job's ``Interrupted``
    here (multiprocessing prints it as a traceback): it is forked with SIGINT and SIGTERM blocked,
    and unblocks them once its own handlers are in place."""
    global _counter
    _counter = counter
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    _die_with_parent(parent_pid)


@contextlib.contextmanager
def _signals_blocked():
    """SIGINT and SIGTERM held back from this thread (a process forked meanwhile starts so); one that
    came meanwhile is delivered when the block ends."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _die_with_parent(parent_pid: int) -> None:
    """Make a worker end when the job process ends, even by SIGKILL.

    An orphaned worker would finish its rank unjournaled and then wait forever for work, holding
    the output directory's lock (inherited across fork), so the rerun meant to resume the job
    would be refused until someone found and killed it. Linux only (prctl); elsewhere a no-op.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the job died before the signal was armed
        os._exit(1)


def _report(n: int) -> None:
    with _counter.get_lock():
        _counter.value += n


def _run_shared_task(i: int):
    """``_run_in_worker`` of the parent's task `i` (a plan of a million parameters is not pickled)."""
    return _run_in_worker(_shared_tasks[i])


def _run_in_worker(task: RankTask):
    """(RankResult, SealedFile or None): the parent publishes the file, in a batch with others."""
    sources = _shared_sources
    if sources is not None:
        sources.identities.update(task.source_identities)
    return run_rank_task(task, sources=sources, progress=_report, publish_later=True)


# ------------------------------------------------------------------------------- parent side
def _run_pool(tasks, workers: int, sources, on_bytes: OnBytes, on_done: OnDone) -> None:
    global _shared_sources, _shared_tasks
    forking = "fork" in mp.get_all_start_methods()
    ctx = mp.get_context("fork") if forking else mp.get_context()
    _shared_sources = sources if forking else None
    _shared_tasks = list(tasks) if forking else None
    counter = ctx.Value("q", 0)
    seen = 0
    if forking:
        # The workers share this process's objects (indexes, plan) copy-on-write; a garbage
        # collection in a worker would touch every one of them and copy their pages. Frozen, the
        # collector leaves them alone (the job's many-parameter indexes are hundreds of MB).
        gc.freeze()
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_init_worker,
                               initargs=(counter, os.getpid()))
    pending = set()
    batch: list = []  # finished in workers, published here together (see LocalExecutor._run_here)
    size = 0
    try:
        try:
            # largest ranks first, so one big rank does not finish alone at the end
            with _signals_blocked():  # the workers are forked here: see _init_worker
                for i in sorted(range(len(tasks)), key=lambda i: -tasks[i].plan.bytes_written):
                    pending.add(pool.submit(_run_shared_task, i) if forking else
                                pool.submit(_run_in_worker, tasks[i]))
            while pending:
                done, pending = wait(pending, timeout=POLL_S, return_when=FIRST_COMPLETED)
                seen = _forward(counter, seen, on_bytes)
                for fut in done:
                    result, handle = fut.result()  # re-raises a worker's error here
                    size += _finished(batch, result, handle, on_done)
                if size >= PUBLISH_BATCH:
                    _publish(batch, on_done)
                    size = 0
            _forward(counter, seen, on_bytes)
            pool.shutdown(wait=True)
        except BaseException:
            _stop(pool, pending)
            raise
        finally:
            _shared_sources = _shared_tasks = None
            if forking:
                gc.unfreeze()
        _publish(batch, on_done)
    finally:
        _land_what_is_finished(batch, on_done)  # an error or interruption: the finished files land


def _forward(counter, seen: int, on_bytes: OnBytes) -> int:
    now = counter.value
    if now > seen:
        on_bytes(now - seen)
    return now


def _stop(pool: ProcessPoolExecutor, pending) -> None:
    """Stop at once: cancel what has not started, kill workers mid-task (their partial files are
    temporary files, removed by the job), never wait for a rank to finish."""
    for fut in pending:
        fut.cancel()
    processes = list((getattr(pool, "_processes", None) or {}).values())  # None once shut down
    for p in processes:
        try:
            p.kill()
        except (OSError, AttributeError):
            pass
    pool.shutdown(wait=False, cancel_futures=True)
    for p in processes:
        try:
            p.join(timeout=5)
        except (OSError, AssertionError, AttributeError):
            pass


# ------------------------------------------------------------------------------- other work
_shared_work = None  # the work of ``run_forked``, inherited by fork


def run_forked(work: Callable[[int, OnBytes], object], count: int, workers: int, on_bytes: OnBytes) -> list:
    """``work(i, report)`` for each i in range(count), in at most `workers` forked worker
    processes (set up as the rank tasks' are), results in order of i. `work` and what it reaches
    (open source readers, a plan) are inherited by fork, not pickled; `report(n)` counts bytes
    done, which reach `on_bytes` in this thread. Where processes cannot be forked, or one worker
    would do, the work runs here. The first failure stops the rest and is raised here."""
    global _shared_work
    if min(workers, count) <= 1 or "fork" not in mp.get_all_start_methods():
        return [work(i, on_bytes) for i in range(count)]
    ctx = mp.get_context("fork")
    counter = ctx.Value("q", 0)
    _shared_work = work
    gc.freeze()  # the workers share this process's objects copy-on-write (see _run_pool)
    pool = ProcessPoolExecutor(max_workers=min(workers, count), mp_context=ctx, initializer=_init_worker,
                               initargs=(counter, os.getpid()))
    pending: set = set()
    try:
        with _signals_blocked():  # the workers are forked here: see _init_worker
            futures = [pool.submit(_run_shared_work, i) for i in range(count)]
        pending = set(futures)
        seen = 0
        while pending:
            done, pending = wait(pending, timeout=POLL_S, return_when=FIRST_COMPLETED)
            seen = _forward(counter, seen, on_bytes)
            for fut in done:
                fut.result()  # re-raises a worker's error at once
        _forward(counter, seen, on_bytes)
        results = [fut.result() for fut in futures]
        pool.shutdown(wait=True)
        return results
    except BaseException:
        _stop(pool, pending)
        raise
    finally:
        _shared_work = None
        gc.unfreeze()


def _run_shared_work(i: int):
    return _shared_work(i, _report)
