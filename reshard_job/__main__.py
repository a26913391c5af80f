"""``python -m reshard_job [overrides]``: the Hydra batch job (``job.cli.app``), and the
``reshard-job`` script's ``main``."""

import sys

try:
    from reshard_job.job.cli.app import main
except KeyboardInterrupt:  # Ctrl-C while the app's first modules load, before its signal handlers exist
    from reshard_job.job.cli.exit_codes import EXIT_INTERRUPTED
    from reshard_job.job.cli.refusal import interrupted_line

    print(interrupted_line("interrupted (SIGINT)"), file=sys.stderr)
    sys.exit(EXIT_INTERRUPTED)

if __name__ == "__main__":
    main()
