"""The Hydra task function: one job for one composed configuration (each job of a sweep, too).

It settles the configuration into a ``JobSpec``, runs the job, writes ``result.json`` and prints the
summary. A refusal or an interruption is one line (``refusal``); in a sweep a refusal is noted for
the exit status and the sweep goes on with its next job, and an interruption ends the sweep.
"""

from __future__ import annotations

import os
import sys

from reshard_job.job.cli.exit_codes import EXIT_ERROR
from reshard_job.job.cli.stdout import emit


def run_task(cfg) -> None:
    """Settle `cfg`, run the job, record and print its outcome (the function ``@hydra.main`` wraps)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from reshard_job.job.stages.report import run_summary
    from reshard_job.job.runner import run_job
    from reshard_job.job.config.settle import settle
    from reshard_job.job.run.signals import ignore, raise_pending, stop_before_next_job
    from reshard_job.job.cli import startup_gc
    from reshard_job.job.cli.refusal import USER_FULL_ERROR, user_errors
    from reshard_job.job.cli.result_file import write_result
    from reshard_job.job.run import held_logs

    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    ctx = _context(hc, multirun)
    held_logs.hold()  # a refusal is its one line alone (the log file keeps every line)
    try:
        raise_pending()  # a Ctrl-C while starting up stops the job here, before anything is done
        startup_gc.collect_from_now_on()
        result = run_job(settle(cfg, ctx), emit=emit)
    except user_errors() as e:
        if os.environ.get(USER_FULL_ERROR) == "1":
            held_logs.release()
            raise
        held_logs.drop()
        _refused(e, ctx, multirun)
        return
    finally:
        held_logs.release()  # a plan, a no-op, a bug's traceback: what was logged is printed (dropped: nothing)
    if multirun:  # the conversion is committed: a later Ctrl-C stops the sweep's next jobs
        stop_before_next_job()
    else:  # nothing left to stop
        ignore()
    write_result(ctx, result)
    emit(run_summary(result))


def _context(hc, multirun: bool):
    """The job's ``JobContext`` from Hydra's runtime configuration."""
    from reshard_job.job.config.spec import JobContext

    return JobContext(launch_dir=hc.runtime.cwd, run_dir=hc.runtime.output_dir, overrides=tuple(hc.overrides.task),
                      sweep_id=os.path.abspath(os.path.join(hc.runtime.cwd, hc.sweep.dir)) if multirun else None,
                      job_num=hc.job.num if multirun else None, choices=dict(hc.runtime.choices),
                      from_presets=True)


def _refused(e: BaseException, ctx, multirun: bool) -> None:
    """Tell a refused or interrupted job in one line and record it in ``result.json``; a single run
    exits with the error's status, a sweep notes the failure and goes on."""
    from reshard_job.job.cli.refusal import error_line, log_to_file
    from reshard_job.job.cli.result_file import write_result
    from reshard_job.job.runner import STATUS_FAILED, JobResult

    line = error_line(e)
    print(line, file=sys.stderr)
    log_to_file(line)
    write_result(ctx, JobResult(getattr(e, "status", STATUS_FAILED), run_id=getattr(e, "run_id", None), error=line))
    if not multirun or _interrupted(e):  # Ctrl-C (or SIGTERM) stops the sweep, not only its current job
        sys.exit(getattr(e, "exit_code", EXIT_ERROR))
    from reshard_job.job.cli.sweep_summary import FAILED

    FAILED.append(1)


def _interrupted(e: BaseException) -> bool:
    from reshard_job.job.run.signals import Interrupted

    return isinstance(e, Interrupted)
