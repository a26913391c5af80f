"""Hydra's and OmegaConf's multi-line configuration errors as one line, with a hint where one helps.

Hints cover what users actually type: a comma list without ``-m`` (``job.ranks=0,1`` means a sweep
to Hydra; a list is ``job.ranks=[0,1]``), a launcher plugin that is not installed, and values that
need quoting (URLs with ``?``, ``=`` or ``&``).
"""

from __future__ import annotations

import re

LAUNCHER_EXTRAS = {"joblib": "joblib", "submitit_slurm": "submitit", "submitit_local": "submitit",
                   "ray": "ray", "rq": "rq"}


def one_line(exc: BaseException) -> str:
    from hydra.errors import OverrideParseException
    from omegaconf.errors import OmegaConfBaseException

    unknown = _unknown_key(exc)
    if unknown:
        return unknown
    if isinstance(exc, OmegaConfBaseException) and getattr(exc, "msg", None):
        key = getattr(exc, "full_key", None)
        msg = str(exc.msg).strip().splitlines()[0]
        return f"{key}: {msg}" if key and not msg.startswith(f"{key}:") else msg
    text = str(exc)
    lines = [ln.strip() for ln in text.splitlines()]
    head = next((ln for ln in lines if ln), type(exc).__name__)
    if isinstance(exc, OverrideParseException):
        bad = getattr(exc, "override", None)
        return (f"cannot parse override {bad!r}: {head}; quote values that contain characters such as "
                "= ? & , [ ] { } or spaces, e.g. lineage.url='postgresql+psycopg://host/db?sslmode=require'")
    hint = _hint(text)
    options = _available_options(lines)
    cause = exc.__cause__
    detail = f" ({one_line(cause)})" if cause is not None and cause is not exc and not options else ""
    return head + (f" (available: {', '.join(options)})" if options else "") + detail + hint


def _unknown_key(exc: BaseException) -> str | None:
    """``target.devcies=4`` (no ``+``): Hydra cannot override a key the schema lacks. Told as settle
    tells ``+target.devcies=4``, with the closest known key, so both spellings read the same."""
    from hydra.errors import ConfigCompositionException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    cause = exc.__cause__
    if not isinstance(exc, ConfigCompositionException):
        return None
    if not isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
        return None
    key = getattr(cause, "full_key", None)
    if not key or key.split(".")[0] == "hydra":  # Hydra's own settings are not the job's schema
        return None
    from reshard_job.job.config.settle import unknown_key_line

    return unknown_key_line(key)


def _hint(text: str) -> str:
    m = re.search(r"Ambiguous value for argument '([\w.]+)=([^']*)'", text)
    if m:
        return (f"; for a list write {m.group(1)}=[{m.group(2)}], for a sweep over those values add -m")
    m = re.search(r"Could not find 'hydra/launcher/(\w+)'", text)
    if m:
        extra = LAUNCHER_EXTRAS.get(m.group(1))
        if extra:
            return f"; that launcher is a plugin: pip install -e '.[{extra}]' (or hydra-{extra.replace('_', '-')}-launcher)"
    return ""


def _available_options(lines: list[str]) -> list[str]:
    if not any(ln.startswith("Available options in") for ln in lines):
        return []
    start = next(i for i, ln in enumerate(lines) if ln.startswith("Available options in"))
    options = []
    for ln in lines[start + 1:]:
        if not ln or ln.startswith("Config search path"):
            break
        if not ln.endswith("_schema"):  # the structured-config schemas are not presets
            options.append(ln)
    return options
