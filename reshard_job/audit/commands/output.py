"""Printing the audit's answers: recorded text is anyone's, so control characters are shown, not
obeyed; a reader that goes away (``| head``) ends the command quietly."""

from __future__ import annotations

import os
import re
import sys

from reshard_job.secrets import mask_url
from reshard_job.text import one_line_of


class PipeClosed(Exception):
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


def complain(text: str) -> None:
    """One line on stderr, whatever the names in it hold (a newline in a path is shown as ``\\x0a``),
    and no credential of a URL given as an argument (``s3://user:secret@…``) in it."""
    print(one_line_of(mask_url(text)), file=sys.stderr)


def write(text: str, stream=None) -> None:
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
        raise PipeClosed() from None


def save(path: str, text: str) -> None:
    from reshard_job.lineage.errors import LineageError
    from reshard_job.storage.local_files import replace_file

    try:
        replace_file(path, text.encode("utf-8"))
    except OSError as exc:
        raise LineageError(f"{os.path.abspath(path)}: cannot write ({exc.strerror or exc})") from None
