"""Audit CLI over the lineage database: ``python -m reshard_job.audit [--db URL] COMMAND [--json]``.

Commands:
  runs                       list runs (filters: --status, --since, --until, --output-dir, --sweep,
                             --user, --limit)
  show RUN                   config, inputs, outputs and rank map of one run
  trace REF [--descendants]  where a file came from, down to the original sources; or, with
                             --descendants, everything built from it, up to the final files
  verify REF                 re-hash recorded files; exit 1 if any is missing or changed
  graph REF [--descendants] [--format dot|svg|html] [--output FILE]
                             the lineage as a picture (stdout by default)
  compare A B [--a-strategy FILE] [--b-strategy FILE] [--weights]
                             whether two checkpoints hold the same parameters, whatever their
                             layouts and formats (by per-parameter fingerprints); exit 1 if not
  db current | db upgrade     the database's schema revision; ``upgrade`` brings it to this tool's
                             head, as every job does before recording, printing before and after

REF is a file path (looked up by its content), an output directory (the files its manifest
lists), a sha256, or a run id; digests and run ids may be shortened to a unique prefix of at
least 8 characters, as ``show`` and ``trace`` print them. ``--db`` (a URL, or the path of an SQLite
file) defaults to ``$RESHARD_LINEAGE_URL``, else ``runs/lineage.db`` under the current directory.

This module is argument parsing and printing only; answers come from ``reshard_job.lineage``
(``queries``, ``trace``, ``verify``, ``graph``), text from ``render`` and pictures from
``drawing``. The audit never changes the database but by ``db upgrade``: the other commands refuse
(one line, exit 2) a database whose schema is missing or at another revision. Like other Unix tools it
stops quietly when its reader goes away (``audit runs | head -1``), with status 141.

Exit codes: 0 success, 1 verification found missing or changed files or fingerprints that disagree
(``compare``: a parameter differs or is on one side only), 2 usage or lookup error, 130 interrupted,
141 output pipe closed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable

from reshard_job import __version__

EXIT_OK = 0
EXIT_MISMATCH = 1
EXIT_ERROR = 2
EXIT_INTERRUPTED = 128 + signal.SIGINT
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE

PICTURE_SUFFIXES = {".dot": "dot", ".gv": "dot", ".svg": "svg", ".html": "html", ".htm": "html"}


def parse_when(text: str, *, end_of_day: bool = False) -> dt.datetime:
    """An ISO date or date-time, in UTC unless it carries an offset.

    A bare date given to --until includes that whole day.
    """
    try:
        if len(text) == 10:
            day = dt.date.fromisoformat(text)
            moment = dt.datetime.combine(day, dt.time(), tzinfo=dt.timezone.utc)
            return moment + dt.timedelta(days=1) if end_of_day else moment
        moment = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a date (YYYY-MM-DD or YYYY-MM-DDTHH:MM): {text!r}") from None
    return moment if moment.tzinfo else moment.replace(tzinfo=dt.timezone.utc)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"not a positive whole number: {text!r}")
    return value


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not the whole usage block
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from reshard_job.audit.drawing import FORMATS
    from reshard_job.lineage.status import RunStatus

    # --db and --json are accepted before or after the command; SUPPRESS keeps a value given
    # before the command from being reset by the subparser's default.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--db", metavar="URL", default=argparse.SUPPRESS,
                        help="SQLAlchemy URL of the lineage database "
                             "(default: $RESHARD_LINEAGE_URL, else runs/lineage.db)")
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="print machine-readable JSON")

    invoked_as = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    prog = invoked_as if invoked_as.startswith("reshard-audit") else "python -m reshard_job.audit"
    parser = _ArgumentParser(
        prog=prog, parents=[common], description="Inspect the lineage of resharded checkpoints.",
        epilog="REF: a file path, an output directory, a sha256 or a run id; digests and run ids may be "
               "unique prefixes of 8 or more characters. Times are UTC. Exit status: 0 ok, 1 verify found "
               "missing or changed files or disagreeing fingerprints, or compare found a difference, 2 usage "
               "error or nothing found.")
    parser.add_argument("--version", action="version", version=f"reshard_job {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_ArgumentParser)
    commands.required = True

    runs = commands.add_parser("runs", parents=[common], help="list runs")
    runs.add_argument("--status", choices=RunStatus.values(), help="only runs in this status")
    runs.add_argument("--since", metavar="DATE", type=parse_when, help="started at or after (UTC)")
    runs.add_argument("--until", metavar="DATE", type=lambda t: parse_when(t, end_of_day=True),
                      help="started before the end of this day / before this time (UTC)")
    runs.add_argument("--output-dir", metavar="PATH",
                      help="runs that wrote into PATH or a directory under it, or wrote the file PATH")
    runs.add_argument("--sweep", metavar="ID", help="runs of this sweep (its directory, as 'show' prints it)")
    runs.add_argument("--user", metavar="NAME", help="runs started by this user")
    runs.add_argument("--limit", type=_positive, metavar="N", help="only the newest N runs")

    show = commands.add_parser("show", parents=[common], help="config, inputs, outputs and rank map of a run")
    show.add_argument("run", metavar="RUN", help="run id or a unique prefix of 8+ characters")

    trace = commands.add_parser("trace", parents=[common],
                                help="where a file came from (or, with --descendants, what was built from it)")
    trace.add_argument("target", metavar="REF", help="a file, an output directory, a sha256 or a prefix of one")
    trace.add_argument("--descendants", action="store_true",
                       help="follow the file forwards: the runs that read it and what they wrote, to the end")

    verify = commands.add_parser("verify", parents=[common], help="re-hash recorded files and compare")
    verify.add_argument("target", metavar="REF", help="a run id (or prefix), a file, or an output directory")
    verify.add_argument("--inputs", action="store_true", help="for a run, also check its input files")

    graph = commands.add_parser("graph", parents=[common], help="draw the lineage as DOT, SVG or HTML")
    graph.add_argument("target", metavar="REF", help="a file, an output directory, a sha256 or a run id (or prefix)")
    graph.add_argument("--descendants", action="store_true", help="draw what was built from it instead")
    graph.add_argument("--format", choices=FORMATS, default=None,
                       help="picture format (default: from --output's suffix, else dot)")
    graph.add_argument("--output", metavar="FILE", help="write the picture to FILE instead of stdout")
    _add_compare(commands, common)
    _add_db(commands, common)
    return parser


def _add_db(commands, common) -> None:
    from reshard_job.audit.schema_revision import ACTIONS

    db = commands.add_parser("db", parents=[common], help="the database's schema revision; upgrade it to the head")
    db.add_argument("action", choices=ACTIONS,
                    help="current: print the revision; upgrade: migrate to this tool's head (safe beside running jobs)")


def _add_compare(commands, common) -> None:
    compare = commands.add_parser("compare", parents=[common],
                                  help="whether two checkpoints hold the same parameters, in any layouts and formats")
    for side in ("a", "b"):
        compare.add_argument(side, metavar=side.upper(),
                             help="an output directory, a run id (or prefix), a folder of rank_<r>/ files, "
                                  "a MindFormers save or an export folder")
    for side in ("a", "b"):
        compare.add_argument(f"--{side}-strategy", metavar="FILE",
                             help=f"strategy file (or per-stage folder) of {side.upper()}'s rank folders "
                                  "(none: unsharded, or an output directory's own)")
    compare.add_argument("--weights", action="store_true",
                         help="ignore optimizer states and step counters (as target.include=weights does)")


class _UsageError(Exception):
    pass


@dataclass
class _Answer:
    result: Any  # an entity (``to_json``), a list of them, or text
    to_text: Callable[[Any], str]
    code: int = EXIT_OK
    to_json: Callable[[Any], Any] | None = None


def _cmd_runs(session, args) -> _Answer:
    import reshard_job.audit.render as render
    from reshard_job.audit.queries import RunFilter, list_runs

    if args.since and args.until and args.since >= args.until:
        raise _UsageError("--since must be before --until")
    run_filter = RunFilter(status=args.status, since=args.since, until=args.until, output=args.output_dir,
                           sweep_id=args.sweep, user=args.user, limit=args.limit)
    return _Answer(list_runs(session, run_filter), render.runs_table)


def _cmd_show(session, args) -> _Answer:
    import reshard_job.audit.render as render
    from reshard_job.audit.lookup import resolve_run_id
    from reshard_job.audit.queries import shown_run

    return _Answer(shown_run(session, resolve_run_id(session, args.run)), render.shown_run)


def _direction(args) -> str:
    from reshard_job.audit.entities import ANCESTORS, DESCENDANTS

    return DESCENDANTS if args.descendants else ANCESTORS


def _cmd_trace(session, args) -> _Answer:
    import reshard_job.audit.render as render
    from reshard_job.audit.trace import trace_reference

    return _Answer(trace_reference(session, args.target, _direction(args)), render.trace_tree)


def _cmd_verify(session, args) -> _Answer:
    import reshard_job.audit.render as render
    from reshard_job.audit.verify import verify

    report = verify(session, args.target, include_inputs=args.inputs)
    return _Answer(report, render.verify_report, EXIT_OK if report.intact else EXIT_MISMATCH)


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


def _cmd_graph(session, args) -> _Answer:
    from reshard_job.audit.drawing import draw
    from reshard_job.audit.graph import graph_of
    from reshard_job.audit.trace import trace_reference

    traced = trace_reference(session, args.target, _direction(args))
    graph = graph_of(traced, _title(traced))
    picture = draw(graph, _picture_format(args), tool_version=__version__)
    return _Answer(picture, lambda text: text.rstrip("\n"), to_json=lambda _: graph.to_json())


def _compare(args) -> int:
    """``compare`` reads checkpoints; the lineage database is opened only for a side that is a run id."""
    from reshard_job.audit.compare import Side, compare
    from reshard_job.errors import ReshardError
    url = _database_url(args)
    sides = Side("A", args.a, args.a_strategy), Side("B", args.b, args.b_strategy)
    try:
        result = compare(*sides, weights=args.weights, open_store=lambda: _open_store(url), note=_complain)
    except ReshardError as exc:
        _complain(f"error: {exc}")
        return EXIT_ERROR
    _write(json.dumps(result.to_json(), indent=2) if getattr(args, "json", False) else result.to_text())
    return EXIT_OK if result.equal else EXIT_MISMATCH


COMMANDS = {"runs": _cmd_runs, "show": _cmd_show, "trace": _cmd_trace, "verify": _cmd_verify, "graph": _cmd_graph}


def _open_store(url: str):
    """Open the database read-only in spirit: never create it, never migrate it."""
    from reshard_job.lineage import LineageStore
    from reshard_job.lineage.database import normalize_url, sqlite_file
    from reshard_job.lineage.errors import LineageError

    database_file = sqlite_file(normalize_url(url))
    if database_file is not None and not os.path.exists(database_file):
        raise LineageError(f"no lineage database at {database_file} (no job has recorded there yet; "
                           "use --db or $RESHARD_LINEAGE_URL)")
    return LineageStore(url, read_only=True)


class _PipeClosed(Exception):
    """Whoever read our output stopped reading (``| head``)."""


def _silence_stdout() -> None:
    # What is still buffered would fail again at exit; let it go to /dev/null instead.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


# Recorded paths, errors, host and user names, and the command's own arguments are anyone's text:
# control characters (ESC sequences set titles, clear screens, hide lines) are shown, not obeyed.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """`text` with control characters (except newline and tab) written as ``\\xNN``."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _complain(text: str) -> None:
    print(printable(text), file=sys.stderr)


