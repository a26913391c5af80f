"""The cyclic garbage collector, paused while the app starts up.

Start-up (imports, composing the configuration) allocates hundreds of thousands of objects and
frees few: the cyclic garbage collector ran ~145 times over them for nothing, about a tenth of a
``job.mode=plan`` run. It is paused until the job begins.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

_paused = False  # True while this process's start-up paused a running collector


@contextlib.contextmanager
def paused_for_startup() -> Iterator[None]:
    """Pause collecting for the app's start-up; on the way out the collector is left as it was
    found (``main()`` called from other code)."""
    global _paused
    _paused = was_collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_collecting:
            gc.enable()


def collect_from_now_on() -> None:
    """Resume collecting when the job begins; what start-up built lives as long as the process, so
    it is frozen out of later collections (a multirun's later jobs find the collector running)."""
    if _paused and not gc.isenabled():
        gc.freeze()
        gc.enable()
