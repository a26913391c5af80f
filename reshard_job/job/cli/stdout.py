"""Printing to stdout: a reader that went away (``| head -1``) ends the job quietly, as Unix tools do."""

from __future__ import annotations

import os
import sys

from reshard_job.job.cli.exit_codes import EXIT_PIPE


def emit(text: str) -> None:
    """Print to stdout, every line shown as a terminal only shows it (a folder named with ESC[2J is
    named, not obeyed); a reader that went away (``| head -1``) ends the job quietly, as Unix tools do."""
    from reshard_job.text import one_line_of

    try:
        print("\n".join(map(one_line_of, text.split("\n"))), flush=True)
    except BrokenPipeError:
        quiet_exit()


def quiet_exit() -> None:
    """Exit with ``EXIT_PIPE`` at once, stdout pointed at /dev/null so that nothing flushes into the
    closed pipe on the way out (which would print a second BrokenPipeError)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except OSError:
        pass
    os._exit(EXIT_PIPE)
