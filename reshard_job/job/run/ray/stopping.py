"""Stopping the tasks still running once a run fails, and tidying up after the ones killed.

The first rank that fails for good cancels every other task: first politely, so they remove
their temporary files, then by force, tidying up after the killed ones on their nodes (the
output folder may be a node's own disk, with ``output.placement=per_node``).
"""

from __future__ import annotations

import logging
import time

from reshard_job.core.placement import UNITS_PER_TASK, Placement
from reshard_job.execute.tasks import RankTask
from reshard_job.job.run.ray.errors import first_line
from reshard_job.job.run.ray.worker import remove_leftovers, run_on_node

log = logging.getLogger(__name__)

CANCEL_GRACE = 10.0  # seconds cancelled tasks get to clean up before they are killed
KILL_WAIT = 5.0  # seconds to wait for killed tasks to be gone
LEFTOVER_CLEANUP_TIMEOUT = 15.0  # seconds a stopped run spends removing killed tasks' temporary files


def stop(ray, pending: set, cancel_grace: float) -> list:
    """Cancel every unfinished task: politely first (they remove their temporary files), then by
    force. Returns the refs that had to be killed (their temporary files may still be there)."""
    if not pending:
        return []
    for ref in pending:
        try:
            ray.cancel(ref, force=False)
        except Exception:
            pass
    deadline = time.monotonic() + cancel_grace
    left = list(pending)
    while left and time.monotonic() < deadline:
        try:
            _, left = ray.wait(left, num_returns=len(left), timeout=min(0.5, max(0.0, deadline - time.monotonic())))
        except Exception:
            break
    for ref in left:
        try:
            ray.cancel(ref, force=True)
        except Exception:
            pass
    if left:  # let the kills land before anyone tidies up after them
        try:
            ray.wait(left, num_returns=len(left), timeout=KILL_WAIT)
        except Exception:
            pass
    return left


def remove_leftovers_after_kill(ray, tasks: list[RankTask], placement: Placement) -> None:
    """Remove the temporary files of tasks that were killed rather than stopped politely.

    Ray's polite cancel is best effort (it can miss a task that is sleeping or between two
    steps), so a stopped run tidies up on the node that wrote each output: the output folder
    may be a node's own disk. Best effort, bounded in time: the run is already failing, and
    a resumed run removes such files too.
    """
    if not tasks:
        return
    by_resource: dict[str, list[str]] = {}
    for task in tasks:
        resource = placement(task.target_rank)
        if resource:
            by_resource.setdefault(resource, []).append(task.out_path)
        else:  # no placement: the output folder is shared, so it is visible here as well
            remove_leftovers(task.out_path)
    if not by_resource:
        return
    try:
        remote = ray.remote(run_on_node)
        refs = [remote.options(num_cpus=0, resources={res: float(UNITS_PER_TASK)}, max_retries=0,
                               retry_exceptions=False).remote(remove_leftovers, tuple(paths))
                for res, paths in by_resource.items()]
        ready, late = ray.wait(refs, num_returns=len(refs), timeout=LEFTOVER_CLEANUP_TIMEOUT)
        for ref in late:
            ray.cancel(ref, force=True)
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as e:
                log.warning("could not remove a stopped task's temporary files: %s", first_line(e))
    except Exception as e:
        log.warning("could not remove the stopped tasks' temporary files: %s", first_line(e))
