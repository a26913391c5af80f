"""What every audit subcommand shares: exit codes, a parser that fails in one line, answers."""

from __future__ import annotations

import argparse
import datetime as dt
import signal
from dataclasses import dataclass
from typing import Any, Callable

EXIT_OK = 0
EXIT_MISMATCH = 1
EXIT_ERROR = 2
# verify: every file matches its manifest, but no recorded run wrote that manifest (the job was stopped
# between publishing it and recording itself): not damage, yet nothing the database vouches for
EXIT_UNRECORDED = 3
EXIT_INTERRUPTED = 128 + signal.SIGINT
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not the whole usage block
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message} (see --help)\n")


class UsageError(Exception):
    pass


@dataclass
class Answer:
    result: Any  # an entity (``to_json``), a list of them, or text
    to_text: Callable[[Any], str]
    code: int = EXIT_OK
    to_json: Callable[[Any], Any] | None = None


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


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"not a positive whole number: {text!r}")
    return value
