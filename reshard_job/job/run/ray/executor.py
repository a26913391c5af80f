"""Running one conversion's rank tasks on a Ray cluster.

One Ray task per target rank: it opens only the source files its plan names, reads only the
boxes it needs, writes its target file atomically and returns the ``RankResult`` with a small
report of where and when it ran. The driver keeps everything that has state (the journal, the
lineage database, the progress display); workers only run ``execute.run_rank_task``.

Trade-offs chosen:

- **Progress through a tiny actor, not a queue.** Workers send their running byte count (not
  increments) at most every ``PROGRESS_INTERVAL`` seconds as fire-and-forget actor calls, so a
  worker never waits on the driver, a lost or late update costs nothing (the next one carries
  the total, the finished task's report settles it), and a retried task, which starts again
  from zero, never makes the bar run past 100 %: the driver shows, per rank, the most bytes any
  attempt has reached.
- **Retries only where a retry can help.** Ray re-runs a task whose worker process or node died
  (``max_retries``). A transient failure (remote storage resetting the connection or timing
  out, or an error marked ``transient``) is retried as often, with back-off, inside the worker:
  Ray's own ``retry_exceptions`` would print the worker's traceback on the driver at every
  retry. Anything else fails at once: a corrupt source reads the same on every attempt.
- **A killed attempt leaves no file behind.** Outputs are written under a temporary name and
  renamed into place, so a killed worker never leaves a partial file under the final name; the
  next attempt of the same rank removes the temporary files earlier attempts left for that
  output (on the node that writes it, which matters for ``output.placement=per_node``).
- **Fail fast, stop the rest, never hang.** The first rank that fails for good cancels every
  other task (first politely, so they remove their temporary files, then by force, tidying up
  after the killed ones on their nodes) and is
  raised as one line naming the rank, the node and the cause. Tasks that no live node can
  run (a placement resource nobody offers, more CPUs than any node has) are refused before
  anything starts, and a node that leaves for good while its ranks wait fails the run.

Ray is optional (``pip install -e '.[ray]'``) and imported only when this executor is used.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
import traceback
import uuid
import warnings
from dataclasses import replace
from typing import Any, Callable, Mapping, Sequence

from reshard_job.errors import ConfigError, ReshardError
from reshard_job.execute.tasks import RankResult, RankTask
from reshard_job.core.placement import UNITS_PER_TASK, Placement, as_placement
from reshard_job.job.run.throughput import NodeThroughput, TaskReport, per_node, render

log = logging.getLogger(__name__)

ADDRESS_AUTO = "auto"
CLIENT_SCHEME = "ray://"
PROGRESS_INTERVAL = 0.25  # seconds between a worker's progress updates
POLL_INTERVAL = 0.2  # seconds the driver waits for results before showing progress
FEASIBILITY_CHECK_INTERVAL = 5.0  # seconds between checks that waiting tasks still have a node
NODE_LOSS_GRACE = 60.0  # seconds a lost placement node may take to come back
CANCEL_GRACE = 10.0  # seconds cancelled tasks get to clean up before they are killed
KILL_WAIT = 5.0  # seconds to wait for killed tasks to be gone
LEFTOVER_CLEANUP_TIMEOUT = 15.0  # seconds a stopped run spends removing killed tasks' temporary files
CONNECT_TIMEOUT = 10.0
TRANSIENT_BACKOFF = 1.0  # seconds before the first retry of a transient failure, doubling after
TRANSIENT_BACKOFF_LIMIT = 30.0
MESSAGE_LIMIT = 400  # characters of a cause quoted in an error message
# A Ray worker with numpy and this package loaded, before any slice buffer (measured 70-80 MiB
# on CPython 3.11 / Ray 2.60), rounded up
WORKER_BASE_MEMORY = 96 * 1024 * 1024

Runner = Callable[..., RankResult]  # runner(task, progress=callable) -> RankResult


class RayExecutorError(ReshardError):
    """The Ray cluster cannot run the conversion (unreachable, lacks a node the placement needs)."""


class RayConnectionError(RayExecutorError):
    """The Ray cluster at the given address cannot be reached."""

    def __init__(self, address: str, problem: str):
        self.address = address
        self.problem = problem
        super().__init__(f"cannot connect to the Ray cluster at {address}: {problem}")


class RankTaskError(ReshardError):
    """A target rank failed for good; the message names the rank, the node and the cause."""

    def __init__(self, target_rank: int, where: str, cause: str, *, attempts: int | None = None,
                 details: str = ""):
        self.target_rank = target_rank
        self.where = where
        self.cause = cause
        self.attempts = attempts
        self.details = details  # the worker's traceback, for logs; never shown to users
        tries = f" after {attempts} attempts" if attempts and attempts > 1 else ""
        super().__init__(f"target rank {target_rank} failed on {where}{tries}: {cause}")


class TransientRankTaskError(RankTaskError):
    """A failure worth retrying (remote storage timed out or reset the connection)."""


class NodeTaskError(RayExecutorError):
    """A node task (``RayExecutor.run_on_nodes``) failed; the message starts with where it ran."""


# OSErrors that remote storage raises when a retry may well succeed. Local file-system errors
# arrive as StorageError (not transient) unless the storage layer marks them ``transient``.
TRANSIENT_ERRORS = (ConnectionError, TimeoutError)


def memory_per_task(max_memory: int) -> int:
    """Bytes of Ray's ``memory`` resource a task should reserve under ``job.max_memory``: the slice
    buffers it bounds, the output writer's two staging buffers, and the worker process itself
    (measured peak: about 120 MiB at the default 32 MiB)."""
    from reshard_job.storage.atomic import DIRECT_CHUNK

    return WORKER_BASE_MEMORY + int(max_memory) + 2 * DIRECT_CHUNK


def import_ray():
    """Ray, or a one-line error saying how to install it."""
    try:
        import ray
    except ImportError:
        ray = None
    # (a folder named "ray" on sys.path imports as an empty namespace package)
    if ray is None or not hasattr(ray, "remote"):
        raise ConfigError("the Ray executor needs the ray package: pip install -e '.[ray]'")
    return ray


def parse_address(address: str | None) -> tuple[str, str | None, int | None]:
    """``auto`` | ``ray://host:port`` | ``host:port`` -> (kind, host, port); kind is auto, client or gcs."""
    text = ADDRESS_AUTO if address is None else str(address).strip()
    if text == ADDRESS_AUTO:
        return ADDRESS_AUTO, None, None
    kind, rest = ("client", text[len(CLIENT_SCHEME):]) if text.startswith(CLIENT_SCHEME) else ("gcs", text)
    m = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})", rest)
    if not m or not 0 < int(m.group(2)) < 65536:
        raise ConfigError(f"Ray address {_clip(text, 120)!r} is not 'auto', 'ray://host:port' or 'host:port'")
    return kind, m.group(1).strip("[]"), int(m.group(2))


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
        ray = import_ray()
        kind, host, port = parse_address(self.address)
        if kind == ADDRESS_AUTO:
            resolved = _resolve_auto(ray, self.address)
            if resolved is not None:
                kind, host, port = parse_address(resolved)
        if host is not None:
            _probe(self.address, kind, host, port, self.connect_timeout)
        if ray.is_initialized():
            current = _connected_gcs(ray)
            if kind == "gcs" and current and not _same_endpoint(current, host, port):
                raise RayConnectionError(self.address, f"this process is already connected to the Ray cluster at "
                                                       f"{current}")
            self._ray, self._owns_connection = ray, False
            return
        try:
            with warnings.catch_warnings():  # Ray warns, then raises; the error says it all
                warnings.simplefilter("ignore")
                ray.init(address=self.address, ignore_reinit_error=True, logging_level=logging.WARNING,
                         log_to_driver=False)
        except Exception as e:  # Ray raises ConnectionError, RuntimeError, ValueError, grpc errors...
            if ray.is_initialized():
                ray.shutdown()
            raise RayConnectionError(self.address, _first_line(e)) from None
        self._ray, self._owns_connection = ray, True

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
        self._check_feasible(needs, by_key, _alive_nodes(ray), waited=None)
        board = ray.remote(ProgressBoard).options(num_cpus=0).remote()
        progress = _ProgressFeed(ray, board)
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
                    self._check_still_feasible({keys[r]: needs[keys[r]] for r in pending}, by_key, lost_since)
                    next_check = time.monotonic() + check_every
        except BaseException:
            killed = self._stop(pending)
            self._remove_leftovers_after_kill([by_key[keys[ref]] for ref in killed])
            raise
        finally:
            try:
                ray.kill(board)
            except Exception:
                pass

    def _submit(self, by_key: dict[int, RankTask], needs: dict[int, dict[str, float]], board, keys: dict,
                pending: set) -> None:
        """Submit every task, largest first (so one big rank does not run alone at the end)."""
        remote = self._ray.remote(_run_on_worker)
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
            raise self._failure(by_key[key], key, e, board) from None
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
        self._check_nodes_offer(needs, _alive_nodes(ray), what, waited=None, holding=holding)
        remote = ray.remote(_run_on_node)
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
                        raise self._node_failure(refs[ref], what, e) from None
                if pending:
                    self._check_nodes_still_offer({refs[r]: needs[refs[r]] for r in pending}, what, lost_since)
        except BaseException:
            self._stop(pending)
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

    def _check_feasible(self, needs: dict[int, dict[str, float]], by_key: dict[int, RankTask], nodes: list[dict],
                        *, waited: float | None) -> None:
        """Refuse tasks no live node can run: Ray would queue them for ever."""
        unmet = sorted((by_key[key].target_rank, key) for key, need in needs.items()
                       if not any(_fits(need, n) for n in nodes))
        if not unmet:
            return
        rank, key = unmet[0]
        need = ", ".join(f"{k}={_amount(k, v)}" for k, v in needs[key].items())
        offered = "; ".join(f"{n.get('NodeManagerAddress', '?')} {_describe_resources(n.get('Resources', {}))}"
                            for n in nodes) or "none"
        others = "" if len(unmet) == 1 else f" (and {len(unmet) - 1} other rank(s))"
        offers = f"has offered for the last {waited:.0f} s (a node left?)" if waited else "offers"
        raise RayExecutorError(_clip(f"target rank {rank}{others} needs {need}, which no live node of the Ray "
                                     f"cluster at {self.address} {offers} (nodes: {offered})", 600))

    def _check_still_feasible(self, waiting: dict[int, dict[str, float]], by_key: dict[int, RankTask],
                              lost_since: dict[str, float]) -> None:
        """A node holding a placement resource may leave while its ranks wait; give it time to return."""
        try:
            nodes = _alive_nodes(self._ray)
        except Exception:  # the GCS is restarting; Ray itself fails the tasks if it does not return
            return
        now = time.monotonic()
        unmet = {key: need for key, need in waiting.items() if not any(_fits(need, n) for n in nodes)}
        missing_now = {_need_key(need) for need in unmet.values()}
        for gone in [k for k in lost_since if k not in missing_now]:
            del lost_since[gone]
        expired = {key: need for key, need in unmet.items()
                   if now - lost_since.setdefault(_need_key(need), now) >= self.node_loss_grace}
        if expired:
            self._check_feasible(expired, by_key, nodes, waited=self.node_loss_grace)

    def _check_nodes_offer(self, needs: dict[str, dict[str, float]], nodes: list[dict], what: str, *,
                           waited: float | None, holding: Mapping[str, str] | None = None) -> None:
        unmet = sorted(res for res, need in needs.items() if not any(_fits(need, n) for n in nodes))
        if not unmet:
            return
        unmet = [f"{res} ({holding[res]})" if holding and res in holding else res for res in unmet]
        offered = "; ".join(f"{n.get('NodeManagerAddress', '?')} {_describe_resources(n.get('Resources', {}))}"
                            for n in nodes) or "none"
        since = f" for the last {waited:.0f} s (a node left?)" if waited else ""
        raise RayExecutorError(_clip(f"{what}: no live node of the Ray cluster at {self.address} offers "
                                     f"{', '.join(unmet)}{since} (nodes: {offered})", 600))

    def _check_nodes_still_offer(self, waiting: dict[str, dict[str, float]], what: str,
                                 lost_since: dict[str, float]) -> None:
        try:
            nodes = _alive_nodes(self._ray)
        except Exception:  # the GCS is restarting; Ray itself fails the tasks if it does not return
            return
        now = time.monotonic()
        unmet = {res for res, need in waiting.items() if not any(_fits(need, n) for n in nodes)}
        for gone in [r for r in lost_since if r not in unmet]:
            del lost_since[gone]
        expired = {res: waiting[res] for res in unmet if now - lost_since.setdefault(res, now) >= self.node_loss_grace}
        if expired:
            self._check_nodes_offer(expired, nodes, what, waited=self.node_loss_grace)

    def _node_failure(self, resource: str, what: str, err: Exception) -> ReshardError:
        ray = self._ray
        cause = getattr(err, "cause", None)
        if isinstance(cause, NodeTaskError):
            return RayExecutorError(_clip(f"{what} failed on {cause}", MESSAGE_LIMIT + 200))
        if isinstance(err, (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError,
                            ray.exceptions.LocalRayletDiedError)):
            return RayExecutorError(_clip(f"{what} failed on the Ray node offering {resource} after "
                                          f"{1 + self.max_retries} attempts: its worker died on every attempt "
                                          f"({_first_line(err)})", MESSAGE_LIMIT + 200))
        return RayExecutorError(_clip(f"{what} failed on the Ray node offering {resource}: {_first_line(err)}",
                                      MESSAGE_LIMIT + 200))

    def _failure(self, task: RankTask, key: int, err: Exception, board) -> ReshardError:
        ray = self._ray
        cause = getattr(err, "cause", None)
        if isinstance(cause, RankTaskError):
            if cause.details:
                log.debug("target rank %d, worker traceback:\n%s", cause.target_rank, cause.details)
            return RankTaskError(cause.target_rank, cause.where, cause.cause, attempts=cause.attempts,
                                 details=cause.details)
        where = self._last_seen(task, key, board)
        if isinstance(cause, BaseException):  # the worker's own code failed outside the runner
            return RankTaskError(task.target_rank, where,
                                 _clip(f"{type(cause).__name__}: {_first_line(cause)}", MESSAGE_LIMIT))
        if isinstance(err, (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError,
                            ray.exceptions.LocalRayletDiedError)):
            attempts = 1 + self.max_retries
            return RankTaskError(task.target_rank, where, _clip(f"its worker died on every attempt "
                                                                f"({_first_line(err)})", MESSAGE_LIMIT),
                                 attempts=attempts)
        return RankTaskError(task.target_rank, where, _first_line(err))

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

    def _stop(self, pending: set) -> list:
        """Cancel every unfinished task: politely first (they remove their temporary files), then by
        force. Returns the refs that had to be killed (their temporary files may still be there)."""
        if not pending:
            return []
        ray = self._ray
        for ref in pending:
            try:
                ray.cancel(ref, force=False)
            except Exception:
                pass
        deadline = time.monotonic() + self.cancel_grace
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

    def _remove_leftovers_after_kill(self, tasks: list[RankTask]) -> None:
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
            resource = self.placement(task.target_rank)
            if resource:
                by_resource.setdefault(resource, []).append(task.out_path)
            else:  # no placement: the output folder is shared, so it is visible here as well
                _remove_leftovers(task.out_path)
        if not by_resource:
            return
        ray = self._ray
        try:
            remote = ray.remote(_run_on_node)
            refs = [remote.options(num_cpus=0, resources={res: float(UNITS_PER_TASK)}, max_retries=0,
                                   retry_exceptions=False).remote(_remove_leftovers, tuple(paths))
                    for res, paths in by_resource.items()]
            ready, late = ray.wait(refs, num_returns=len(refs), timeout=LEFTOVER_CLEANUP_TIMEOUT)
            for ref in late:
                ray.cancel(ref, force=True)
            for ref in ready:
                try:
                    ray.get(ref)
                except Exception as e:
                    log.warning("could not remove a stopped task's temporary files: %s", _first_line(e))
        except Exception as e:
            log.warning("could not remove the stopped tasks' temporary files: %s", _first_line(e))


