"""Waiting for a lineage database another process holds: bounded in time, and stoppable.

SQLite lets one process write at a time; a writer waits for the others in SQLite's busy handler,
which blocks in C, where neither a deadline nor a signal handler of ours can act. So the store
waits in slices (``BUSY_SLICE_SECONDS`` of busy timeout per attempt) and retries the transaction
from Python, where each pause checks two things:

* the budget: all the waits of one store together (a job's run, its plan, its outputs) last at
  most ``LOCK_WAIT_SECONDS``; past it, ``LockWaitError`` names the database in one line, and every
  later write of that store gives up at once instead of waiting as long again;
* a stop request (``request_stop``): the job's SIGINT/SIGTERM handler asks every wait to end, in
  whatever thread it waits (the job records its lineage in a thread of its own, which a signal
  handler cannot interrupt); the wait then raises ``WaitStopped``, worded as the interruption is.

This module imports nothing heavy: the job's signal handling uses it before any database is opened.
"""

from __future__ import annotations

import random
import threading
import time

from reshard_job.lineage.errors import LineageError

LOCK_WAIT_SECONDS = 60.0  # all lock waits of one store together
BUSY_SLICE_SECONDS = 1.0  # SQLite's busy timeout per attempt: how long a signal may go unnoticed

_stop = threading.Event()
_reason = ["interrupted"]


class LockWaitError(LineageError):
    """The database stayed locked by another process for longer than the store may wait."""


class WaitStopped(LineageError):
    """The job was asked to stop (a signal) while it waited for the database."""


def request_stop(reason: str) -> None:
    """Have every wait for a database end now, raising ``WaitStopped(reason)``."""
    _reason[0] = reason
    _stop.set()


def clear_stop() -> None:
    _stop.clear()


def stop_requested() -> bool:
    return _stop.is_set()


class LockWait:
    """The lock-wait budget of one store (see the module docstring); `shown` names its database."""

    def __init__(self, shown: str, seconds: float | None = None):
        self.shown = shown
        self.seconds = LOCK_WAIT_SECONDS if seconds is None else seconds
        self.spent = 0.0
        self._lock = threading.Lock()

    def exceeded(self) -> LockWaitError:
        return LockWaitError(f"lineage database {self.shown}: locked by another process for more than "
                             f"{self.seconds:g} s (another job or program writing it, or holding a transaction "
                             f"open); run again once it is free, or set lineage.enabled=false to run without "
                             f"recording")

    def check(self) -> None:
        """Before waiting: stopped, or the budget spent already."""
        if _stop.is_set():
            raise WaitStopped(_reason[0])
        if self.spent >= self.seconds:
            raise self.exceeded()

    def pause(self, busy_for: float, attempt: int) -> None:
        """An attempt found the database locked for `busy_for` seconds: count them, then wait a moment
        (jittered, so jobs that collided once do not collide again in lockstep), stoppably."""
        with self._lock:
            self.spent += busy_for
        self.check()
        delay = min(0.01 * 2 ** min(attempt, 6), 0.5) * random.uniform(0.5, 1.0)
        started = time.monotonic()
        if _stop.wait(delay):
            raise WaitStopped(_reason[0])
        with self._lock:
            self.spent += time.monotonic() - started
        self.check()
