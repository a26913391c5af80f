"""The package's error types.

Every failure a user can cause (bad files, bad layouts, bad configuration) surfaces as a
``ReshardError`` subclass whose message is one line naming the file, rank or parameter at fault
and what was expected. Entry points print ``str(err)`` and exit non-zero; tracebacks are for bugs.
"""

from __future__ import annotations

import os

from reshard_job.text import rank_ranges, shorten


class ReshardError(Exception):
    """Base class of every error this package raises on purpose."""

    exit_code = 2

    def __reduce__(self):
        # Errors cross process boundaries (parallel workers); rebuild them from their message and
        # attributes rather than from constructor arguments, which differ between subclasses.
        return (_rebuild, (type(self), str(self), dict(self.__dict__)))


def _rebuild(cls, message, attrs):
    err = Exception.__new__(cls)
    Exception.__init__(err, message)
    err.__dict__.update(attrs)
    return err


class FormatError(ReshardError):
    """A file is not what its name or caller says it is (corrupt, truncated, wrong kind)."""

    def __init__(self, path: str | os.PathLike | None, problem: str):
        self.path = None if path is None else os.fspath(path)
        self.problem = problem
        where = f"{self.path}: " if self.path else ""
        super().__init__(f"{where}{problem}")


class CheckpointFormatError(FormatError):
    """A `.ckpt` file cannot be read as MindSpore's checkpoint format."""


class SafetensorsFormatError(FormatError):
    """A `.safetensors` file cannot be read."""


class StrategyFormatError(FormatError):
    """A strategy file is neither valid protobuf nor valid JSON (or is empty)."""


class LayoutError(ReshardError):
    """A parameter's layout is inconsistent (bad tensor map, indivisible shape, unknown axis)."""


class PlanError(ReshardError):
    """Sources, strategies and targets do not fit together (missing ranks, shape mismatches)."""


class MissingRankError(PlanError):
    """Source rank files that the plan needs are absent."""

    LISTED = 8  # missing ranks described one by one; the rest are summed up as rank ranges

    def __init__(self, missing: dict[int, list[int]], where: str = ""):
        self.missing = dict(sorted(missing.items()))
        parts = [
            f"rank {src} (needed by target rank{'s' if len(dst) > 1 else ''} {shorten(rank_ranges(dst, ', '), 60)})"
            for src, dst in list(self.missing.items())[:self.LISTED]
        ]
        if len(self.missing) > self.LISTED:  # one bounded line, however many are missing
            rest = list(self.missing)[self.LISTED:]
            parts.append(f"and {len(rest)} more ({shorten('ranks ' + rank_ranges(rest), 120)})")
        loc = f" in {where}" if where else ""
        super().__init__(f"missing source checkpoint{'s' if len(self.missing) > 1 else ''}{loc}: " + "; ".join(parts))


class ConfigError(ReshardError):
    """The job configuration is invalid (unknown preset, missing path, contradicting keys)."""


class OutputError(ReshardError):
    """The output location cannot be used (not writable, holds foreign files, locked by another job)."""


class ProofError(ReshardError):
    """A converted parameter's fingerprint differs between the sources and the outputs: the
    outputs do not hold the model the sources hold (nothing is recorded as completed)."""
