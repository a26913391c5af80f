"""Running the batch job against the test cluster as users do, and stopping its workers mid-write.

The job runs as ``python -m reshard_job`` in a fresh process (through the reliability tests'
launcher, which forks a pre-imported interpreter per run). A ``WorkerKiller`` watches an output
folder for the temporary file a rank's writer creates, finds the cluster process holding it open,
stops it, checks that the file is still unpublished (so the worker really was mid-write), and
kills it with SIGKILL, as the kernel's OOM killer or a lost machine would.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

_RELIABILITY = str(Path(__file__).resolve().parents[2] / "e2e" / "reliability")
if _RELIABILITY not in sys.path:
    sys.path.insert(0, _RELIABILITY)

from local_cluster import cluster_processes  # noqa: E402
from reliability_helpers import (Launcher, app_command, app_env, lineage_runs, log_lines,  # noqa: E402,F401 (re-exported)
                                 make_big_source, message_lines, the_error)

TEMP_NAME = re.compile(r"^\..+\.[0-9a-f]{12}\.tmp$")
KILL_LIMIT = 180.0  # seconds a killer watches before giving up (a broken test must not hang)


def ray_args(cluster, *extra: str) -> list[str]:
    """The job on the test cluster. Two CPUs a task: one worker process per node, since every run
    is a new Ray job whose workers start afresh (seconds each on a loaded 2-core machine)."""
    return ["job.executor=ray", f"job.ray.address={cluster.address}", "job.progress=false",
            "job.ray.num_cpus_per_task=2", *extra]


def temp_files(*roots: Path) -> list[Path]:
    return sorted(p for root in roots if root.exists() for p in root.rglob("*") if TEMP_NAME.match(p.name))


def holder_of(path: Path, pgids: list[int]) -> int | None:
    """The cluster process that has `path` open (matched by its unique temporary name)."""
    for pid in cluster_processes(pgids):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}").endswith("/" + path.name):
                    return pid
            except OSError:
                continue
    return None


class WorkerKiller(threading.Thread):
    """Kills the worker writing into `folder`, `times` times (each attempt of the rank once)."""

    def __init__(self, cluster, folder: Path, times: int = 1):
        super().__init__(daemon=True)
        self.cluster, self.folder, self.times = cluster, folder, times
        self.killed: list[int] = []  # pids killed mid-write
        self.missed = 0  # attempts that published before they could be stopped
        self._halt = threading.Event()

    def run(self) -> None:
        deadline = time.monotonic() + KILL_LIMIT
        seen: set[str] = set()
        while len(self.killed) < self.times and not self._halt.is_set() and time.monotonic() < deadline:
            for tmp in temp_files(self.folder):
                if tmp.name not in seen:
                    seen.add(tmp.name)
                    self._stop_and_kill(tmp)
            time.sleep(0.003)

    def _stop_and_kill(self, tmp: Path) -> None:
        pid = holder_of(tmp, self.cluster.process_groups)
        if pid is None:
            self.missed += 1
            return
        os.kill(pid, signal.SIGSTOP)
        if not tmp.exists():  # it published meanwhile: not mid-write
            os.kill(pid, signal.SIGCONT)
            self.missed += 1
            return
        os.kill(pid, signal.SIGKILL)
        self.killed.append(pid)

    def stop(self) -> None:
        self._halt.set()
        self.join(10)