class _ProgressFeed:
    """The driver's side of the progress board: at most one request in flight, never waited on,
    so a slow or missing board delays no result."""

    def __init__(self, ray, board):
        self._ray, self._board = ray, board
        self._request = None

    def show(self, shown: dict[int, int], on_bytes: Callable[[int], None]) -> None:
        ray = self._ray
        if self._request is not None:
            ready, _ = ray.wait([self._request], timeout=0)
            if not ready:
                return
            try:
                latest = ray.get(self._request)
            except Exception:  # progress is best effort; the results still settle the totals
                latest = {}
            self._request = None
            delta = 0
            for key, n in latest.items():
                if n > shown.get(key, 0):
                    delta += n - shown.get(key, 0)
                    shown[key] = n
            if delta:
                on_bytes(delta)
        try:
            self._request = self._board.drain.remote()
        except Exception:
            self._request = None


# ==================================================================================== worker side

_BUILT_IN_RESOURCES = {"CPU", "GPU", "memory", "object_store_memory"}


def _run_on_worker(task: RankTask, key: int, board, runner: Runner | None,
                   transient_retries: int) -> tuple[RankResult, TaskReport]:
    """One target rank inside a Ray worker, retrying transient failures here.

    Retrying them here rather than through Ray's ``retry_exceptions`` keeps the driver's output
    clean: Ray prints the worker's traceback on the driver for every retry it makes.
    """
    node_id, address, host, resource, where = _here()
    task = _with_node_identities(task)
    for tries in range(1, transient_retries + 2):
        attempt = uuid.uuid4().hex[:12]
        _tell(board.started, key, attempt, where)
        reporter = _ProgressReporter(board, key, attempt)
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


