"""The console's log lines of a job still checking its inputs, held back until it accepts them.

A refused job prints its one error line alone: the lines it logged on the way (which selection it
applies, which sources it found, runs of killed jobs it marked abandoned) are dropped from the
console, while the run's log file keeps every one of them. A job that goes on prints them when its
checks have passed (its ranks start), or when it ends (a plan, a no-op, a failure that is a bug).
"""

from __future__ import annotations

import logging
import threading


class _Hold(logging.Filter):
    """Keeps what a console handler is given instead of letting it print."""

    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False


_lock = threading.Lock()
_held: list[tuple[logging.Handler, _Hold]] = []


def hold() -> None:
    """Hold back what the console handlers (not the log files) would print, from now on."""
    with _lock:
        for handler in logging.getLogger().handlers:
            if not isinstance(handler, logging.FileHandler) and not any(h is handler for h, _ in _held):
                keeper = _Hold()
                handler.addFilter(keeper)
                _held.append((handler, keeper))


def release() -> None:
    """Print what was held, in order, and stop holding: the job has accepted its inputs."""
    with _lock:
        taken = list(_held)
        _held.clear()
        for handler, keeper in taken:
            handler.removeFilter(keeper)
    for handler, keeper in taken:
        for record in keeper.records:
            handler.handle(record)


def drop() -> None:
    """Stop holding and forget what was held: the job is refused (its one line says why)."""
    with _lock:
        for handler, keeper in _held:
            handler.removeFilter(keeper)
        _held.clear()
