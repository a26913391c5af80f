"""Progress display: a tqdm bar (bytes and ranks) on a terminal, plain log lines otherwise.

While a bar is on screen, the job's log lines are routed through tqdm
(``logging_redirect_tqdm``), so a line is printed above the bar instead of being glued onto it, and
once: only the loggers whose own handlers print to the console are redirected. A
bar with nothing to do (all digests cached) is not drawn at all, and a terminal that reports zero
columns or rows gets a bar of a sensible size instead of blank lines.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import sys
import time

from reshard_job.text import human_size

log = logging.getLogger("reshard_job")
MIN_COLUMNS = 60
DEFAULT_ROWS = 24


def console_loggers(logger: logging.Logger) -> list[logging.Logger]:
    """The loggers that print `logger`'s records to the console: itself and the ancestors its records
    propagate to, where one of their handlers writes to stdout or stderr (Hydra's is on the root).

    ``logging_redirect_tqdm`` gives every logger it is handed a console handler of its own; handed
    one without such a handler, it would print each line bare beside the root's prefixed one."""
    found = []
    current: logging.Logger | None = logger
    while current is not None:
        if any(_prints_to_console(h) for h in current.handlers):
            found.append(current)
        current = current.parent if current.propagate else None
    return found


def _prints_to_console(handler: logging.Handler) -> bool:
    """The test ``logging_redirect_tqdm`` applies to the handlers it replaces."""
    return isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.stderr)


class Progress:
    def __init__(self, total_bytes: int, total_units: int, *, enabled: bool | None = None, desc: str = "converting",
                 unit: str = "ranks"):
        self.total_bytes = total_bytes
        self.total_units = total_units
        self.done_bytes = 0
        self.done_units = 0
        self.desc = desc
        self.unit = unit
        self.started = time.monotonic()
        if enabled is None:
            enabled = sys.stderr.isatty()
        self._bar = None
        self._redirect = contextlib.ExitStack()
        if enabled and total_bytes > 0:
            self._open_bar()

    def _open_bar(self) -> None:
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        size = shutil.get_terminal_size((0, 0))
        # a terminal of zero rows (a bare pseudo-terminal) would make tqdm draw nothing at all
        self._bar = tqdm(total=self.total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=self.desc,
                         file=sys.stderr, leave=True, dynamic_ncols=size.columns >= MIN_COLUMNS,
                         ncols=None if size.columns >= MIN_COLUMNS else 100,
                         nrows=None if size.lines > 0 else DEFAULT_ROWS)
        self._bar.set_postfix_str(f"{self.unit} 0/{self.total_units}")
        self._redirect.enter_context(logging_redirect_tqdm(console_loggers(log)))

    def add_bytes(self, n: int) -> None:
        self.done_bytes += n
        if self._bar is not None:
            self._bar.update(n)

    def step_done(self) -> None:
        """One unit done (a file hashed), without a log line of its own."""
        self.done_units += 1
        if self._bar is not None:
            self._bar.set_postfix_str(f"{self.unit} {self.done_units}/{self.total_units}")

    def rank_done(self, rank: int, nbytes: int | None = None, note: str = "") -> None:
        self.step_done()
        if self._bar is None:
            elapsed = time.monotonic() - self.started
            size = f", {human_size(nbytes)}" if nbytes is not None else ""
            log.info("%s: target rank %d done%s%s (%d/%d ranks, %.1f s)", self.desc, rank, size,
                     f", {note}" if note else "", self.done_units, self.total_units, elapsed)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._redirect.close()
