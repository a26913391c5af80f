"""``record --consumer NAME --inputs PATH... [--outputs PATH...]``: another program's use of files.

The one audit command that writes: it records a completed run (``lineage.uses.record_use``), so
the database is created and migrated as a job's would be. Prints the run id (``--json``: the id,
consumer and the files recorded with their sha256).
"""

from __future__ import annotations

import json

from reshard_job.audit.commands.base import EXIT_ERROR, EXIT_OK
from reshard_job.audit.commands.database import database_url
from reshard_job.audit.commands.output import complain, write
from reshard_job.lineage.errors import driver_detail


def add_parser(commands, common) -> None:
    record = commands.add_parser("record", parents=[common],
                                 help="record that another program read these files (and wrote those)")
    record.add_argument("--consumer", metavar="NAME", required=True,
                        help="who used the files: a fine-tuning run, an evaluation, a service")
    record.add_argument("--inputs", metavar="PATH", nargs="+", required=True,
                        help="files or folders it read (a folder: every file under it)")
    record.add_argument("--outputs", metavar="PATH", nargs="+", default=[],
                        help="files or folders it wrote (the model trained from the inputs)")


def run(args) -> int:
    from sqlalchemy.exc import SQLAlchemyError

    from reshard_job.errors import ReshardError
    from reshard_job.lineage.uses import record_use
    from reshard_job.secrets import mask_url

    url = database_url(args)
    try:
        run_id = record_use(args.consumer, args.inputs, args.outputs, lineage_url=url)
    except ReshardError as exc:
        complain(f"error: {exc}")
        return EXIT_ERROR
    except OSError as exc:
        complain(f"error: {getattr(exc, 'filename', None) or ''}: cannot read ({exc.strerror or exc})")
        return EXIT_ERROR
    except SQLAlchemyError as exc:
        detail = driver_detail(exc)
        complain(f"error: cannot record in the lineage database {mask_url(url)}: {mask_url(detail)}")
        return EXIT_ERROR
    if getattr(args, "json", False):
        write(json.dumps({"run_id": run_id, "consumer": args.consumer, "database": mask_url(url)}, indent=2))
    else:
        write(f"recorded run {run_id} ({args.consumer}) in {mask_url(url)}")
    return EXIT_OK
