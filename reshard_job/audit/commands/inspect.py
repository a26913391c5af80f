"""``runs``, ``show``, ``trace``, ``verify`` and ``graph``: questions answered in one read session.

Each handler takes the open session and the parsed arguments and returns an ``Answer``; the
command line prints it as text or JSON once the answer is complete (nothing lazy-loads later).
"""

from __future__ import annotations

import os

from reshard_job import __version__
from reshard_job.audit.commands.base import (EXIT_MISMATCH, EXIT_OK, EXIT_UNRECORDED, Answer, UsageError, parse_when,
                                             positive)

PICTURE_SUFFIXES = {".dot": "dot", ".gv": "dot", ".svg": "svg", ".html": "html", ".htm": "html"}


def add_parsers(commands, common) -> None:
    from reshard_job.audit.drawing import FORMATS
    from reshard_job.lineage.status import RunStatus

    runs = commands.add_parser("runs", parents=[common], help="list runs")
    runs.add_argument("--status", choices=RunStatus.values(), help="only runs in this status")
    runs.add_argument("--since", metavar="DATE", type=parse_when, help="started at or after (UTC)")
    runs.add_argument("--until", metavar="DATE", type=lambda t: parse_when(t, end_of_day=True),
                      help="started before the end of this day / before this time (UTC)")
    runs.add_argument("--output-dir", metavar="PATH",
                      help="runs that wrote into PATH or a directory under it, or wrote the file PATH")
    runs.add_argument("--sweep", metavar="ID", help="runs of this sweep (its directory, as 'show' prints it)")
    runs.add_argument("--user", metavar="NAME", help="runs started by this user")
    runs.add_argument("--limit", type=positive, metavar="N", help="only the newest N runs")

    show = commands.add_parser("show", parents=[common], help="config, inputs, outputs and rank map of a run")
    show.add_argument("run", metavar="RUN", help="run id or a unique prefix of 8+ characters")

    trace = commands.add_parser("trace", parents=[common],
                                help="where a file came from (or, with --descendants, what was built from it)")
    trace.add_argument("target", metavar="REF", help="a file, an output directory, a sha256 or a prefix of one")
    trace.add_argument("--descendants", action="store_true",
                       help="follow the file forwards: the runs that read it and what they wrote, to the end")

    verify = commands.add_parser("verify", parents=[common], help="re-hash recorded files and compare")
    verify.add_argument("target", metavar="REF",
                        help="a run id, a sha256 (or a prefix of 8+ characters of either), a file, "
                             "or an output directory")
    verify.add_argument("--inputs", action="store_true", help="for a run, also check its input files")

    graph = commands.add_parser("graph", parents=[common], help="draw the lineage as DOT, SVG or HTML")
    graph.add_argument("target", metavar="REF", help="a file, an output directory, a sha256 or a run id (or prefix)")
    graph.add_argument("--descendants", action="store_true", help="draw what was built from it instead")
    graph.add_argument("--format", choices=FORMATS, default=None,
                       help="picture format (default: from --output's suffix, else dot)")
    graph.add_argument("--output", metavar="FILE", help="write the picture to FILE instead of stdout")


def _runs(session, args) -> Answer:
    import reshard_job.audit.render as render
    from reshard_job.audit.queries import RunFilter, list_runs

    if args.since and args.until and args.since >= args.until:
        raise UsageError("--since must be before --until")
    run_filter = RunFilter(status=args.status, since=args.since, until=args.until, output=args.output_dir,
                           sweep_id=args.sweep, user=args.user, limit=args.limit)
    return Answer(list_runs(session, run_filter), render.runs_table)


def _show(session, args) -> Answer:
    import reshard_job.audit.render as render
    from reshard_job.audit.lookup import resolve_run_id
    from reshard_job.audit.queries import shown_run

    return Answer(shown_run(session, resolve_run_id(session, args.run)), render.shown_run)


def _direction(args) -> str:
    from reshard_job.audit.entities import ANCESTORS, DESCENDANTS

    return DESCENDANTS if args.descendants else ANCESTORS


def _trace(session, args) -> Answer:
    import reshard_job.audit.render as render
    from reshard_job.audit.trace import trace_reference

    return Answer(trace_reference(session, args.target, _direction(args)), render.trace_tree)


def _verify(session, args) -> Answer:
    import reshard_job.audit.render as render
    from reshard_job.audit.verify import verify

    report = verify(session, args.target, include_inputs=args.inputs)
    code = EXIT_OK if report.intact else EXIT_UNRECORDED if report.complete_unrecorded else EXIT_MISMATCH
    return Answer(report, render.verify_report, code)


def _picture_format(args) -> str:
    if args.format:
        return args.format
    suffix = os.path.splitext(args.output or "")[1].lower()
    return PICTURE_SUFFIXES.get(suffix, "dot")


def _title(trace) -> str:
    from reshard_job.audit.drawing import shorten
    from reshard_job.audit.entities import ANCESTORS
    from reshard_job.audit.render import SHORT_DIGEST, SHORT_RUN_ID

    query = trace.query
    if "run_id" in query:
        subject = f"run {query['run_id'][:SHORT_RUN_ID]}"
    elif "manifest" in query:
        subject = os.path.basename(query["path"].rstrip(os.sep)) + os.sep
    elif query.get("path"):
        parent, base = os.path.split(query["path"])
        subject = f"{os.path.basename(parent)}/{base}" if os.path.basename(parent) else base
    else:
        subject = f"sha256 {query.get('sha256', '')[:SHORT_DIGEST]}"
    what = "Lineage of" if trace.direction == ANCESTORS else "Built from"
    return f"{what} {shorten(subject, 60)}"


def _graph(session, args) -> Answer:
    from reshard_job.audit.drawing import draw
    from reshard_job.audit.graph import graph_of
    from reshard_job.audit.trace import trace_reference

    traced = trace_reference(session, args.target, _direction(args))
    graph = graph_of(traced, _title(traced))
    picture = draw(graph, _picture_format(args), tool_version=__version__)
    return Answer(picture, lambda text: text.rstrip("\n"), to_json=lambda _: graph.to_json())


HANDLERS = {"runs": _runs, "show": _show, "trace": _trace, "verify": _verify, "graph": _graph}