def _run_on_node(function: Callable[..., Any], args: tuple) -> Any:
    """A node task inside a Ray worker: any failure becomes one line saying where it happened."""
    where = _here()[4]
    try:
        return function(*args)
    except ReshardError as e:
        raise NodeTaskError(f"{where}: {_first_line(e)}") from None
    except Exception as e:
        raise NodeTaskError(f"{where}: {type(e).__name__}: {_first_line(e)}") from None


def _attempt(task: RankTask, runner: Runner | None, reporter) -> RankResult:
    """Run the task once; every failure becomes a (transient or final) RankTaskError."""
    from reshard_job.execute.rank_task import run_rank_task

    def fail(cls, text: str):
        return cls(task.target_rank, "", _clip(text, MESSAGE_LIMIT), details=traceback.format_exc())

    try:
        _remove_leftovers_of(task.out_path)
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


def _with_node_identities(task: RankTask) -> RankTask:
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


class _ProgressReporter:
    """The worker's progress callback: sums bytes, sends the running total now and then."""

    def __init__(self, board, key: int, attempt: str, interval: float = PROGRESS_INTERVAL):
        self.board, self.key, self.attempt, self.interval = board, key, attempt, interval
        self.total = 0
        self._sent_at = time.monotonic()

    def __call__(self, n: int) -> None:
        self.total += n
        if time.monotonic() - self._sent_at >= self.interval:
            self.flush()

    def flush(self) -> None:
        self._sent_at = time.monotonic()
        _tell(self.board.add, self.key, self.attempt, self.total)


