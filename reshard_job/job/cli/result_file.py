"""``result.json``: each job's outcome in its run directory, masked, for scripts and the sweep summary.

A sweep's summary (``sweep_summary``) reads the files back from every job directory, so it works
whichever launcher ran the jobs. The file is replaced atomically: a reader never sees half of it.
"""

from __future__ import annotations

import json
import os

RESULT_FILE = "result.json"


def write_result(ctx, result) -> None:
    """Write `result` (a ``JobResult``) with the job's number and command line, credentials masked."""
    from reshard_job.secrets import mask_config, mask_text
    from reshard_job.storage.atomic import write_bytes_atomic

    doc = mask_config(result.to_json())
    doc.update(job_num=ctx.job_num, overrides=[mask_text(o) for o in ctx.overrides])
    # mode 0o644 (as the umask allows): a plain file that scripts may edit or remove, like a run's logs
    write_bytes_atomic(os.path.join(ctx.run_dir, RESULT_FILE), json.dumps(doc, indent=1).encode("utf-8"),
                       mode=0o644)
