"""``job.run.signals.committing``: a signal arriving while the run is marked completed neither
breaks the commit nor turns a recorded success into an "interrupted" exit; a signal during a commit
that fails still interrupts. Real signals sent to this process (main thread)."""

from __future__ import annotations

import os
import signal

import pytest

from reshard_job.job.run.signals import Interrupted, committing, interruptible


def test_a_signal_during_a_successful_commit_is_dropped_and_later_ones_too():
    steps = []
    with interruptible():
        with committing():
            os.kill(os.getpid(), signal.SIGINT)
            steps.append("committed")  # the commit went on to its end
        os.kill(os.getpid(), signal.SIGTERM)
        steps.append("after")
    assert steps == ["committed", "after"]


def test_a_signal_during_a_failed_commit_interrupts_when_it_fails():
    with pytest.raises(Interrupted) as caught:
        with interruptible():
            with committing():
                os.kill(os.getpid(), signal.SIGTERM)
                raise OSError("database gone")
    assert caught.value.exit_code == 143


def test_after_the_job_signals_interrupt_again():
    with interruptible():
        with committing():
            pass
    with pytest.raises(Interrupted):
        with interruptible():
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # the handler runs between bytecodes
                pass


def test_after_a_commit_the_deferring_handler_around_the_job_drops_signals_too():
    """The app's deferring handler is back in place once the job's ``interruptible`` ends, before the
    summary is printed: a Ctrl-C then must not turn the completed run into an exit 130."""
    from reshard_job.job.run import signals

    try:
        with interruptible(deferred=True):
            with interruptible():
                with committing():
                    pass
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # the handler runs between bytecodes
                pass
            signals.raise_pending()  # nothing noted: the run stays completed
    finally:
        signals._pending.clear()  # a failure here must not interrupt the tests that follow


def test_the_signal_module_loads_only_the_standard_library():
    """The app puts its handlers in place first thing; before, a Ctrl-C is a KeyboardInterrupt. What
    the app and this module import before that must stay light (numpy came through lineage)."""
    import subprocess
    import sys

    code = ("import sys; import reshard_job.__main__, reshard_job.job.run.signals; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in {'numpy', 'hydra', 'omegaconf', 'sqlalchemy'} "
            "or m.startswith(('reshard_job.lineage', 'reshard_job.formats'))))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]", loaded
