"""Which source parameters a conversion keeps, and under which names (pure: no I/O).

MindSpore lets its users convert part of a model (``choice_func``) or rename it (``name_map``);
``target.include``, ``target.exclude`` and ``target.rename`` do the same here:

- ``include``: ``all`` (every parameter), ``weights`` (no optimizer state or training-loop
  bookkeeping, the rule ``plan.export_shards.is_training_state`` applies), or a list of glob
  patterns (``fnmatch``, case-sensitive): a parameter is kept when one of them matches it;
- ``exclude``: glob patterns; a parameter one of them matches is left out, whatever ``include`` said;
- ``rename``: ordered prefix rewrites (``backbone.`` -> ``model.``); the first prefix a name starts
  with is replaced, later ones are not tried. An optimizer state that no prefix matches follows its
  parameter (``adam_m.backbone.w`` becomes ``adam_m.model.w``), as the target network names it.

Patterns match a parameter's name in the source or its new name, so ``include=[model.*]`` with
``rename={backbone.: model.}`` keeps the renamed parameters. Renaming happens before the
parameters are matched against the target strategy, so a renamed network's strategy lines up.
Two names renamed onto one, or onto a name the source keeps as it is, are refused: which tensor
the output would hold under that name would be a guess.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterable

from reshard_job.core.topology import OPTIMIZER_PREFIXES
from reshard_job.errors import ConfigError, PlanError
from reshard_job.plan.export_shards import INCLUDE_ALL, INCLUDE_CHOICES, INCLUDE_WEIGHTS, is_training_state
from reshard_job.plan.name_patterns import NamePatterns
from reshard_job.text import shorten

SHOWN_LEFT_OUT = 5  # names of what is left out shown in the plan and the log
# One pattern or rename prefix: a parameter name is a few hundred characters at most, and a
# megabyte pattern of wildcards took seconds and half a gigabyte to compile.
MAX_PATTERN = 4096


@dataclass(frozen=True)
class Selection:
    """What the user asked for (``target.include``, ``target.exclude``, ``target.rename``)."""

    include: str | tuple[str, ...] = INCLUDE_ALL
    exclude: tuple[str, ...] = ()
    rename: tuple[tuple[str, str], ...] = ()
    optimizer_prefixes: tuple[str, ...] = field(default=tuple(OPTIMIZER_PREFIXES), compare=False)

    @property
    def active(self) -> bool:
        """Whether any parameter could be left out or renamed."""
        return self.include != INCLUDE_ALL or bool(self.exclude) or bool(self.rename)

    def new_name(self, name: str) -> str:
        renamed = self._rewritten(name)
        if renamed is not None:
            return renamed
        # an optimizer state follows its parameter: adam_m.backbone.w becomes adam_m.model.w
        for opt in self.optimizer_prefixes:
            if name.startswith(opt):
                renamed = self._rewritten(name[len(opt):])
                if renamed is not None:
                    return opt + renamed
        return name

    def _rewritten(self, name: str) -> str | None:
        return self._rewrites.rewritten(name)

    @cached_property
    def _rewrites(self) -> _Rewrites:
        return _Rewrites(self.rename)

    def describe(self) -> dict:
        """As recorded in the plan and the manifest."""
        include = self.include if isinstance(self.include, str) else list(self.include)
        return {"include": include, "exclude": list(self.exclude), "rename": [list(pair) for pair in self.rename]}


@dataclass
class Selected:
    """The outcome over a source's names: new name -> name in the source, for every parameter kept."""

    selection: Selection
    stored: dict[str, str]
    left_out: list[str]  # source names, sorted
    unmatched: list[str]  # patterns (include or exclude) that matched no parameter

    @property
    def renamed(self) -> dict[str, str]:
        """New name -> source name, for the kept parameters whose name changed."""
        return {new: old for new, old in self.stored.items() if new != old}

    def summary(self) -> dict:
        """The selection and its outcome, as the plan and the manifest record them."""
        return {**self.selection.describe(), "left_out": len(self.left_out),
                "left_out_first": self.left_out[:SHOWN_LEFT_OUT], "renamed": len(self.renamed)}

    def note(self) -> str:
        """One line for the plan report."""
        s = self.selection.describe()
        parts = [f"include={shorten(str(s['include']), 200)}"]  # (a pattern may be a megabyte long)
        if s["exclude"]:
            parts.append(f"exclude={shorten(str(s['exclude']), 200)}")
        if s["rename"]:
            parts.append("rename=" + shorten(", ".join(f"{old!r}->{new!r}" for old, new in self.selection.rename[:50]),
                                             200))
        shown = ", ".join(repr(shorten(n, 60)) for n in self.left_out[:SHOWN_LEFT_OUT])
        more = ", ..." if len(self.left_out) > SHOWN_LEFT_OUT else ""
        left = f"; {len(self.left_out)} parameter(s) left out" + (f": {shown}{more}" if shown else "")
        return f"selection: {' '.join(parts)}{left}; {len(self.renamed)} renamed"


