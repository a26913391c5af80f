"""``db current | db upgrade``: the database's schema revision, and bringing it to this tool's head."""

from __future__ import annotations

from reshard_job.audit.commands.database import database_url
from reshard_job.audit.commands.output import complain, write


def add_parser(commands, common) -> None:
    from reshard_job.audit.schema_revision import ACTIONS

    db = commands.add_parser("db", parents=[common], help="the database's schema revision; upgrade it to the head")
    db.add_argument("action", choices=ACTIONS,
                    help="current: print the revision; upgrade: migrate to this tool's head (safe beside running jobs)")


def run(args) -> int:
    from reshard_job.audit.schema_revision import db_command

    return db_command(args.action, database_url(args), as_json=getattr(args, "json", False),
                      write=write, complain=complain)
