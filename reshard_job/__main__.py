"""``python -m reshard_job [overrides]``: the Hydra batch job, a thin entry over the job's stages.

Exit status: 0 done; 2 the job refused or failed (bad configuration, bad input, unusable output
location, an I/O or database failure) with one line on stderr naming what is at fault; 1 an
internal error (a bug: the traceback is printed); 130 / 143 interrupted by SIGINT / SIGTERM
(rerunning the same command resumes); 141 stdout closed early (``| head``), as Unix tools do.
``HYDRA_FULL_ERROR=1`` adds the traceback to one-line errors.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys

EXIT_ERROR = 2
EXIT_BUG = 1
EXIT_PIPE = 141
_USER_FULL_ERROR = "RESHARD_JOB_FULL_ERROR"


def _conf_dir() -> str:
    # Inside the package, so an installed wheel finds it however the app starts (python -m, the
    # reshard-job script, main() called from other code).
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "conf")


def _hydra_app():
    """The Hydra application, built on first use: importing Hydra is most of the start-up time, and
    it happens after the signal handlers are in place."""
    import hydra

    import reshard_job.job.config.schema as schema

    schema.register()
    _compose_once()
    return hydra.main(version_base="1.3", config_path=_conf_dir(), config_name="config")(app)


def _compose_once() -> None:
    """Hydra 1.3 composes the whole configuration twice: once only to read ``hydra.mode``, then
    for the run. Our configuration never sets ``hydra.mode``, so unless the command line does, the
    answer is known without composing (None: Hydra then picks RUN, or MULTIRUN for ``-m``) — a
    quarter of the start-up time of ``job.mode=plan``."""
    try:
        from hydra._internal.hydra import Hydra
    except ImportError:  # another Hydra layout: compose twice, as Hydra does
        return
    original = getattr(Hydra, "get_mode", None)
    if original is None or getattr(original, "_reshard_job", False):
        return

    def get_mode(self, config_name, overrides):
        if config_name != "config" or any("hydra.mode" in o or o.lstrip("~+").startswith("hydra") and "mode" in o
                                          for o in overrides):
            return original(self, config_name=config_name, overrides=overrides)
        return None

    get_mode._reshard_job = True
    Hydra.get_mode = get_mode


def app(cfg) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from reshard_job.job.stages.report import run_summary
    from reshard_job.job.runner import STATUS_FAILED, JobResult, run_job
    from reshard_job.job.config.settle import settle
    from reshard_job.job.config.spec import JobContext

    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    ctx = JobContext(launch_dir=hc.runtime.cwd, run_dir=hc.runtime.output_dir, overrides=tuple(hc.overrides.task),
                     sweep_id=os.path.abspath(os.path.join(hc.runtime.cwd, hc.sweep.dir)) if multirun else None,
                     job_num=hc.job.num if multirun else None, choices=dict(hc.runtime.choices), from_presets=True)
    try:
        from reshard_job.job.run.signals import raise_pending

        raise_pending()  # a Ctrl-C while starting up stops the job here, before anything is done
        _collect_from_now_on()
        result = run_job(settle(cfg, ctx), emit=_print)
    except _user_errors() as e:
        _scrub_saved_config(ctx.run_dir)
        if os.environ.get(_USER_FULL_ERROR) == "1":
            raise
        line = _error_line(e)
        print(line, file=sys.stderr)
        _log_to_file(line)
        _write_result(ctx, JobResult(getattr(e, "status", STATUS_FAILED), run_id=getattr(e, "run_id", None),
                                     error=line))
        if not multirun:
            sys.exit(getattr(e, "exit_code", EXIT_ERROR))
        from reshard_job.job.cli.sweep_summary import FAILED

        FAILED.append(1)
        return
    from reshard_job.job.run.signals import ignore

    ignore()  # the conversion is committed: a late Ctrl-C has nothing left to stop
    _scrub_saved_config(ctx.run_dir)
    _write_result(ctx, result)
    _print(run_summary(result))


def _pause_collection_for_startup() -> bool:
    """Start-up (imports, composing the configuration) allocates hundreds of thousands of objects
    and frees few: the cyclic garbage collector ran ~145 times over them for nothing, about a tenth
    of a ``job.mode=plan`` run. Paused until the job begins. True if it was running."""
    running = gc.isenabled()
    gc.disable()
    return running


def _collect_from_now_on() -> None:
    """Resume collecting when the job begins; what start-up built lives as long as the process, so
    it is frozen out of later collections (a multirun's later jobs find the collector running)."""
    if _STARTUP_PAUSED and not gc.isenabled():
        gc.freeze()
        gc.enable()


_STARTUP_PAUSED = False


def _user_errors():
    from reshard_job.errors import ReshardError
    from reshard_job.job.run.signals import Interrupted

    return (ReshardError, Interrupted)


def _error_line(e: BaseException) -> str:
    from reshard_job.job.run.signals import Interrupted

    if isinstance(e, Interrupted):
        e.status = "interrupted"
        return f"reshard_job: {e}: rerun the same command to resume"
    from reshard_job.secrets import mask_url
    from reshard_job.text import shorten

    return f"reshard_job: error: {shorten(mask_url(str(e)), 2000)}"


def _log_to_file(line: str) -> None:
    """The error line also goes into the run's log file (not again to the console)."""
    record = logging.LogRecord("reshard_job", logging.ERROR, __file__, 0, line, None, None)
    for h in logging.getLogger().handlers:
        if isinstance(h, logging.FileHandler):
            h.handle(record)


def _write_result(ctx, result) -> None:
    from reshard_job.job.cli.sweep_summary import RESULT_FILE
    from reshard_job.secrets import mask_config, mask_text

    doc = mask_config(result.to_json())
    doc.update(job_num=ctx.job_num, overrides=[mask_text(o) for o in ctx.overrides])
    os.makedirs(ctx.run_dir, exist_ok=True)
    with open(os.path.join(ctx.run_dir, RESULT_FILE), "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)


def _scrub_saved_config(run_dir: str) -> None:
    """Hydra saves the composed config and the command line under .hydra/: mask credentials there."""
    from reshard_job.secrets import mask_text

    folder = os.path.join(run_dir, ".hydra")
    for name in ("config.yaml", "overrides.yaml", "hydra.yaml"):
        path = os.path.join(folder, name)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
            masked = mask_text(text)
            if masked != text:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(masked)
        except OSError:
            continue


def _print(text: str) -> None:
    """Print to stdout; a reader that went away (``| head -1``) ends the job quietly, as Unix tools do."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        _quiet_exit()


def _quiet_exit() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except OSError:
        pass
    os._exit(EXIT_PIPE)


def main() -> None:
    """Run the Hydra app; configuration errors (unknown preset, bad override) become one line.

    Hydra prints such errors over several lines itself unless HYDRA_FULL_ERROR=1, in which case it
    re-raises them; we set it to catch them here, and keep the user's own setting, which still
    gives full tracebacks.
    """
    if "--version" in sys.argv[1:] or "-V" in sys.argv[1:]:
        from reshard_job import __version__

        _print(f"reshard_job {__version__}")
        return
    global _STARTUP_PAUSED
    _STARTUP_PAUSED = was_collecting = _pause_collection_for_startup()
    try:
        _main()
    finally:
        if was_collecting:
            gc.enable()  # main() called from other code leaves the collector as it found it


def _main() -> None:
    from reshard_job.job.run.signals import Interrupted, interruptible, raise_pending

    logging.raiseExceptions = False  # a log line to a closed pipe must not print a traceback
    os.environ.setdefault(_USER_FULL_ERROR, os.environ.get("HYDRA_FULL_ERROR", "0"))
    user_full = os.environ[_USER_FULL_ERROR] == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        with interruptible(deferred=True):  # from the first instant: noted, raised when the job begins
            _hydra_app()()
            raise_pending()
    except Interrupted as e:  # before the job started (importing, composing the configuration)
        print(f"reshard_job: {e}: rerun the same command to resume", file=sys.stderr)
        sys.exit(e.exit_code)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BrokenPipeError:
        _quiet_exit()
    except Exception as e:
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException

        if user_full or not isinstance(e, (HydraException, OmegaConfBaseException)):
            raise
        from reshard_job.job.cli.messages import one_line

        print(f"reshard_job: error: {one_line(e)}", file=sys.stderr)
        sys.exit(EXIT_ERROR)
    finally:
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            _quiet_exit()
    from reshard_job.job.cli.sweep_summary import FAILED

    if FAILED:
        sys.exit(EXIT_ERROR)


if __name__ == "__main__":
    main()
