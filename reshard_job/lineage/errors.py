"""Errors of the lineage store and the audit CLI.

They derive from the package's ``ReshardError`` so entry points treat them like every other
user-facing failure: print the one-line message, exit non-zero, no traceback.
"""

from __future__ import annotations

from reshard_job.errors import ReshardError


class LineageError(ReshardError):
    """The lineage database cannot be used or does not hold what was asked for."""


class UnknownRunError(LineageError):
    """No run matches the given id or id prefix."""

    def __init__(self, run_ref: str):
        self.run_ref = run_ref
        super().__init__(f"no run with id {run_ref!r} in the lineage database")


class AmbiguousRunError(LineageError):
    """A run id prefix matches more than one run."""

    def __init__(self, run_ref: str, matches: list[str]):
        self.run_ref = run_ref
        self.matches = matches
        shown = ", ".join(matches[:5]) + (", ..." if len(matches) > 5 else "")
        super().__init__(f"run id prefix {run_ref!r} matches {len(matches)} runs ({shown}); give more characters")


class RunStateError(LineageError):
    """A run is asked to change state in a way its current state does not allow."""


class SchemaError(LineageError):
    """The database schema is missing, outdated or newer than this version of the tool."""


class AmbiguousReferenceError(LineageError):
    """A prefix matches more than one thing (runs, file contents), so it names none of them."""

    def __init__(self, ref: str, matches: list[str]):
        self.ref = ref
        self.matches = matches
        shown = ", ".join(matches[:4]) + (", ..." if len(matches) > 4 else "")
        super().__init__(f"{ref!r} matches {len(matches) if len(matches) <= 10 else 'more than 10'} records "
                         f"({shown}); give more characters")


def driver_detail(exc: BaseException) -> str:
    """The first line of what the database driver said: SQLAlchemy wraps it (``exc.orig``) in a
    message of several lines with its own links, which a one-line error has no room for."""
    return str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