class _Rewrites:
    """Ordered (old, new) prefix rewrites, the first whose old prefix a name starts with winning:
    one look-up per length of the old prefixes (a handful), not a test per rewrite (100,000 of
    them, for every name and for every optimizer prefix of it, took a minute)."""

    def __init__(self, pairs: tuple[tuple[str, str], ...]):
        self.first: dict[str, tuple[int, str]] = {}
        for i, (old, new) in enumerate(pairs):
            self.first.setdefault(old, (i, new))
        self.lengths = sorted({len(old) for old in self.first})

    def rewritten(self, name: str) -> str | None:
        best = None  # (rewrite's position, new prefix, old prefix's length)
        for length in self.lengths:
            if length > len(name):
                break
            hit = self.first.get(name[:length])
            if hit is not None and (best is None or hit[0] < best[0]):
                best = (*hit, length)
        return None if best is None else best[1] + name[best[2]:]


def kept(selection: Selection, names: Iterable[str]) -> list[str]:
    """The `names` that `selection` keeps, in their order (``select`` without its refusals)."""
    keeps = _keeps(selection, *_patterns(selection))
    return [name for name in names if keeps(name, selection.new_name(name))]


def _patterns(selection: Selection) -> tuple[NamePatterns | None, NamePatterns | None]:
    """The include patterns (None for ``all`` or ``weights``) and the exclude ones (None for none)."""
    patterns = () if isinstance(selection.include, str) else selection.include
    return (NamePatterns(patterns) if patterns else None,
            NamePatterns(selection.exclude) if selection.exclude else None)


def _keeps(selection: Selection, include: NamePatterns | None, exclude: NamePatterns | None):
    """keeps(name, new name) -> whether `selection` keeps that parameter."""
    return lambda name, new: _included(selection, name, new, include) and not (
        exclude is not None and (exclude.matches(name) or exclude.matches(new)))


def select(selection: Selection, names: Iterable[str]) -> Selected:
    """Apply `selection` to the source's parameter names (module docstring); PlanError when nothing
    is left or two parameters would share a name."""
    names = list(dict.fromkeys(names))  # the source's order: the outputs keep it
    include, exclude = _patterns(selection)
    keeps = _keeps(selection, include, exclude)
    stored: dict[str, str] = {}
    left_out: list[str] = []
    news = [selection.new_name(name) for name in names]
    for name, new in zip(names, news):
        if not keeps(name, new):
            left_out.append(name)
            continue
        other = stored.get(new)
        if other is not None:
            first, second = sorted((other, name), key=lambda n: (n != new, n))
            raise PlanError(f"target.rename: parameters {first!r} and {second!r} would both be named {new!r}; "
                            "change the rename so that every name stays unique")
        stored[new] = name
    if not stored:
        described = selection.describe()  # (100,000 patterns: the first few)
        raise PlanError(f"target.include/target.exclude leave none of the {len(names)} source parameter(s) "
                        f"(include={shorten(str(described['include']), 200)}, "
                        f"exclude={shorten(str(described['exclude']), 200)})")
    seen = (*names, *news)  # a pattern matches a parameter's source name or its new one
    unmatched = [p for patterns in (include, exclude) if patterns is not None for p in patterns.unmatched(seen)]
    return Selected(selection, stored, sorted(left_out), unmatched)


def _included(selection: Selection, name: str, new: str, include: NamePatterns | None) -> bool:
    if include is not None:
        return include.matches(name) or include.matches(new)
    if selection.include == INCLUDE_WEIGHTS:
        return not is_training_state(name, selection.optimizer_prefixes)
    return True


# ------------------------------------------------------------------------------ settings
def include_value(value, key: str = "target.include") -> str | tuple[str, ...]:
    """``all``, ``weights`` or a list of glob patterns, from a configuration or API value."""
    if isinstance(value, str) and value in INCLUDE_CHOICES:
        return value
    if isinstance(value, (list, tuple)) and value:
        return patterns_value(value, key)
    raise ConfigError(f"{key} must be {' or '.join(INCLUDE_CHOICES)}, or a list of name patterns "
                      f"(e.g. [model.*,lm_head.*]), got {shorten(repr(value), 60)}")


def patterns_value(value, key: str = "target.exclude") -> tuple[str, ...]:
    """A list of glob patterns (None or [] for none)."""
    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, (list, tuple)) \
            or not all(isinstance(p, str) and p for p in value):
        raise ConfigError(f"{key} must be a list of name patterns (e.g. [adam_m.*,adam_v.*]), "
                          f"got {shorten(repr(value), 60)}")
    for i, pattern in enumerate(value):
        _check_length(pattern, f"{key}[{i}]")
    return tuple(value)


def _check_length(text: str, where: str) -> None:
    if len(text) > MAX_PATTERN:
        raise ConfigError(f"{where} has {len(text)} characters ({shorten(repr(text), 40)}); at most {MAX_PATTERN}, "
                          "more than any parameter name has")


def rename_value(value, key: str = "target.rename") -> tuple[tuple[str, str], ...]:
    """Ordered (old prefix, new prefix) pairs from a map (``{backbone.: model.}``) or a list of pairs."""
    if value is None:
        return ()
    pairs = list(value.items()) if isinstance(value, dict) else value
    if isinstance(pairs, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
        out = tuple((p[0], p[1]) for p in pairs)
        if all(isinstance(old, str) and old and isinstance(new, str) for old, new in out):
            for i, (old, new) in enumerate(out):
                _check_length(old, f"{key}[{i}]'s prefix")
                _check_length(new, f"{key}[{i}]'s new prefix")
            return out
    raise ConfigError(f"{key} must map name prefixes to new ones, in order (e.g. {{backbone.: model.}}), "
                      f"got {shorten(repr(value), 60)}")
