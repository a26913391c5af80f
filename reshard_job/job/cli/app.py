"""``python -m reshard_job [overrides]``: the Hydra batch job, a thin ``@hydra.main`` over ``task.run_task``.

Exit status: see ``exit_codes`` (0 done, 2 refused or failed with one line on stderr, 1 a bug with
its traceback, 130 / 143 interrupted, 141 stdout closed early). ``HYDRA_FULL_ERROR=1`` adds the
traceback to one-line errors.

Start-up time matters (``job.mode=plan`` takes well under a second): this module imports only the
standard library and the small modules beside it; Hydra, the configuration and the job are
imported when first used.
"""

from __future__ import annotations

import os
import sys

from reshard_job.job.cli import startup_gc
from reshard_job.job.cli.exit_codes import EXIT_ERROR, EXIT_INTERRUPTED
from reshard_job.job.cli.refusal import USER_FULL_ERROR, interrupted_line
from reshard_job.job.cli.stdout import emit, quiet_exit


def main() -> None:
    """Run the Hydra app; configuration errors (unknown preset, bad override) become one line.

    Hydra prints such errors over several lines itself unless HYDRA_FULL_ERROR=1, in which case it
    re-raises them; we set it to catch them here, and keep the user's own setting, which still
    gives full tracebacks.
    """
    try:
        if _answered_at_once(sys.argv[1:]):
            return
        with startup_gc.paused_for_startup():
            _run_hydra()
    except KeyboardInterrupt:  # Ctrl-C in the first milliseconds, before the job's handlers were in place
        _tell_interrupted("interrupted (SIGINT)")
        sys.exit(EXIT_INTERRUPTED)


def _answered_at_once(argv: list[str]) -> bool:
    """``--version`` and ``--help``, answered without Hydra (``--help`` from the schema)."""
    if "--version" in argv or "-V" in argv:
        from reshard_job import __version__

        emit(f"reshard_job {__version__}")
        return True
    from reshard_job.job.cli.help import help_text, wants_help

    if wants_help(argv):
        emit(help_text(conf_dir()))
        return True
    return False


def _tell_interrupted(what: str) -> None:
    print(interrupted_line(what), file=sys.stderr)


def _run_hydra() -> None:
    # First of all: the signal module imports only the standard library, so a Ctrl-C is noted within
    # the first milliseconds (before, Python raises KeyboardInterrupt: see ``main``).
    from reshard_job.job.run.signals import Interrupted, interruptible, raise_pending

    with interruptible(deferred=True):  # noted, raised when the job begins
        import logging

        logging.raiseExceptions = False  # a log line to a closed pipe must not print a traceback
        os.environ.setdefault(USER_FULL_ERROR, os.environ.get("HYDRA_FULL_ERROR", "0"))
        user_full = os.environ[USER_FULL_ERROR] == "1"
        os.environ["HYDRA_FULL_ERROR"] = "1"
        try:
            hydra_app()()
            raise_pending()
        except Interrupted as e:  # before the job started (importing, composing the configuration)
            _tell_interrupted(str(e))
            sys.exit(e.exit_code)
        except (SystemExit, KeyboardInterrupt):
            raise
        except BrokenPipeError:
            quiet_exit()
        except Exception as e:
            if user_full or not _is_configuration_error(e):
                raise  # a bug, or the user asked for full errors: the traceback
            from reshard_job.job.cli.messages import one_line
            from reshard_job.text import one_line_of

            print(f"reshard_job: error: {one_line_of(one_line(e))}", file=sys.stderr)
            sys.exit(EXIT_ERROR)
        finally:
            try:
                sys.stdout.flush()
            except BrokenPipeError:
                quiet_exit()
    from reshard_job.job.cli.sweep_summary import FAILED

    if FAILED:
        sys.exit(EXIT_ERROR)


def _is_configuration_error(e: Exception) -> bool:
    """Hydra's and OmegaConf's errors (unknown preset, bad override): told in one line."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    return isinstance(e, (HydraException, OmegaConfBaseException))


def hydra_app():
    """The Hydra application, built on first use: importing Hydra is most of the start-up time, and
    it happens after the signal handlers are in place."""
    import hydra

    import reshard_job.job.config.schema as schema
    from reshard_job.job.cli.hydra_mode import skip_mode_composition
    from reshard_job.job.cli.task import run_task

    schema.register()
    skip_mode_composition()
    return hydra.main(version_base="1.3", config_path=conf_dir(), config_name="config")(run_task)


def conf_dir() -> str:
    """The presets' folder, inside the package, so an installed wheel finds it however the app starts
    (python -m, the reshard-job script, main() called from other code)."""
    import reshard_job

    return os.path.join(os.path.dirname(os.path.abspath(reshard_job.__file__)), "conf")
