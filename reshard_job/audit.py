"""Audit CLI over the lineage database: ``python -m reshard_job.audit [--db URL] COMMAND [--json]``.

Commands:
  runs                 list runs (filters: --status, --since DATE, --until DATE)
  show RUN             config, inputs, outputs and rank map of one run
  trace PATH|SHA256    ancestry of a file (found by content) back to the original sources
  verify RUN|PATH      re-hash recorded files; exit 1 if any is missing or changed

RUN may be a unique prefix of a run id. ``--db`` defaults to ``$RESHARD_LINEAGE_URL``, else
``runs/lineage.db`` under the current directory.

This module is argument parsing and printing only; the answers come from
``reshard_job.lineage.queries`` and the text from ``reshard_job.lineage.render``. The audit
never changes the database: it refuses (one line, exit 2) a database whose schema is missing or
at another revision, instead of migrating it.

Exit codes: 0 success, 1 verification found missing or changed files, 2 usage or lookup error.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from typing import Any, Callable

EXIT_OK = 0
EXIT_MISMATCH = 1
EXIT_ERROR = 2

STATUSES = ("started", "completed", "failed", "abandoned")


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


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not the whole usage block
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
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
        epilog="RUN may be a unique prefix of a run id. Times are UTC. Exit status: 0 ok, "
               "1 verify found missing or changed files, 2 usage error or nothing found.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_ArgumentParser)
    commands.required = True

    runs = commands.add_parser("runs", parents=[common], help="list runs")
    runs.add_argument("--status", choices=STATUSES, help="only runs in this status")
    runs.add_argument("--since", metavar="DATE", type=parse_when, help="started at or after (UTC)")
    runs.add_argument("--until", metavar="DATE", type=lambda t: parse_when(t, end_of_day=True),
                      help="started before the end of this day / before this time (UTC)")
    runs.add_argument("--limit", type=int, metavar="N", help="only the newest N runs")

    show = commands.add_parser("show", parents=[common], help="config, inputs, outputs and rank map of a run")
    show.add_argument("run", metavar="RUN", help="run id or unique prefix")

    trace = commands.add_parser("trace", parents=[common], help="ancestry of a file back to its original sources")
    trace.add_argument("target", metavar="PATH|SHA256", help="a file (looked up by content) or a sha256 hex digest")

    verify = commands.add_parser("verify", parents=[common], help="re-hash recorded files and compare")
    verify.add_argument("target", metavar="RUN|PATH", help="run id (or unique prefix) or a file path")
    verify.add_argument("--inputs", action="store_true", help="for a run, also check its input files")
    return parser


def _cmd_runs(session, args) -> tuple[Any, Callable[[Any], str], int]:
    from .lineage import queries, render

    if args.since and args.until and args.since >= args.until:
        raise _UsageError("--since must be before --until")
    result = queries.list_runs(session, status=args.status, since=args.since, until=args.until, limit=args.limit)
    return result, render.runs_table, EXIT_OK


def _cmd_show(session, args):
    from .lineage import queries, render

    return queries.run_details(session, queries.resolve_run_id(session, args.run)), render.run_details, EXIT_OK


def _cmd_trace(session, args):
    from .lineage import queries, render

    return queries.trace(session, args.target), render.trace_tree, EXIT_OK


def _cmd_verify(session, args):
    from .lineage import queries, render

    report = queries.verify(session, args.target, include_inputs=args.inputs)
    return report, render.verify_report, EXIT_OK if report["intact"] else EXIT_MISMATCH


COMMANDS = {"runs": _cmd_runs, "show": _cmd_show, "trace": _cmd_trace, "verify": _cmd_verify}


class _UsageError(Exception):
    pass


def _open_store(url: str):
    """Open the database read-only in spirit: never create it, never migrate it."""
    from .lineage import LineageStore
    from .lineage.database import normalize_url, sqlite_file
    from .lineage.errors import LineageError

    database_file = sqlite_file(normalize_url(url))
    if database_file is not None and not os.path.exists(database_file):
        raise LineageError(f"no lineage database at {database_file} (no job has recorded there yet; "
                           "use --db or $RESHARD_LINEAGE_URL)")
    return LineageStore(url)


def _print(text: str) -> None:
    try:
        print(text)
    except UnicodeEncodeError:  # a terminal that cannot show the tree characters
        sys.stdout.write(text.encode("ascii", "replace").decode("ascii") + "\n")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    want_json = getattr(args, "json", False)

    from sqlalchemy.exc import ArgumentError, SQLAlchemyError

    from .errors import ReshardError
    from .lineage.database import default_url
    from .lineage.migrate import check_at_head

    url = getattr(args, "db", None) or default_url()
    store = None
    try:
        store = _open_store(url)
        with store.read_session() as session:
            check_at_head(session.connection())
            session.rollback()
            result, to_text, code = COMMANDS[args.command](session, args)
    except (ReshardError, _UsageError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except ArgumentError as exc:
        print(f"error: invalid database URL {url!r}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except SQLAlchemyError as exc:
        detail = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        print(f"error: cannot read the lineage database: {detail}", file=sys.stderr)
        return EXIT_ERROR
    finally:
        if store is not None:
            store.close()

    if want_json:
        _print(json.dumps(result, indent=2, sort_keys=False))
    else:
        _print(to_text(result))
    if code == EXIT_MISMATCH:
        # Scripts that only look at stderr still learn which files are at fault.
        bad = "; ".join(f"{f['path']} {f['state']}" for f in result["files"] if f["state"] != "ok")
        print(f"verify failed: {bad}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
