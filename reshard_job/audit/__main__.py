"""``python -m reshard_job.audit``."""

import sys

from reshard_job.audit.cli import main

sys.exit(main())
