"""The read side of lineage: ``python -m reshard_job.audit`` (``reshard-audit``) and what it asks.

* ``cli``       — the command line; ``commands`` — its subcommands (``runs``, ``show``, ``trace``,
  ``verify``, ``graph``, ``compare``, ``record``, ``db``)
* ``entities``  — read-side dataclasses built from the ORM rows, with their JSON
* ``reading``, ``manifests`` — how files and an output directory's manifest are read
* ``lookup``    — from a path, directory, digest or run id (or prefix) to what the database holds
* ``queries``   — runs and their details; ``trace`` — lineage both ways; ``verify`` — re-hashing
* ``render``    — text; ``graph`` — vertices, edges and a layered layout; ``drawing`` — DOT/SVG/HTML

The write side (models, the store, migrations) is ``reshard_job.lineage``; this package reads it.
"""


def main(argv: list[str] | None = None) -> int:
    """The audit command line (``reshard_job.audit.cli.main``)."""
    from reshard_job.audit.cli import main as cli_main

    return cli_main(argv)
