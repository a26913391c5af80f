"""Runners the Ray tests hand to ``RayExecutor(runner=...)``: the real ``run_rank_task`` with a
file-based handshake around it, so a test can kill or cancel a worker at a known point.

They run inside Ray workers, which cannot import this folder; the tests ship this module by
value (``ray.cloudpickle.register_pickle_by_value``). Signals are files in a shared folder:
``<rank>.attempt.<pid>.<id>`` for every attempt, ``<rank>.held`` (holding the worker's pid) once
an attempt is held mid-write.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

HOLD_LIMIT = 120.0  # a held attempt gives up after this long, so a broken test cannot hang


def record_attempt(signals: str, rank: int) -> None:
    Path(signals, f"{rank}.attempt.{os.getpid()}.{uuid.uuid4().hex[:8]}").touch()


def attempts(signals: str, rank: int) -> int:
    return len(list(Path(signals).glob(f"{rank}.attempt.*")))


def held_pid(signals: str, rank: int) -> int | None:
    path = Path(signals, f"{rank}.held")
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    return int(text) if text.strip() else None


def _wait_until(predicate, limit: float) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


@dataclass(frozen=True)
class HoldOnce:
    """The first attempt at each rank in `hold` stops after writing its first bytes (its output's
    temporary file open) and waits to be killed or cancelled; later attempts run normally.
    Ranks in `wait` start only once every rank in `hold` is held (so those are surely mid-write)."""

    signals: str
    hold: frozenset = field(default_factory=frozenset)
    wait: frozenset = field(default_factory=frozenset)

    def __call__(self, task, progress=None):
        from reshard_job.execute.rank_task import run_rank_task

        rank = task.target_rank
        record_attempt(self.signals, rank)
        if rank in self.wait and not _wait_until(
                lambda: all(held_pid(self.signals, r) for r in self.hold), HOLD_LIMIT):
            raise RuntimeError(f"ranks {sorted(self.hold)} were never held")
        marker = Path(self.signals, f"{rank}.held")
        if rank not in self.hold or marker.exists():
            return run_rank_task(task, progress=progress)

        def hold(n: int) -> None:
            if progress:
                progress(n)
            tmp = marker.with_suffix(".partial")
            tmp.write_text(str(os.getpid()))
            tmp.rename(marker)
            _wait_until(lambda: False, HOLD_LIMIT)
            raise RuntimeError(f"rank {rank} was held for {HOLD_LIMIT:.0f} s and never stopped")

        return run_rank_task(task, progress=hold)


@dataclass(frozen=True)
class HoldDeaf:
    """Like HoldOnce, but a held attempt ignores Ray's polite cancel (as a task that misses the
    interrupt does), so only a kill stops it, and the kill leaves its temporary file behind."""

    signals: str
    hold: frozenset = field(default_factory=frozenset)
    wait: frozenset = field(default_factory=frozenset)

    def __call__(self, task, progress=None):
        from reshard_job.execute.rank_task import run_rank_task

        rank = task.target_rank
        record_attempt(self.signals, rank)
        if rank in self.wait and not _wait_until(
                lambda: all(held_pid(self.signals, r) for r in self.hold), HOLD_LIMIT):
            raise RuntimeError(f"ranks {sorted(self.hold)} were never held")
        if rank not in self.hold:
            return run_rank_task(task, progress=progress)
        marker = Path(self.signals, f"{rank}.held")

        def hold(n: int) -> None:
            tmp = marker.with_suffix(".partial")
            tmp.write_text(str(os.getpid()))
            tmp.rename(marker)
            deadline = time.monotonic() + HOLD_LIMIT
            while time.monotonic() < deadline:
                try:
                    time.sleep(0.05)
                except KeyboardInterrupt:
                    Path(self.signals, f"{rank}.interrupted").touch()
            raise RuntimeError(f"rank {rank} was held for {HOLD_LIMIT:.0f} s and never stopped")

        return run_rank_task(task, progress=hold)


@dataclass(frozen=True)
class StorageKeepsResetting:
    """Every attempt fails as remote storage does when it drops the connection."""

    signals: str

    def __call__(self, task, progress=None):
        record_attempt(self.signals, task.target_rank)
        raise ConnectionResetError(104, "Connection reset by peer (storage endpoint)")


@dataclass(frozen=True)
class DiesEveryTime:
    """Every attempt's worker process dies (as if killed by the kernel's OOM killer)."""

    signals: str

    def __call__(self, task, progress=None):
        import signal

        record_attempt(self.signals, task.target_rank)
        time.sleep(0.5)  # let the worker's "started on" note reach the driver's progress board
        os.kill(os.getpid(), signal.SIGKILL)
