"""``compare A B``: whether two checkpoints hold the same parameters, whatever their layouts and
formats. It reads checkpoints; the lineage database is opened only for a side that is a run id."""

from __future__ import annotations

import json

from reshard_job.audit.commands.base import EXIT_ERROR, EXIT_MISMATCH, EXIT_OK
from reshard_job.audit.commands.database import database_url, open_store
from reshard_job.audit.commands.output import complain, write


def add_parser(commands, common) -> None:
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


def run(args) -> int:
    from reshard_job.audit.compare import Side, compare
    from reshard_job.errors import ReshardError

    url = database_url(args)
    sides = Side("A", args.a, args.a_strategy), Side("B", args.b, args.b_strategy)
    try:
        result = compare(*sides, weights=args.weights, open_store=lambda: open_store(url), note=complain)
    except ReshardError as exc:
        complain(f"error: {exc}")
        return EXIT_ERROR
    write(json.dumps(result.to_json(), indent=2) if getattr(args, "json", False) else result.to_text())
    return EXIT_OK if result.equal else EXIT_MISMATCH
