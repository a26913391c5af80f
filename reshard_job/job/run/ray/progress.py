"""Progress of rank tasks on a Ray cluster, through a tiny actor rather than a queue.

Workers send their running byte count (not increments) at most every ``PROGRESS_INTERVAL``
seconds as fire-and-forget actor calls, so a worker never waits on the driver, a lost or late
update costs nothing (the next one carries the total, the finished task's report settles it),
and a retried task, which starts again from zero, never makes the bar run past 100 %: the
driver shows, per rank, the most bytes any attempt has reached.

``ProgressBoard`` is the actor, ``ProgressReporter`` the worker's side, ``ProgressFeed`` the
driver's.
"""

from __future__ import annotations

import time
from typing import Callable

PROGRESS_INTERVAL = 0.25  # seconds between a worker's progress updates


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


class ProgressFeed:
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


class ProgressReporter:
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
        tell(self.board.add, self.key, self.attempt, self.total)


def tell(method, *args) -> None:
    """Fire and forget: progress must never hold a worker up or fail its task."""
    try:
        method.remote(*args)
    except Exception:
        pass
