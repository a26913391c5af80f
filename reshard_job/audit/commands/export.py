"""``openlineage [RUN...] [--output FILE]``: recorded runs as OpenLineage run events, one JSON object
per line (the file transport's format), for lineage tools to ingest (see ``audit.openlineage``)."""

from __future__ import annotations

import json

from reshard_job import __version__
from reshard_job.audit.commands.base import Answer


def add_parser(commands, common) -> None:
    export = commands.add_parser("openlineage", parents=[common],
                                 help="recorded runs as OpenLineage run events (JSON lines, oldest first)")
    export.add_argument("runs", metavar="RUN", nargs="*", help="run ids or prefixes (default: every run)")
    export.add_argument("--output", metavar="FILE", help="write the events to FILE instead of stdout")


def _openlineage(session, args) -> Answer:
    from reshard_job.audit.entities import RunInfo
    from reshard_job.audit.lookup import resolve_run_id
    from reshard_job.audit.openlineage import run_event
    from reshard_job.audit.queries import list_runs, run_files
    from reshard_job.lineage.models import Run

    run_ids = [resolve_run_id(session, ref) for ref in args.runs] or [run.id for run in list_runs(session)]
    events = []
    for run_id in run_ids:
        run = session.get(Run, run_id)
        events.append(run_event(RunInfo.from_model(run), run.config, run_files(session, run_id), __version__))
    return Answer(events, lambda found: "\n".join(json.dumps(event, sort_keys=True) for event in found))


HANDLERS = {"openlineage": _openlineage}
