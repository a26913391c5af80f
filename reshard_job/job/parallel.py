"""Converting target ranks in parallel worker processes, with progress reporting.

Each target rank is an independent task (its plan names the source boxes it needs), so ranks are
spread over a process pool; a process per worker sidesteps the GIL for the numpy and hashing work
and keeps each worker's memory bounded by its own buffers. Workers report bytes written through
a queue; the parent drives the progress display and appends each finished rank to the journal as
soon as it lands, so a crash loses at most the ranks in flight.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import sys
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable

from ..execute import SourceFiles, execute_rank
from ..formats.base import WrittenFile
from ..plan import RankPlan


@dataclass
class RankTask:
    rank_plan: RankPlan
    out_path: str


@dataclass
class WriteOptions:
    fmt: str
    max_memory: int
    crc: bool


_progress_queue = None


def _init_worker(q, parent_pid: int | None = None) -> None:
    global _progress_queue
    _progress_queue = q
    if parent_pid is not None:
        _die_with_parent(parent_pid)


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
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the job died before the signal was armed
        os._exit(1)


_PR_SET_PDEATHSIG = 1


def _report(n: int) -> None:
    if _progress_queue is not None:
        _progress_queue.put(n)


# The parent's open, indexed source readers. Forked workers inherit them (positioned reads on a
# shared descriptor are safe), so no source file is indexed more than once per job.
_shared_sources: SourceFiles | None = None


def _convert(task: RankTask, source_paths: dict[int, str], opts: WriteOptions) -> tuple[int, WrittenFile]:
    if _shared_sources is not None:
        written = execute_rank(task.rank_plan, _shared_sources, task.out_path, fmt=opts.fmt,
                               max_memory=opts.max_memory, crc=opts.crc, progress=_report)
        return task.rank_plan.target_rank, written
    needed = {r: source_paths[r] for r in task.rank_plan.source_ranks}
    with SourceFiles(needed, verify_crc=False) as sources:  # CRCs were checked while hashing
        written = execute_rank(task.rank_plan, sources, task.out_path, fmt=opts.fmt,
                               max_memory=opts.max_memory, crc=opts.crc, progress=_report)
    return task.rank_plan.target_rank, written


def run_tasks(tasks: list[RankTask], source_paths: dict[int, str], opts: WriteOptions, *, workers: int,
              on_bytes: Callable[[int], None], on_done: Callable[[int, WrittenFile], None],
              sources: SourceFiles | None = None) -> None:
    """Run every task; call on_done as each rank lands. The first failure stops the rest and is raised.

    `sources`, if given, are open readers of `source_paths` to reuse (in this process, and in
    forked workers).
    """
    global _shared_sources
    if not tasks:
        return
    if workers <= 1 or len(tasks) == 1:
        own = sources is None
        readers = SourceFiles(source_paths, verify_crc=False) if own else sources
        try:
            for t in tasks:
                written = execute_rank(t.rank_plan, readers, t.out_path, fmt=opts.fmt,
                                       max_memory=opts.max_memory, crc=opts.crc, progress=on_bytes)
                on_done(t.rank_plan.target_rank, written)
        finally:
            if own:
                readers.close()
        return
    forking = "fork" in mp.get_all_start_methods()
    ctx = mp.get_context("fork") if forking else mp.get_context()
    _shared_sources = sources if forking else None
    q = ctx.Queue()
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_init_worker,
                               initargs=(q, os.getpid()))
    pending = set()
    try:
        # largest ranks first, so one big rank does not finish alone at the end
        for t in sorted(tasks, key=lambda t: -t.rank_plan.bytes_written):
            pending.add(pool.submit(_convert, t, source_paths, opts))
        while pending:
            done, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            _drain(q, on_bytes)
            for fut in done:
                rank, written = fut.result()  # re-raises a worker's error here
                on_done(rank, written)
        _drain(q, on_bytes)
    except BaseException:
        for fut in pending:
            fut.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    finally:
        pool.shutdown(wait=True)
        q.close()
        _shared_sources = None


def _drain(q, on_bytes) -> None:
    while True:
        try:
            n = q.get_nowait()
        except queue.Empty:
            return
        except (OSError, ValueError, EOFError):
            return
        on_bytes(n)


def default_workers(n_tasks: int) -> int:
    return max(1, min(os.cpu_count() or 1, n_tasks))