def _tell(method, *args) -> None:
    """Fire and forget: progress must never hold a worker up or fail its task."""
    try:
        method.remote(*args)
    except Exception:
        pass


def _remove_leftovers(*out_paths: str) -> int:
    """``_remove_leftovers_of`` for several outputs (a node task after a stopped run)."""
    return sum(_remove_leftovers_of(path) for path in out_paths)


def _remove_leftovers_of(out_path: str) -> int:
    """Remove temporary files that killed attempts left for this very output (local paths only;
    object stores publish uploads atomically and leave nothing visible)."""
    from reshard_job.storage import is_url
    from reshard_job.storage.atomic import TMP_SUFFIX

    if is_url(out_path):
        return 0
    folder, name = os.path.split(os.path.abspath(out_path))
    # the exact names storage.atomic gives this output's temporary files: ".<name>.<12 hex>.tmp"
    pattern = re.compile(r"\." + re.escape(name) + r"\.[0-9a-f]{12}" + re.escape(TMP_SUFFIX))
    removed = 0
    try:
        entries = os.listdir(folder)
    except OSError:
        return 0
    for entry in entries:
        full = os.path.join(folder, entry)
        if pattern.fullmatch(entry) and os.path.isfile(full) and not os.path.islink(full):
            try:
                os.unlink(full)
                removed += 1
            except OSError:
                pass
    return removed


