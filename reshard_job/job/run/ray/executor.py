"""Running one conversion's rank tasks on a Ray cluster.

One Ray task per target rank: it opens only the source files its plan names, reads only the
boxes it needs, writes its target file atomically and returns the ``RankResult`` with a small
report of where and when it ran. The driver keeps everything that has state (the journal, the
lineage database, the progress display); workers only run ``execute.run_rank_task``.

Trade-offs chosen (each explained where its code lives):

- **Progress through a tiny actor, not a queue** (``ray.progress``).
- **Retries only where a retry can help**, and **a killed attempt leaves no file behind**
  (``ray.worker``).
- **Fail fast, stop the rest, never hang.** The first rank that fails for good cancels every
  other task (first politely, so they remove their temporary files, then by force, tidying up
  after the killed ones on their nodes: ``ray.stopping``) and is
  raised as one line naming the rank, the node and the cause (``ray.errors``). Tasks that no live
  node can run (a placement resource nobody offers, more CPUs than any node has) are refused
  before anything starts, and a node that leaves for good while its ranks wait fails the run
  (``ray.feasibility``).

Ray is optional (``pip install -e '.[ray]'``) and imported only when this executor is used
(``ray.connect``).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Sequence

from reshard_job.core.placement import UNITS_PER_TASK, Placement, as_placement
from reshard_job.errors import ConfigError
from reshard_job.execute.tasks import RankResult, RankTask
from reshard_job.job.config.ray_address import ADDRESS_AUTO, CLIENT_SCHEME, parse_address  # noqa: F401 (moved)
from reshard_job.job.run.ray import feasibility
from reshard_job.job.run.ray.connect import CONNECT_TIMEOUT, connect, import_ray  # noqa: F401 (moved)
from reshard_job.job.run.ray.errors import (MESSAGE_LIMIT, TRANSIENT_ERRORS, NodeTaskError,  # noqa: F401 (moved)
                                            RankTaskError, RayConnectionError, RayExecutorError,
                                            TransientRankTaskError, node_failure, rank_failure)
from reshard_job.job.run.ray.feasibility import FEASIBILITY_CHECK_INTERVAL, NODE_LOSS_GRACE, alive_nodes
from reshard_job.job.run.ray.progress import PROGRESS_INTERVAL, ProgressBoard, ProgressFeed  # noqa: F401 (moved)
from reshard_job.job.run.ray.stopping import CANCEL_GRACE, remove_leftovers_after_kill, stop
from reshard_job.job.run.ray.worker import Runner, run_on_node, run_on_worker
from reshard_job.job.run.throughput import NodeThroughput, TaskReport, per_node, render

__all__ = [  # this executor, and the names it held before they moved to their own rooms
    "ADDRESS_AUTO", "CLIENT_SCHEME", "CONNECT_TIMEOUT", "MESSAGE_LIMIT", "NodeTaskError", "PROGRESS_INTERVAL",
    "ProgressBoard", "RankTaskError", "RayConnectionError", "RayExecutor", "RayExecutorError", "TRANSIENT_ERRORS",
    "TransientRankTaskError", "import_ray", "memory_per_task", "parse_address",
]

POLL_INTERVAL = 0.2  # seconds the driver waits for results before showing progress
# A Ray worker with numpy and this package loaded, before any slice buffer (measured 70-80 MiB
# on CPython 3.11 / Ray 2.60), rounded up
WORKER_BASE_MEMORY = 96 * 1024 * 1024


def memory_per_task(max_memory: int) -> int:
    """Bytes of Ray's ``memory`` resource a task should reserve under ``job.max_memory``: the slice
    buffers it bounds, the output writer's two staging buffers, and the worker process itself
    (measured peak: about 120 MiB at the default 32 MiB)."""
    from reshard_job.storage.atomic import DIRECT_CHUNK

    return WORKER_BASE_MEMORY + int(max_memory) + 2 * DIRECT_CHUNK


class RayExecutor:
    """Runs rank tasks on a Ray cluster; the job's ``Executor`` for ``job.executor=ray``.

    `address`: ``auto`` (the cluster this machine belongs to), ``ray://host:10001`` (Ray Client,
    for a driver outside the cluster) or ``host:port`` (the head's GCS, for a driver on a node).
    `memory_per_task`: bytes of Ray's ``memory`` resource each task reserves (None: none).
    `max_retries`: re-runs of a task whose worker or node died, or that failed transiently.
    `placement`: target rank -> the custom resource of the node it must run on (a function or a
    mapping; None or a None value: anywhere), e.g. ``placement.per_node_placement(8)``.
    `runner`: what each task runs, ``run_rank_task`` unless a test substitutes a wrapper.
    """

    def __init__(self, address: str | None = ADDRESS_AUTO, *, num_cpus_per_task: float = 1,
                 memory_per_task: int | None = None, max_retries: int = 3,
                 placement: Placement | Mapping[int, str | None] | None = None,
                 runner: Runner | None = None, connect_timeout: float = CONNECT_TIMEOUT,
                 node_loss_grace: float = NODE_LOSS_GRACE, cancel_grace: float = CANCEL_GRACE):
        self.address = ADDRESS_AUTO if address is None else str(address).strip()
        parse_address(self.address)  # refuse a malformed address before anything else happens
        if not num_cpus_per_task > 0:
            raise ConfigError(f"num_cpus_per_task must be positive, got {num_cpus_per_task!r}")
        if memory_per_task is not None and memory_per_task <= 0:
            raise ConfigError(f"memory_per_task must be positive bytes, got {memory_per_task!r}")
        if not isinstance(max_retries, int) or max_retries < 0:
            raise ConfigError(f"max_retries must be a non-negative integer, got {max_retries!r}")
        self.num_cpus_per_task = num_cpus_per_task
        self.memory_per_task = memory_per_task
        self.max_retries = max_retries
        self.placement = as_placement(placement)
        self.runner = runner
        self.connect_timeout = connect_timeout
        self.node_loss_grace = node_loss_grace
        self.cancel_grace = cancel_grace
        self._ray = None
        self._owns_connection = False
        self._reports: list[TaskReport] = []

    # ------------------------------------------------------------------------------ connection
    def connect(self) -> None:
        """Join the cluster (once). A connection this process already has is reused when it is to
        the same cluster; the address is checked first either way, so a wrong one always fails."""
        if self._ray is not None:
            return
        self._ray, self._owns_connection = connect(self.address, self.connect_timeout)

    def close(self) -> None:
        """Leave the cluster if this executor joined it."""
        if self._ray is not None and self._owns_connection and self._ray.is_initialized():
            self._ray.shutdown()
        self._ray, self._owns_connection = None, False

    def detach(self) -> bool:
        """Forget the connection but stay connected (Ray disconnects when the process exits), so
        that a later executor in this process reuses it and the workers the cluster has started
        for it; True if this executor had joined the cluster itself."""
        joined = self._ray is not None and self._owns_connection
        self._ray, self._owns_connection = None, False
        return joined

    def __enter__(self) -> "RayExecutor":
        self.connect()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------ running
    def run(self, tasks: Sequence[RankTask], *, on_bytes: Callable[[int], None],
            on_done: Callable[[RankResult], None]) -> None:
        """Run every task; call on_done here as each result lands and on_bytes with bytes written.

        The first task that fails for good stops the others and is raised as ``RankTaskError``.
        """
        if not tasks:
            return
        self.connect()
        ray = self._ray
        # tasks are keyed by position: target ranks are unique within one conversion, but the
        # executor does not need to rely on it
        by_key = dict(enumerate(tasks))
        needs = {key: self._needs(task) for key, task in by_key.items()}
        feasibility.check_feasible(needs, by_key, alive_nodes(ray), self.address, waited=None)
        board = ray.remote(ProgressBoard).options(num_cpus=0).remote()
        progress = ProgressFeed(ray, board)
        keys: dict[Any, int] = {}  # object ref -> task key
        shown: dict[int, int] = {}  # task key -> bytes shown to on_bytes so far
        pending: set = set()
        try:
            self._submit(by_key, needs, board, keys, pending)
            check_every = min(FEASIBILITY_CHECK_INTERVAL, max(0.5, self.node_loss_grace / 2))
            next_check = time.monotonic() + check_every
            lost_since: dict[str, float] = {}
            while pending:
                ready = self._wait_ready(pending)
                progress.show(shown, on_bytes)
                for ref in ready:
                    pending.discard(ref)
                    self._land(ref, keys[ref], by_key, board, shown, on_bytes, on_done)
                if pending and time.monotonic() >= next_check:
                    feasibility.check_still_feasible(ray, {keys[r]: needs[keys[r]] for r in pending}, by_key,
                                                     lost_since, self.address, self.node_loss_grace)
                    next_check = time.monotonic() + check_every
        except BaseException:
            killed = stop(ray, pending, self.cancel_grace)
            remove_leftovers_after_kill(ray, [by_key[keys[ref]] for ref in killed], self.placement)
            raise
        finally:
            try:
                ray.kill(board)
            except Exception:
                pass

    def _submit(self, by_key: dict[int, RankTask], needs: dict[int, dict[str, float]], board, keys: dict,
                pending: set) -> None:
        """Submit every task, largest first (so one big rank does not run alone at the end)."""
        remote = self._ray.remote(run_on_worker)
        for key in sorted(by_key, key=lambda k: -by_key[k].plan.bytes_written):
            ref = remote.options(**self._options(needs[key])).remote(by_key[key], key, board, self.runner,
                                                                      self.max_retries)
            keys[ref] = key
            pending.add(ref)

    def _wait_ready(self, pending: set) -> list:
        """The finished tasks: waits up to POLL_INTERVAL for one, then takes all that are done."""
        ray = self._ray
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_INTERVAL)
        if ready and len(pending) > 1:
            first = set(ready)
            rest = [r for r in pending if r not in first]
            more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
            ready = list(ready) + list(more)
        return list(ready)

    def _land(self, ref, key: int, by_key: dict[int, RankTask], board, shown: dict[int, int],
              on_bytes: Callable[[int], None], on_done: Callable[[RankResult], None]) -> None:
        """One finished task: its failure raised, or its report kept, its last bytes shown, its result handed on."""
        try:
            result, report = self._ray.get(ref)
        except Exception as e:
            task = by_key[key]
            raise rank_failure(self._ray, task.target_rank, e, self.max_retries,
                               lambda: self._last_seen(task, key, board)) from None
        self._reports.append(report)
        extra = report.bytes_reported - shown.get(key, 0)
        if extra > 0:
            shown[key] = report.bytes_reported
            on_bytes(extra)
        on_done(result)

    def summary(self) -> list[NodeThroughput]:
        """Per node: ranks, bytes read and written, wall and busy seconds of the runs so far."""
        return per_node(self._reports)

    def summary_table(self) -> str:
        return render(self.summary())

    @property
    def reports(self) -> list[TaskReport]:
        """Where and when each finished rank ran (one per rank, in completion order)."""
        return list(self._reports)

    def output_identity(self, target_rank: int) -> tuple:
        """The identity of the file the latest finished task of `target_rank` wrote, as its node saw
        it (for verifying that file on that node later); () when unknown."""
        for report in reversed(self._reports):
            if report.target_rank == target_rank:
                return tuple(report.identity)
        return ()

    # ------------------------------------------------------------------------------ node tasks
    def run_on_nodes(self, function: Callable[..., Any], calls: Mapping[str, tuple], *, what: str,
                     holding: Mapping[str, str] | None = None) -> dict[str, Any]:
        """``function(*args)`` once on the node offering each custom resource of `calls`; results by resource.

        For small jobs that must run where a node's own files are (checking or publishing the
        outputs on its local disk). Like rank tasks: a call whose worker or node died is retried,
        a resource no live node offers is refused at once (or once its node has been gone for
        ``node_loss_grace``), and the first failure stops the others and is raised as one line
        naming the node and `what` was being done (`holding`: what each node holds, for messages).
        `function` must be importable on the nodes.
        """
        if not calls:
            return {}
        self.connect()
        ray = self._ray
        cpus = min(1.0, float(self.num_cpus_per_task))
        needs = {res: {"CPU": cpus, res: float(UNITS_PER_TASK)} for res in calls}
        feasibility.check_nodes_offer(needs, alive_nodes(ray), what, self.address, waited=None, holding=holding)
        remote = ray.remote(run_on_node)
        refs = {remote.options(num_cpus=cpus, resources={res: float(UNITS_PER_TASK)}, max_retries=self.max_retries,
                               retry_exceptions=False).remote(function, tuple(args)): res
                for res, args in calls.items()}
        pending, results, lost_since = set(refs), {}, {}
        try:
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=FEASIBILITY_CHECK_INTERVAL)
                for ref in ready:
                    pending.discard(ref)
                    try:
                        results[refs[ref]] = ray.get(ref)
                    except Exception as e:
                        raise node_failure(ray, refs[ref], what, e, self.max_retries) from None
                if pending:
                    feasibility.check_nodes_still_offer(ray, {refs[r]: needs[refs[r]] for r in pending}, what,
                                                        lost_since, self.address, self.node_loss_grace)
        except BaseException:
            stop(ray, pending, self.cancel_grace)
            raise
        return results

    # ------------------------------------------------------------------------------ internals
    def _needs(self, task: RankTask) -> dict[str, float]:
        needs: dict[str, float] = {"CPU": float(self.num_cpus_per_task)}
        if self.memory_per_task:
            needs["memory"] = float(self.memory_per_task)
        resource = self.placement(task.target_rank)
        if resource:
            needs[resource] = float(UNITS_PER_TASK)
        return needs

    def _options(self, needs: dict[str, float]) -> dict:
        custom = {k: v for k, v in needs.items() if k not in ("CPU", "memory")}
        # Ray retries tasks whose worker or node died; transient errors are retried in the worker
        opts: dict[str, Any] = {"num_cpus": needs["CPU"], "max_retries": self.max_retries, "retry_exceptions": False}
        if "memory" in needs:
            opts["memory"] = int(needs["memory"])
        if custom:
            opts["resources"] = custom
        return opts

    def _last_seen(self, task: RankTask, key: int, board) -> str:
        """Where the task's last attempt started, as its worker told the progress board."""
        try:
            where = self._ray.get(board.where.remote(key), timeout=5)
        except Exception:
            where = None
        if where:
            return where
        resource = self.placement(task.target_rank)
        return f"a Ray node offering {resource}" if resource else "an unknown Ray node"
