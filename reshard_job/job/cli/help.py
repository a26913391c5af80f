"""``python -m reshard_job --help``: the configuration groups and one line per key with its meaning.

The meanings are the schema's own (``setting(default, meaning)`` in ``job.config.schema``), so the
help and the schema cannot tell different stories. It is answered before Hydra, OmegaConf or numpy
are imported (the schema is plain dataclasses; the groups are the preset files' names), so ``--help``
takes a fraction of a plan run. Hydra's own options stay behind ``--hydra-help``. The app imports
this module before its signal handlers are in place, so it imports next to nothing at its top.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Iterator

HELP_FLAGS = ("--help", "-h")

HEADER = """\
reshard_job: reshard MindSpore distributed checkpoints (M ranks -> N ranks) as an auditable batch
job. Outputs are checksummed and every conversion is recorded in a lineage database
(python -m reshard_job.audit runs|show|trace|verify|compare).

Usage: python -m reshard_job [group=option ...] [key=value ...]   (-m: a sweep over comma lists)"""

FOOTER = """\
Examples:
  python -m reshard_job                                   # the built-in demo, 8 -> 4 ranks
  python -m reshard_job -m target.devices=1,2,4,8         # sweep the demo over card counts
  python -m reshard_job source.checkpoints=ckpt/ source.strategy=src_strategy.ckpt \\
      target.strategy=dst_strategy.ckpt output.dir=out/    # with MindSpore strategy files
  python -m reshard_job job.mode=plan ...                  # print the plan, write nothing
Use --cfg job to see the values in use (presets and overrides applied), --hydra-help for Hydra's
own options. Powered by Hydra (https://hydra.cc)"""


def wants_help(argv: list[str]) -> bool:
    """The command line asks for the app's help (Hydra's ``-h`` / ``--help``)."""
    return any(arg in HELP_FLAGS for arg in argv)


def help_text(conf_dir: str) -> str:
    """The whole help: header, configuration groups (from the preset folders under `conf_dir`),
    every key with its meaning, examples."""
    return "\n".join([HEADER, "", "== Configuration groups (group=option) ==", *group_lines(conf_dir), "",
                      "== Keys (key=value; +key=value adds one) ==", *key_lines(), "", FOOTER])


def group_lines(conf_dir: str) -> list[str]:
    """``group: option, option`` for each preset folder, as Hydra lists them."""
    lines = []
    for group in sorted(os.listdir(conf_dir)):
        folder = os.path.join(conf_dir, group)
        if not os.path.isdir(folder):
            continue
        options = sorted(name[:-len(".yaml")] for name in os.listdir(folder) if name.endswith(".yaml"))
        if options:
            lines.append(f"{group}: {', '.join(options)}")
    return lines


def key_lines() -> list[str]:
    """One line per key: a section's title, then its keys, aligned, each with its meaning."""
    from reshard_job.job.config.schema import ReshardConfig

    keys = list(schema_keys(ReshardConfig))
    width = max(len(key) for key, _, _ in keys)
    return [f"{key}: {meaning}" if section else f"  {key.ljust(width)}  {meaning}"
            for key, meaning, section in keys]


def schema_keys(schema: type, prefix: str = "") -> Iterator[tuple[str, str, bool]]:
    """(dotted key, meaning, is a top-level section) for every field of the `schema` dataclass and of
    the dataclasses nested in it, depth first; a list of dataclasses gives its items' keys as
    ``key[].field``."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        key = f"{prefix}{f.name}"
        yield key, f.metadata.get("help", ""), not prefix
        nested, item = _nested_schema(hints[f.name])
        if nested is not None:
            yield from schema_keys(nested, f"{key}[]." if item else f"{key}.")


def _nested_schema(hint) -> tuple[type | None, bool]:
    """(the dataclass a field holds, whether as list items) for X, Optional[X] or List[X]; else None."""
    import dataclasses
    import typing

    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if dataclasses.is_dataclass(hint):
        return hint, False
    if typing.get_origin(hint) is typing.Union and len(args) == 1:
        return _nested_schema(args[0])
    if typing.get_origin(hint) is list and args and dataclasses.is_dataclass(args[0]):
        return args[0], True
    return None, False
