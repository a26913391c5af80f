"""Progress display: a tqdm bar (bytes and ranks) on a terminal, plain log lines otherwise."""

from __future__ import annotations

import logging
import sys
import time

from ..text import human_size

log = logging.getLogger("reshard_job")


class Progress:
    def __init__(self, total_bytes: int, total_ranks: int, *, enabled: bool | None = None, desc: str = "converting"):
        self.total_bytes = total_bytes
        self.total_ranks = total_ranks
        self.done_bytes = 0
        self.done_ranks = 0
        self.desc = desc
        self.started = time.monotonic()
        if enabled is None:
            enabled = sys.stderr.isatty()
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                             file=sys.stderr, dynamic_ncols=True, leave=True)
            self._bar.set_postfix_str(f"ranks 0/{total_ranks}")

    def add_bytes(self, n: int) -> None:
        self.done_bytes += n
        if self._bar is not None:
            self._bar.update(n)

    def rank_done(self, rank: int, nbytes: int | None = None, note: str = "") -> None:
        self.done_ranks += 1
        if self._bar is not None:
            self._bar.set_postfix_str(f"ranks {self.done_ranks}/{self.total_ranks}")
        else:
            elapsed = time.monotonic() - self.started
            size = f", {human_size(nbytes)}" if nbytes is not None else ""
            log.info("%s: target rank %d done%s%s (%d/%d ranks, %.1f s)", self.desc, rank, size,
                     f", {note}" if note else "", self.done_ranks, self.total_ranks, elapsed)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def parse_bytes(value) -> int:
    """'256MiB', '1GB', '512k', 1048576 -> bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = str(value).strip().replace(" ", "")
    units = {"": 1, "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1024**2, "mb": 1000**2, "mib": 1024**2,
             "g": 1024**3, "gb": 1000**3, "gib": 1024**3, "t": 1024**4, "tb": 1000**4, "tib": 1024**4}
    num = text.rstrip("bBkKmMgGtTiI")
    unit = text[len(num):].lower()
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (try e.g. 512MiB)") from None
    if unit not in units:
        raise ValueError(f"unknown size unit in {text!r} (use KiB, MiB, GiB)")
    return int(value * units[unit])
