"""The job's log lines, console and file: the values put into a message (names of files, folders,
parameters, hosts: anyone's text) have their control characters shown as ``\\xNN``, so a file named
with ESC[2J or a newline neither drives the terminal nor forges a line of its own. Configured as the
formatter of Hydra's job logging (``conf/config.yaml``). Credentials are masked in every line, the
job's and Hydra's own (a sweep's launcher lists each job's overrides, ``lineage.url`` with its
password included: ``MaskingFormatter``)."""

from __future__ import annotations

import logging
from numbers import Number

from reshard_job.secrets import mask_text
from reshard_job.text import one_line_of


def _shown(value):
    return value if isinstance(value, Number) else one_line_of(str(value))


class PrintableFormatter(logging.Formatter):
    """``logging.Formatter`` whose records' arguments are made printable (the record itself is left
    as it is: other handlers see what was logged)."""

    def format(self, record: logging.LogRecord) -> str:
        if record.args:
            record = logging.makeLogRecord(record.__dict__)
            args = record.args
            record.args = ({k: _shown(v) for k, v in args.items()} if isinstance(args, dict)
                           else tuple(_shown(a) for a in args))
        return mask_text(super().format(record))


class MaskingFormatter(logging.Formatter):
    """Hydra's own log lines (``hydra.hydra_logging``) with credentials masked."""

    def format(self, record: logging.LogRecord) -> str:
        return mask_text(super().format(record))