class ProgressBoard:
    """Collects every worker's running byte count and where each task's latest attempt runs.

    Keeps one number per task, not a queue of increments, so its memory is bounded by the task
    count however often workers report; an attempt's counts replace those of earlier attempts.
    """

    def __init__(self) -> None:
        self._attempt: dict[int, str] = {}
        self._bytes: dict[int, int] = {}
        self._where: dict[int, str] = {}
        self._changed: set[int] = set()

    def started(self, key: int, attempt: str, where: str) -> None:
        self._attempt[key] = attempt
        self._where[key] = where
        self._bytes[key] = 0

    def add(self, key: int, attempt: str, total: int) -> None:
        if self._attempt.get(key, attempt) != attempt:
            return  # a late update of an attempt that has since been replaced
        self._attempt[key] = attempt
        self._bytes[key] = total
        self._changed.add(key)

    def drain(self) -> dict[int, int]:
        """Tasks whose count changed since the last drain -> their latest count."""
        out = {k: self._bytes[k] for k in self._changed}
        self._changed.clear()
        return out

    def where(self, key: int) -> str | None:
        return self._where.get(key)


# ==================================================================================== helpers


def _probe(address: str, kind: str, host: str, port: int, timeout: float) -> None:
    """Fail in seconds, with the reason, where ``ray.init`` would retry for ever.

    A refused or unresolvable address fails the TCP connect. Something listening that is not
    Ray (``ray.init`` waits for a GCS that never answers) fails the gRPC handshake, and for a
    GCS address the standard gRPC health check, which Ray's GCS serves. Without grpcio (Ray
    without its client extra) only the TCP check is made.
    """
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except socket.gaierror as e:
        raise RayConnectionError(address, f"unknown host {host!r} ({e.strerror})") from None
    except socket.timeout:
        raise RayConnectionError(address, f"no answer within {timeout:g} s") from None
    except OSError as e:
        raise RayConnectionError(address, (e.strerror or str(e)).lower()) from None
    try:
        import grpc
    except ImportError:
        return
    what = "a Ray Client server (ray://, port 10001 by default)" if kind == "client" else \
        "a Ray head's GCS (port 6379 by default; use ray://host:port for a Ray Client server)"
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    channel = grpc.insecure_channel(target)
    try:
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise RayConnectionError(address, f"something listens there but does not answer as {what}") from None
        # Ray's GCS serves the standard gRPC health check; its Ray Client server does not
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        try:
            answer, problem = check(b"", timeout=timeout), None
        except grpc.RpcError as e:
            answer, problem = None, e.code().name.lower()
        if kind == "client":
            if answer is not None:
                raise RayConnectionError(address, f"that is a Ray head's GCS port, not a Ray Client server; "
                                                  f"from a cluster node use {target} without ray://")
            return
        if answer is None:
            raise RayConnectionError(address, f"a gRPC server answers there but not as {what} ({problem})")
        if answer != _HEALTH_SERVING:
            raise RayConnectionError(address, "the Ray GCS there reports that it is not serving")
    finally:
        channel.close()


