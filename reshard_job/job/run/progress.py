"""Progress display: a tqdm bar (bytes and ranks) on a terminal, plain log lines otherwise.

While a bar is on screen, the job's log lines are routed through tqdm
(``logging_redirect_tqdm``), so a line is printed above the bar instead of being glued onto it. A
bar with nothing to do (all digests cached) is not drawn at all, and a terminal that reports zero
columns gets a bar of a sensible width instead of blank lines.
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

        columns = shutil.get_terminal_size((0, 0)).columns
        self._bar = tqdm(total=self.total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=self.desc,
                         file=sys.stderr, leave=True, dynamic_ncols=columns >= MIN_COLUMNS,
                         ncols=None if columns >= MIN_COLUMNS else 100)
        self._bar.set_postfix_str(f"{self.unit} 0/{self.total_units}")
        self._redirect.enter_context(logging_redirect_tqdm([logging.getLogger("reshard_job")]))

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
