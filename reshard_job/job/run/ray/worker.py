"""What runs inside a Ray worker: one target rank (or one node task), and tidying up after killed attempts.

Workers hold no state of the job: they run ``execute.run_rank_task``, report progress to the
board, and hand back the ``RankResult`` with a small report of where and when it ran.

- **Retries only where a retry can help.** Ray re-runs a task whose worker process or node died
  (``max_retries``). A transient failure (remote storage resetting the connection or timing
  out, or an error marked ``transient``) is retried as often, with back-off, inside the worker:
  Ray's own ``retry_exceptions`` would print the worker's traceback on the driver at every
  retry. Anything else fails at once: a corrupt source reads the same on every attempt.
- **A killed attempt leaves no file behind.** Outputs are written under a temporary name and
  renamed into place, so a killed worker never leaves a partial file under the final name; the
  next attempt of the same rank removes the temporary files earlier attempts left for that
  output (on the node that writes it, which matters for ``output.placement=per_node``).
"""

from __future__ import annotations

import os
import re
import socket
import time
import traceback
import uuid
from dataclasses import replace
from typing import Any, Callable

from reshard_job.errors import ReshardError
from reshard_job.execute.tasks import RankResult, RankTask
from reshard_job.job.config.ray_address import clip
from reshard_job.job.run.ray.errors import (MESSAGE_LIMIT, TRANSIENT_ERRORS, NodeTaskError, RankTaskError,
                                            TransientRankTaskError, first_line)
from reshard_job.job.run.ray.progress import ProgressReporter, tell
from reshard_job.job.run.throughput import TaskReport

TRANSIENT_BACKOFF = 1.0  # seconds before the first retry of a transient failure, doubling after
TRANSIENT_BACKOFF_LIMIT = 30.0
_BUILT_IN_RESOURCES = {"CPU", "GPU", "memory", "object_store_memory"}

Runner = Callable[..., RankResult]  # runner(task, progress=callable) -> RankResult


def run_on_worker(task: RankTask, key: int, board, runner: Runner | None,
                  transient_retries: int) -> tuple[RankResult, TaskReport]:
    """One target rank inside a Ray worker, retrying transient failures here.

    Retrying them here rather than through Ray's ``retry_exceptions`` keeps the driver's output
    clean: Ray prints the worker's traceback on the driver for every retry it makes.
    """
    node_id, address, host, resource, where = _here()
    task = with_node_identities(task)
    for tries in range(1, transient_retries + 2):
        attempt = uuid.uuid4().hex[:12]
        tell(board.started, key, attempt, where)
        reporter = ProgressReporter(board, key, attempt)
        started, cpu_started = time.time(), time.process_time()
        try:
            result = _attempt(task, runner, reporter)
        except TransientRankTaskError as e:
            if tries > transient_retries:
                raise TransientRankTaskError(task.target_rank, where, e.cause, attempts=tries,
                                             details=e.details) from None
            time.sleep(min(TRANSIENT_BACKOFF_LIMIT, TRANSIENT_BACKOFF * 2 ** (tries - 1)))
            continue
        except RankTaskError as e:
            raise RankTaskError(task.target_rank, where, e.cause, attempts=tries, details=e.details) from None
        reporter.flush()
        report = TaskReport(task.target_rank, node_id, address, host, os.getpid(), resource, attempt, started,
                            time.time() - started, result.size, result.bytes_read, reporter.total, _peak_rss(),
                            time.process_time() - cpu_started, _identity_of(result.path))
        if not result.host:
            result = replace(result, host=host)
        return result, report
    raise AssertionError("unreachable")


def run_on_node(function: Callable[..., Any], args: tuple) -> Any:
    """A node task inside a Ray worker: any failure becomes one line saying where it happened."""
    where = _here()[4]
    try:
        return function(*args)
    except ReshardError as e:
        raise NodeTaskError(f"{where}: {first_line(e)}") from None
    except Exception as e:
        raise NodeTaskError(f"{where}: {type(e).__name__}: {first_line(e)}") from None