_HEALTH_SERVING = b"\x08\x01"  # grpc.health.v1.HealthCheckResponse{status: SERVING}


def _resolve_auto(ray, address: str) -> str | None:
    """The address ``auto`` stands for (``RAY_ADDRESS``, or the cluster this machine last joined),
    to probe it; None where this Ray version does not say (then ``ray.init`` reports)."""
    try:
        from ray._private.services import canonicalize_bootstrap_address
    except ImportError:
        return None
    try:
        resolved = canonicalize_bootstrap_address(address)
    except ConnectionError as e:
        raise RayConnectionError(address, _first_line(e)) from None
    except Exception:
        return None
    return resolved if isinstance(resolved, str) and resolved else None


def _connected_gcs(ray) -> str | None:
    try:
        return ray.get_runtime_context().gcs_address
    except Exception:
        return None


def _same_endpoint(current: str, host: str | None, port: int | None) -> bool:
    try:
        _, h, p = parse_address(current)
    except ConfigError:
        return True  # cannot tell: do not refuse
    if p != port:
        return False
    if h == host:
        return True
    try:
        return socket.gethostbyname(h) == socket.gethostbyname(host)
    except OSError:
        return True


def _alive_nodes(ray) -> list[dict]:
    return [n for n in ray.nodes() if n.get("Alive")]


def _fits(need: dict[str, float], node: dict) -> bool:
    have = node.get("Resources", {})
    return all(have.get(k, 0) >= v for k, v in need.items())


def _need_key(need: dict[str, float]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(need.items()))


def _amount(name: str, value: float) -> str:
    if name in ("memory", "object_store_memory"):
        from reshard_job.text import human_size

        return human_size(value)
    return f"{value:g}"


def _describe_resources(resources: dict) -> str:
    shown = {k: v for k, v in resources.items() if not k.startswith("node:") and k != "object_store_memory"}
    return "{" + ", ".join(f"{k}={_amount(k, v)}" for k, v in sorted(shown.items())) + "}"


def _first_line(err: BaseException) -> str:
    """An error's message as one line: its first line, completed by its last where the first only
    announces what follows (Ray's "Initialization failure from server:" then a server traceback)."""
    lines = [line.strip() for line in (str(err).strip() or type(err).__name__).splitlines() if line.strip()]
    text = lines[0]
    if text.endswith(":") and len(lines) > 1:
        text = f"{text} {lines[-1]}"
    return _clip(text, MESSAGE_LIMIT)


def _clip(text: str, limit: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
