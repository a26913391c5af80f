"""Choosing, from the settled job, how its rank tasks run and where their files live.

``job.executor=local`` (the default) runs the tasks in this process or a pool of worker processes
on this machine. ``job.executor=ray`` hands each target rank to a Ray cluster as one task
(``RayExecutor``): the driver, this process, keeps everything that has state (journal, manifest,
lineage) and workers only read sources and write their file. ``output.placement`` says where
those files live: ``shared`` (one ``output.dir`` every node sees, checked by the driver) or
``per_node`` (each rank on the disk of the node that will load it, checked by a task on that
node; see ``node_outputs``).

The choice is made once per conversion, inside the convert stage, so every other stage is the
same whatever runs the ranks. The Ray connection is opened only when something needs the
cluster (a completed rerun with shared placement never connects), and then kept until the
process ends: the next job of a sweep reuses it and the worker processes the cluster has
started, which would otherwise be started again for every job.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from reshard_job.errors import ConfigError
from reshard_job.job.run.local import WORKERS_PER_CPU, Executor, LocalExecutor, default_workers, useful_workers
from reshard_job.job.output.node_outputs import NodeOutputs, SharedOutputs
from reshard_job.job.output.directory import OutputDir
from reshard_job.core.placement import Placement, devices_per_node_for, per_node_placement
from reshard_job.job.stages.prepare import Prepared
from reshard_job.job.config.spec import EXECUTOR_RAY, JobSpec
from reshard_job.core.placement import PLACEMENT_PER_NODE

log = logging.getLogger("reshard_job")


@dataclass
class ExecutorChoice:
    """How this conversion runs its ranks (`executor_for`) and checks its files (`files`)."""

    files: SharedOutputs | NodeOutputs
    ray: object | None = None  # the RayExecutor, with job.executor=ray
    given: Executor | None = None  # an executor handed in by the caller (tests, tools)
    workers: int | None = None  # job.workers (local)
    prepared: Prepared | None = None

    def executor_for(self, n_tasks: int, bytes_to_write: int | None = None) -> tuple[Executor, str]:
        """The executor for `n_tasks` rank tasks writing `bytes_to_write` in all, and how it runs
        them (for the log)."""
        if self.given is not None:
            return self.given, f"with {type(self.given).__name__}"
        if self.ray is not None:
            where = ", each on its target node" if self.files.per_node else ""
            return self.ray, f"on the Ray cluster at {self.ray.address}{where}"
        if self.workers is None:
            workers = default_workers(n_tasks, bytes_to_write)
        else:
            workers = useful_workers(self.workers, n_tasks)
            if workers < min(self.workers, n_tasks):
                log.warning("job.workers=%d: using %d worker processes, %d per CPU of this machine's %d (more "
                            "would only wait for the CPUs, each holding its own memory)",
                            self.workers, workers, WORKERS_PER_CPU, os.cpu_count() or 1)
        return LocalExecutor(workers, self.prepared.readers if self.prepared else None), f"with {workers} worker(s)"

    def node_summary(self) -> list[dict] | None:
        """Per Ray node: ranks, bytes read and written, wall, busy and CPU seconds (None when local)."""
        from reshard_job.job.run.throughput import to_json

        if not getattr(self.ray, "reports", None):
            return None
        return to_json(self.ray.summary())

    def close(self) -> None:
        global _kept_address
        if self.ray is None or self.given is not None:
            return
        if self.ray.detach():
            _kept_address = self.ray.address


# The cluster address a job of this process joined and left connected. The connection is kept
# for the process's lifetime so that the next job of a sweep (``-m``) reuses it and the worker
# processes the cluster started for it (starting them costs seconds per node); a later job
# asking for another address disconnects first.
_kept_address: str | None = None


def _leave_other_cluster(address: str) -> None:
    global _kept_address
    if _kept_address is None or _kept_address == address:
        return
    from reshard_job.job.run.ray.connect import import_ray

    ray = import_ray()
    if ray.is_initialized():
        ray.shutdown()
    _kept_address = None


def cluster_layout(spec: JobSpec, devices: int) -> dict | None:
    """``target.cluster`` settled against the target's device count; None when not given.

    Raises a ConfigError when the two disagree (the device count may come from target.strategy,
    so this is checked once the strategy is read, before anything is written)."""
    c = spec.target.cluster
    if not c.given:
        return None
    try:
        per_node = devices_per_node_for(devices, c.nodes, c.devices_per_node)
    except ConfigError as e:
        derived = "" if spec.target.devices is not None else " (from target.strategy)"
        raise ConfigError(f"{e}{derived}") from None
    return {"nodes": -(-devices // per_node), "devices_per_node": per_node,
            "node_resource_prefix": c.node_resource_prefix}


def placement_of(spec: JobSpec, devices: int) -> Placement | None:
    """Target rank -> the Ray resource of its node, with output.placement=per_node; else None."""
    layout = cluster_layout(spec, devices)
    if spec.output.placement != PLACEMENT_PER_NODE:
        return None
    return per_node_placement(layout["devices_per_node"], layout["node_resource_prefix"])


def choose_executor(spec: JobSpec, prepared: Prepared, out: OutputDir, fingerprint: str,
                    given: Executor | None = None) -> ExecutorChoice:
    devices = prepared.target.devices
    placement = placement_of(spec, devices)
    if spec.run.executor != EXECUTOR_RAY:
        return ExecutorChoice(SharedOutputs(out), given=given, workers=spec.run.workers, prepared=prepared)
    from reshard_job.job.run.ray.executor import RayExecutor, memory_per_task

    if given is None:
        _leave_other_cluster(spec.run.ray.address)
    ray = given if given is not None else RayExecutor(
        spec.run.ray.address, num_cpus_per_task=spec.run.ray.num_cpus_per_task,
        memory_per_task=memory_per_task(spec.run.max_memory), max_retries=spec.run.ray.max_retries,
        placement=placement)
    files = SharedOutputs(out) if placement is None else NodeOutputs(
        out, ray, placement, fingerprint, cluster_layout(spec, devices), overwrite=spec.output.overwrite)
    return ExecutorChoice(files, ray=ray, given=given)
