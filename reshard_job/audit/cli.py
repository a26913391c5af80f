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
  openlineage [RUN...] [--output FILE]
                             recorded runs as OpenLineage run events (JSON lines: its file transport)
  record --consumer NAME --inputs PATH... [--outputs PATH...]
                             record that another program read (and wrote) these files or folders,
                             so trace and --descendants reach the model it trained
  db current | db upgrade     the database's schema revision; ``upgrade`` brings it to this tool's
                             head, as every job does before recording, printing before and after

REF is a file path (looked up by its content), an output directory (the files its manifest
lists), a sha256, or a run id; digests and run ids may be shortened to a unique prefix of at
least 8 characters, as ``show`` and ``trace`` print them. ``--db`` (a URL, or the path of an SQLite
file) defaults to ``$RESHARD_JOB_LINEAGE_URL``, else ``runs/lineage.db`` under the current directory.

This module builds the parser and dispatches; each subcommand lives in ``audit.commands`` (thin over
``queries``, ``trace``, ``verify``, ``graph``, ``compare``), text comes from ``render`` and pictures from
``drawing``. The audit never changes the database but by ``db upgrade`` and ``record`` (which adds a
run, as a job does): the other commands refuse
(one line, exit 2) a database whose schema is missing or at another revision. Like other Unix tools it
stops quietly when its reader goes away (``audit runs | head -1``), with status 141.

Exit codes: 0 success, 1 verification found missing or changed files or fingerprints that disagree
(``compare``: a parameter differs or is on one side only), 2 usage or lookup error, 3 verify found an
output directory complete but not recorded (stopped after its manifest was written: rerun the job to
record it; the database vouches for nothing there yet, so not 0), 130 interrupted, 141 output pipe closed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading

from reshard_job import __version__
from reshard_job.audit.commands.base import (EXIT_BROKEN_PIPE, EXIT_ERROR, EXIT_INTERRUPTED, EXIT_MISMATCH,
                                             EXIT_UNRECORDED, ArgumentParser, UsageError, parse_when)
from reshard_job.audit.commands.database import DB_HELP, database_url, open_store
from reshard_job.audit.commands.output import PipeClosed, complain, printable, save, write
from reshard_job.lineage.errors import driver_detail

__all__ = ["build_parser", "main", "parse_when", "printable"]


def build_parser() -> argparse.ArgumentParser:
    from reshard_job.audit.commands import compare, export, inspect, record, schema

    # --db and --json are accepted before or after the command; SUPPRESS keeps a value given
    # before the command from being reset by the subparser's default.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--db", metavar="URL", default=argparse.SUPPRESS, help=DB_HELP)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="print machine-readable JSON")

    invoked_as = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    prog = invoked_as if invoked_as.startswith("reshard-audit") else "python -m reshard_job.audit"
    parser = ArgumentParser(
        prog=prog, parents=[common], description="Inspect the lineage of resharded checkpoints.",
        epilog="REF: a file path, an output directory, a sha256 or a run id; digests and run ids may be "
               "unique prefixes of 8 or more characters. Times are UTC. Exit status: 0 ok, 1 verify found "
               "missing or changed files or disagreeing fingerprints, or compare found a difference, 2 usage "
               "error or nothing found, 3 verify found a directory complete but not recorded (rerun to record).")
    parser.add_argument("--version", action="version", version=f"reshard_job {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=ArgumentParser)
    commands.required = True
    inspect.add_parsers(commands, common)
    export.add_parser(commands, common)
    compare.add_parser(commands, common)
    record.add_parser(commands, common)
    schema.add_parser(commands, common)
    return parser


# Traces, graphs and their JSON follow a chain of conversions hop by hop (the JSON nests a level per
# hop, and json's encoder recurses too): an auditor's chain of thousands of conversions needs more
# than the interpreter's default 1,000 frames. The command runs in a thread with a stack sized for
# it (address space only; pages are touched as the walk goes deep).
DEEP_STACK_BYTES = 512 << 20
DEEP_RECURSION_LIMIT = 200_000


def main(argv: list[str] | None = None) -> int:
    try:
        return _in_deep_stack(_main, argv)
    except PipeClosed:
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


DEEP_JSON = 64  # levels of nesting printed indented; a deeper document is printed on one line


def json_text(doc) -> str:
    """`doc` indented by 2, as people read it; in one line where it nests deeper than ``DEEP_JSON``
    (the ancestry of a chain of 2,000 conversions: indented, its text grew with the square of its
    depth, 32 MB for 500)."""
    stack = [(doc, 0)]
    while stack:
        value, depth = stack.pop()
        if depth > DEEP_JSON:
            return json.dumps(doc)
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
    return json.dumps(doc, indent=2)


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


def _main(argv: list[str] | None) -> int:
    from reshard_job.errors import ConfigError
    from reshard_job.lineage.uses import check_names_recordable

    try:  # a name no record can hold, said before a lookup
        check_names_recordable(map(str, sys.argv[1:] if argv is None else argv))
    except ConfigError as exc:
        complain(f"error: {exc}")
        return EXIT_ERROR
    args = build_parser().parse_args(argv)
    if args.command in ("compare", "record", "db"):  # each opens (or does not open) the database its own way
        from reshard_job.audit.commands import compare, record, schema

        return {"compare": compare.run, "record": record.run, "db": schema.run}[args.command](args)
    want_json = getattr(args, "json", False)

    from sqlalchemy.exc import ArgumentError, SQLAlchemyError

    from reshard_job.errors import ReshardError
    from reshard_job.audit.commands import export, inspect
    from reshard_job.audit.entities import to_json
    from reshard_job.lineage.migrate import check_at_head

    url = database_url(args)
    store = None
    try:
        store = open_store(url)
        with store.read_session() as session:
            check_at_head(session.connection())
            session.rollback()
            answer = {**inspect.HANDLERS, **export.HANDLERS}[args.command](session, args)
            # Built inside the session: nothing may lazy-load once it is closed.
            text = json_text((answer.to_json or to_json)(answer.result)) if want_json \
                else answer.to_text(answer.result)
        if getattr(args, "output", None):
            save(args.output, text + "\n")
    except (ReshardError, UsageError) as exc:
        complain(f"error: {exc}")
        return EXIT_ERROR
    except ArgumentError as exc:
        complain(f"error: invalid database URL {url!r}: {exc}")
        return EXIT_ERROR
    except SQLAlchemyError as exc:
        detail = driver_detail(exc)
        complain(f"error: cannot read the lineage database: {detail}")
        return EXIT_ERROR
    finally:
        if store is not None:
            store.close()

    if not getattr(args, "output", None):
        write(text)
    if answer.code == EXIT_UNRECORDED:
        complain(f"verify: {answer.result.path}: complete, not recorded: rerun the job into it to record the run")
    if answer.code == EXIT_MISMATCH:
        # Scripts that only look at stderr still learn which files are at fault.
        bad = "; ".join(f"{f.path} {f.state}" for f in answer.result.problems)
        complain(f"verify failed: {bad}")
    return answer.code


if __name__ == "__main__":
    sys.exit(main())
