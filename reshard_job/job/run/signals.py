"""Stopping cleanly on SIGINT and SIGTERM.

While a job runs, the first SIGINT (Ctrl-C) or SIGTERM raises ``Interrupted`` in the main thread,
so the job unwinds like on any error: workers are killed, temporary files removed, the output lock
released, the lineage run marked interrupted, one line printed, exit status 130 or 143. The
handlers are then back to the defaults, so a second Ctrl-C ends the process at once.

Before the job starts (importing, Hydra composing the configuration) the signal is only noted
(``deferred``) and raised when the job begins: code we do not own is not safe against an exception
at any instant (Hydra's config loader then fails with an error of its own), and there is nothing to
clean up yet.

A signal also ends every wait for a locked lineage database (``lineage.waiting.request_stop``), in
whatever thread it waits: the job records its lineage in a thread of its own, where no exception
from a handler arrives, and the main thread's unwinding waits for that thread.

This module imports only the standard library (the lineage package, which loads numpy, when a job
begins): the app puts the deferring handlers in place in the first milliseconds of the process, and
until then a Ctrl-C is Python's KeyboardInterrupt, a traceback instead of the interrupted line.

Once the job's result is committed (``committing``), signals are dropped until the next job begins,
by the job's handler and by the deferring one around it alike: after the summary says completed, an
exit status of 130 would contradict it. In a sweep a signal after a job's commit is noted instead
(``stop_before_next_job``) and stops the sweep before its next job.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
_pending: list[int] = []
_committed: list[bool] = []  # set by ``committing``: the result is recorded, signals no longer interrupt
# until the next job begins


class Interrupted(BaseException):
    """The job was asked to stop (a BaseException, like KeyboardInterrupt: no handler swallows it)."""

    def __init__(self, signum: int):
        self.signum = signum
        self.exit_code = EXIT_CODES.get(signum, 128 + signum)
        name = signal.Signals(signum).name if signum in signal.Signals._value2member_map_ else str(signum)
        super().__init__(f"interrupted ({name})")


def raise_pending() -> None:
    """Raise ``Interrupted`` for a signal noted while interrupts were deferred."""
    if _pending:
        raise Interrupted(_pending[0])


@contextmanager
def interruptible(deferred: bool = False):
    """Turn SIGINT/SIGTERM into ``Interrupted`` for the duration (main thread only; a no-op elsewhere);
    `deferred`: only note it, for ``raise_pending`` to raise at a safe point."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raise_pending()
    previous = {s: signal.getsignal(s) for s in EXIT_CODES}
    _committed.clear()  # the app or a job begins: a commit of an earlier one in this process is not its own
    waits = None
    if not deferred:  # a job begins: nor is a stop asked of an earlier job
        from reshard_job.lineage import waiting as waits

        waits.clear_stop()

    def handler(signum, frame):
        if _committed:  # the run is recorded completed: exiting 130 now would contradict it
            return
        for s in EXIT_CODES:  # a second signal acts at once
            signal.signal(s, signal.SIG_DFL)
        if waits is not None:  # lineage waits, in any thread, end as the job does (none before it begins)
            waits.request_stop(str(Interrupted(signum)))
        if deferred:
            _pending.append(signum)
            return
        raise Interrupted(signum)

    for s in EXIT_CODES:
        signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in previous.items():
            if signal.getsignal(s) is handler:  # not when ignore() or a first signal changed it since
                signal.signal(s, h)
        if waits is not None:
            waits.clear_stop()


@contextmanager
def _noting(noted: list[int]):
    """Replace the callable SIGINT/SIGTERM handlers by ones that only note the signal in `noted`;
    yield the handlers replaced (to act later as they would have), then put them back."""
    previous = {s: signal.getsignal(s) for s in EXIT_CODES}
    held_here = [s for s, h in previous.items() if callable(h)]
    for s in held_here:
        signal.signal(s, lambda signum, frame: noted.append(signum))
    try:
        yield previous
    finally:
        for s in held_here:
            signal.signal(s, previous[s])


@contextmanager
def held():
    """Hold SIGINT/SIGTERM while code we do not own runs (a database driver closing its connection
    logs an exception raised inside it with a traceback), then act on a signal that came meanwhile
    as the handler in place would have. Where signals act at once already (after a first one) or
    are ignored, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted: list[int] = []
    with _noting(noted) as previous:
        yield
    if noted:
        previous[noted[0]](noted[0], None)


@contextmanager
def committing():
    """The block commits the job's result (marks the lineage run completed). A signal during it waits
    for the outcome: if the block fails, it acts then as it would have; once the block succeeded,
    it and later ones are dropped until the next job begins (the deferring handler of the app, back
    in place when the job's ``interruptible`` ends, drops them too), since the outputs are complete
    and recorded so: an exit status of 130 would contradict the record."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted: list[int] = []
    previous: dict = {}
    try:
        with _noting(noted) as replaced:
            previous = replaced
            yield
            _committed.append(True)
    finally:
        if noted and not _committed:
            previous[noted[0]](noted[0], None)


def ignore() -> None:
    """After the result is committed there is nothing left to stop: signals no longer interrupt."""
    if threading.current_thread() is threading.main_thread():
        for s in EXIT_CODES:
            signal.signal(s, signal.SIG_IGN)


def stop_before_next_job() -> None:
    """In a sweep, once a job's result is committed: a signal from now on is noted (the app's
    deferring handler) and stops the sweep as its next job begins, rather than being dropped."""
    _committed.clear()