def _write(text: str, stream=None) -> None:
    stream = stream or sys.stdout
    text = printable(text)
    try:
        try:
            stream.write(text + "\n")
        except UnicodeEncodeError:  # a terminal that cannot show the tree characters
            stream.write(text.encode("ascii", "replace").decode("ascii") + "\n")
        stream.flush()
    except BrokenPipeError:
        _silence_stdout()
        raise _PipeClosed() from None


def _save(path: str, text: str) -> None:
    from reshard_job.lineage.errors import LineageError
    from reshard_job.storage.local_files import replace_file

    try:
        replace_file(path, text.encode("utf-8"))
    except OSError as exc:
        raise LineageError(f"{os.path.abspath(path)}: cannot write ({exc.strerror or exc})") from None


# Traces, graphs and their JSON follow a chain of conversions hop by hop (the JSON nests a level per
# hop, and json's encoder recurses too): an auditor's chain of thousands of conversions needs more
# than the interpreter's default 1,000 frames. The command runs in a thread with a stack sized for
# it (address space only; pages are touched as the walk goes deep).
DEEP_STACK_BYTES = 512 << 20
DEEP_RECURSION_LIMIT = 200_000


def main(argv: list[str] | None = None) -> int:
    try:
        return _in_deep_stack(_main, argv)
    except _PipeClosed:
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _in_deep_stack(function, *args):
    """`function(*args)` in a thread whose stack and recursion limit fit a long chain of hops;
    its exception, if any, is raised here (Ctrl-C still reaches this thread's ``join``)."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = function(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the calling thread as it was
            outcome["error"] = exc

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, DEEP_RECURSION_LIMIT))
    previous = threading.stack_size(DEEP_STACK_BYTES)
    try:
        worker = threading.Thread(target=run, name="reshard-audit", daemon=True)
        worker.start()
    finally:
        threading.stack_size(previous)
    worker.join()
    sys.setrecursionlimit(limit)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _database_url(args) -> str:
    """--db, else the environment's, else runs/lineage.db; a path, as people type it, is the SQLite file there."""
    from reshard_job.lineage.database import default_url, sqlite_url

    url = getattr(args, "db", None) or default_url()
    return url if "://" in url else sqlite_url(os.path.abspath(url))


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "compare":
        return _compare(args)
    if args.command == "db":
        from reshard_job.audit.schema_revision import db_command

        return db_command(args.action, _database_url(args), as_json=getattr(args, "json", False),
                          write=_write, complain=_complain)
    want_json = getattr(args, "json", False)

    from sqlalchemy.exc import ArgumentError, SQLAlchemyError

    from reshard_job.errors import ReshardError
    from reshard_job.audit.entities import to_json
    from reshard_job.lineage.migrate import check_at_head

    url = _database_url(args)
    store = None
    try:
        store = _open_store(url)
        with store.read_session() as session:
            check_at_head(session.connection())
            session.rollback()
            answer = COMMANDS[args.command](session, args)
            # Built inside the session: nothing may lazy-load once it is closed.
            text = json.dumps((answer.to_json or to_json)(answer.result), indent=2) if want_json \
                else answer.to_text(answer.result)
        if getattr(args, "output", None):
            _save(args.output, text + "\n")
    except (ReshardError, _UsageError) as exc:
        _complain(f"error: {exc}")
        return EXIT_ERROR
    except ArgumentError as exc:
        _complain(f"error: invalid database URL {url!r}: {exc}")
        return EXIT_ERROR
    except SQLAlchemyError as exc:
        detail = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        _complain(f"error: cannot read the lineage database: {detail}")
        return EXIT_ERROR
    finally:
        if store is not None:
            store.close()

    if not getattr(args, "output", None):
        _write(text)
    if answer.code == EXIT_MISMATCH:
        # Scripts that only look at stderr still learn which files are at fault.
        bad = "; ".join(f"{f.path} {f.state}" for f in answer.result.problems)
        _complain(f"verify failed: {bad}")
    return answer.code


if __name__ == "__main__":
    sys.exit(main())
