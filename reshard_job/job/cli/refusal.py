"""How a refused or interrupted job is told: one line on stderr and in the run's log file.

``RESHARD_JOB_FULL_ERROR=1`` (or the user's own ``HYDRA_FULL_ERROR=1``, which ``app.main`` keeps
there) re-raises instead, for the traceback.
"""

from __future__ import annotations

USER_FULL_ERROR = "RESHARD_JOB_FULL_ERROR"


def interrupted_line(what: str) -> str:
    """The line of an interrupted job, `what` saying by which signal (``interrupted (SIGINT)``)."""
    return f"reshard_job: {what}: rerun the same command to resume"


def user_errors() -> tuple[type[BaseException], ...]:
    """What a job refuses or stops with (told in one line), as opposed to bugs (a traceback)."""
    from reshard_job.errors import ReshardError
    from reshard_job.job.run.signals import Interrupted

    return (ReshardError, Interrupted)


def error_line(e: BaseException) -> str:
    """The one line for `e`: an interruption says how to resume; an error is shortened and masked."""
    from reshard_job.job.run.signals import Interrupted

    if isinstance(e, Interrupted):
        e.status = "interrupted"
        return interrupted_line(str(e))
    from reshard_job.secrets import mask_url
    from reshard_job.text import one_line_of, shorten

    return f"reshard_job: error: {one_line_of(shorten(mask_url(str(e)), 2000))}"


def log_to_file(line: str) -> None:
    """The error line also goes into the run's log file (not again to the console)."""
    import logging  # here, not at the top: the app imports this module before its signal handlers

    record = logging.LogRecord("reshard_job", logging.ERROR, __file__, 0, line, None, None)
    for h in logging.getLogger().handlers:
        if isinstance(h, logging.FileHandler):
            h.handle(record)
