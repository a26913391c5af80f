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
