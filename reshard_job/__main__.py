"""``python -m reshard_job [overrides]``: the Hydra batch job (``job.cli.app``), and the
``reshard-job`` script's ``main``."""

from reshard_job.job.cli.app import main

if __name__ == "__main__":
    main()