def _attempt(task: RankTask, runner: Runner | None, reporter) -> RankResult:
    """Run the task once; every failure becomes a (transient or final) RankTaskError."""
    from reshard_job.execute.rank_task import run_rank_task

    def fail(cls, text: str):
        return cls(task.target_rank, "", clip(text, MESSAGE_LIMIT), details=traceback.format_exc())

    try:
        remove_leftovers_of(task.out_path)
        return (runner or run_rank_task)(task, progress=reporter)
    except ReshardError as e:
        raise fail(TransientRankTaskError if getattr(e, "transient", False) else RankTaskError, str(e)) from None
    except TRANSIENT_ERRORS as e:
        raise fail(TransientRankTaskError, f"{type(e).__name__}: {e}") from None
    except Exception as e:
        raise fail(RankTaskError, f"{type(e).__name__}: {e}") from None


def _here() -> tuple[str, str, str, str | None, str]:
    """(node id, address, host, placement resource held, a description for messages) of this worker."""
    import ray

    ctx = ray.get_runtime_context()
    resource = next((k for k in sorted(ctx.get_assigned_resources()) if k not in _BUILT_IN_RESOURCES
                     and not k.startswith("node:")), None)
    node_id = ctx.get_node_id()
    address = ray.util.get_node_ip_address()
    host = socket.gethostname()
    where = f"Ray node {address} (host {host}, node {node_id[:8]}{', ' + resource if resource else ''})"
    return node_id, address, host, resource, where


def with_node_identities(task: RankTask) -> RankTask:
    """The task with the identities of its source files as this node sees them.

    A file's identity includes the device number, which differs between machines mounting one
    shared file system; inode, size and times do not. A source whose identity matches in all
    but the device is the file the driver hashed, seen through this node's mount; any other
    difference is kept, so a file that really changed still fails the task.
    """
    from reshard_job.storage import is_url
    from reshard_job.storage.local import identity_of

    localised = {}
    for rank, want in task.source_identities.items():
        path = task.sources.get(rank)
        mine = None
        if path is not None and not is_url(path) and len(want) == 5:
            try:
                mine = identity_of(os.stat(path))
            except OSError:
                mine = None
        same_file = mine is not None and tuple(mine[1:]) == tuple(want[1:])
        localised[rank] = tuple(mine) if same_file else want
    if localised == task.source_identities:
        return task
    return replace(task, source_identities=localised)


def _identity_of(path: str) -> tuple:
    """The written file's identity as this node sees it (for verifying it on this node later)."""
    from reshard_job.storage import is_url
    from reshard_job.storage.local import identity_of

    if is_url(path):
        return ()
    try:
        return tuple(identity_of(os.stat(path)))
    except OSError:
        return ()


def _peak_rss() -> int:
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    except (ImportError, OSError):
        return 0


def remove_leftovers(*out_paths: str) -> int:
    """``remove_leftovers_of`` for several outputs (a node task after a stopped run)."""
    return sum(remove_leftovers_of(path) for path in out_paths)


def remove_leftovers_of(out_path: str) -> int:
    """Remove temporary files that killed attempts left for this very output (local paths only;
    object stores publish uploads atomically and leave nothing visible).

    Only the exact names ``storage.atomic`` gives this output's temporary files, never another
    output's (its attempt may be running), and never through a symbolic link.
    """
    from reshard_job.storage import StorageError, is_url, storage_for
    from reshard_job.storage.atomic import TMP_SUFFIX

    if is_url(out_path):
        return 0
    folder, name = os.path.split(os.path.abspath(out_path))
    # the exact names storage.atomic gives this output's temporary files: ".<name>.<12 hex>.tmp"
    pattern = re.compile(r"\." + re.escape(name) + r"\.[0-9a-f]{12}" + re.escape(TMP_SUFFIX))
    storage = storage_for(folder)
    try:
        entries = storage.listdir(folder)
    except (OSError, StorageError):
        return 0
    removed = 0
    for entry in entries:
        if pattern.fullmatch(entry.name) and entry.is_file and not os.path.islink(entry.path):
            try:
                if storage.remove(entry.path):
                    removed += 1
            except (OSError, StorageError):
                pass
    return removed
