"""The states of a run, spelled once for the schema, the store, the queries and the audit CLI.

A ``str`` enum: members compare equal to their text, so JSON output, CHECK constraints and
command-line choices use the plain words, while code names them without string literals. The
database keeps plain strings (see ``models.RunStatusColumn``), guarded by a CHECK constraint that
a migration extends when a state is added.

Life of a run::

    started ──► completed
       │
       ├──► failed        the job reported an error
       ├──► interrupted   the job was stopped by SIGINT or SIGTERM and said so
       └──► abandoned     a later job on the same host found its process gone (kill -9, OOM)

An abandoned run whose process turns out to be alive after all may still report: its own word
wins over the guess. The other end states are final.
"""

from __future__ import annotations

from enum import Enum


class RunStatus(str, Enum):
    # The order is the order of the CHECK constraint's list; keep new states at the end.
    STARTED = "started"
    COMPLETED = "completed"
    FAILED = "failed"
    ABANDONED = "abandoned"
    INTERRUPTED = "interrupted"

    def __str__(self) -> str:  # the word itself in f-strings and messages, on every Python version
        return self.value

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(member.value for member in cls)

    @property
    def may_still_report(self) -> bool:
        """Whether the run's own process may still record inputs, a plan or an end state."""
        return self in (RunStatus.STARTED, RunStatus.ABANDONED)


class UnknownStatus(str):
    """A status a run's row holds that no ``RunStatus`` is (a row edited, or written by a newer
    version): shown as it is, marked, and never taken for a state a run may still report from."""

    @property
    def value(self) -> str:
        return f"{str.__str__(self)} (unknown status)"

    def __str__(self) -> str:
        return self.value

    may_still_report = False


def status_of(text: str) -> RunStatus | UnknownStatus:
    """The ``RunStatus`` a row's text names, or an ``UnknownStatus`` (reported, not fatal)."""
    if isinstance(text, UnknownStatus):
        return text
    try:
        return RunStatus(text)
    except ValueError:
        return UnknownStatus(text)

