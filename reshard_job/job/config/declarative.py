"""Declarative target layouts: a named device mesh and per-parameter rules, compiled into a
MindSpore strategy file, so that resharding for N cards does not require compiling the target
network on N cards.

Pure code. Semantics:

* ``mesh`` is an ordered mapping of axis names to sizes; the first axis varies slowest (it becomes
  the leftmost entry of MindSpore's device matrix). Its product must equal ``target.devices``.
* ``rules`` are tried in order; the first whose regular expression matches the whole parameter name
  gives its ``dims``: one entry per tensor dimension, each ``null`` (not split), an axis name, or a
  list of axis names (the dimension is split by their product, first axis most significant).
  ``dims: []`` means fully replicated, whatever the tensor's rank.
* Optimizer-state entries (``adam_m.<param>`` and the like) follow the rule of ``<param>`` unless a
  rule matches the full name but not ``<param>`` (i.e. the rule names them explicitly).
* ``optimizer_shard: <axis>`` additionally shards dimension 0 across that axis. MindSpore's
  optimizer sharding always uses the innermost device axes a parameter does not use, so the shard
  count is the product of the unused axes from ``<axis>`` inwards (for a weight split over ``mp``
  with mesh ``{dp, mp}`` that is ``dp``; for a fully replicated one ``dp × mp``, like MindSpore's
  ``optimizer_weight_shard_size=-1``). Parameters whose dimension 0 does not divide are left
  without optimizer sharding, as MindSpore does; the compiler reports them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from math import prod
from typing import Any, Mapping, Sequence

from reshard_job.errors import ConfigError, LayoutError
from reshard_job.core.strategy_model import ParamLayout, StrategyFile, StrategyItem
from reshard_job.text import shorten

NODE_NAME = "declarative_layout"


@dataclass
class CompiledLayout:
    strategy: StrategyFile
    notes: list[str] = field(default_factory=list)
    rule_of: dict[str, int] = field(default_factory=dict)  # parameter -> index of the rule used


@dataclass(frozen=True)
class _Rule:
    index: int
    pattern: re.Pattern
    source: str
    dims: tuple[tuple[str, ...] | None, ...] | None  # None: fully replicated ([])


def _parse_rules(rules: Sequence[Mapping[str, Any]], mesh: Mapping[str, int]) -> list[_Rule]:
    out = []
    for i, rule in enumerate(rules):
        where = f"target.layout.rules[{i}]"
        if "match" not in rule:
            raise ConfigError(f"{where}: needs a 'match' regular expression")
        try:
            pattern = re.compile(str(rule["match"]))
        except re.error as e:
            raise ConfigError(f"{where}: match {rule['match']!r} is not a valid regular expression ({e})") from None
        raw = rule.get("dims", [])
        if raw is None:
            raw = []
        if not isinstance(raw, (list, tuple)):
            raise ConfigError(f"{where}: dims must be a list (one entry per tensor dimension), got {raw!r}")
        dims: list[tuple[str, ...] | None] = []
        seen: set[str] = set()
        for entry in raw:
            if entry is None:
                dims.append(None)
                continue
            axes = (entry,) if isinstance(entry, str) else tuple(entry) if isinstance(entry, (list, tuple)) else None
            if axes is None or not all(isinstance(a, str) for a in axes):
                raise ConfigError(f"{where}: a dims entry must be null, an axis name or a list of axis names, got {entry!r}")
            for a in axes:
                if a not in mesh:
                    raise ConfigError(f"{where}: unknown axis {a!r} (mesh axes: {', '.join(mesh)})")
                if a in seen:
                    raise ConfigError(f"{where}: axis {a!r} splits more than one dimension")
                seen.add(a)
            dims.append(axes if axes else None)
        out.append(_Rule(i, pattern, str(rule["match"]), tuple(dims) if raw else None))
    return out


def _validate_mesh(mesh: Mapping[str, Any], devices: int) -> dict[str, int]:
    if not mesh:
        raise ConfigError("target.layout.mesh is empty; give ordered named axes, e.g. {dp: 1, mp: 4}")
    out = {}
    for name, size in mesh.items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ConfigError(f"target.layout.mesh.{name}: size must be a positive integer, got {size!r}")
        out[str(name)] = size
    if prod(out.values()) != devices:
        shown = " x ".join(f"{k}={v}" for k, v in out.items())
        raise ConfigError(f"target.layout.mesh {shown} has {prod(out.values())} devices but target.devices is {devices}")
    return out


class _RuleFinder:
    """The first rule whose pattern matches a whole name (``_rule_for``), for many names: where the
    rules' patterns capture nothing, one pattern of them all (``(?P<r0>…)|(?P<r1>…)|…``) finds it
    in one match, which tries the alternatives in order as the rules are tried; a name no rule
    matches costs one failed match, not one per rule (600,000 names against a preset's rules)."""

    def __init__(self, rules: list[_Rule], prefixes: Sequence[str]):
        self.rules, self.prefixes = rules, tuple(prefixes)
        self._all = None
        if rules and all(r.pattern.groups == 0 for r in rules):
            try:
                self._all = re.compile("|".join(f"(?P<r{i}>{r.pattern.pattern})" for i, r in enumerate(rules)))
            except (re.error, RecursionError, OverflowError):  # (inline flags in the middle, and the like)
                self._all = None

    def __call__(self, name: str) -> _Rule | None:
        if self.prefixes and name.startswith(self.prefixes):
            return _rule_for(name, self.rules, self.prefixes)
        if self._all is None:
            return _rule_for(name, self.rules, ())
        m = self._all.fullmatch(name)
        return None if m is None else self.rules[int(m.lastgroup[1:])]


def _rule_for(name: str, rules: list[_Rule], prefixes: Sequence[str]) -> _Rule | None:
    base = None
    for p in prefixes:
        if name.startswith(p) and len(name) > len(p):
            base = name[len(p):]
            break
    if base is not None:
        for rule in rules:  # a rule that names the optimizer state itself
            if rule.pattern.fullmatch(name) and not rule.pattern.fullmatch(base):
                return rule
        name = base
    for rule in rules:
        if rule.pattern.fullmatch(name):
            return rule
    return None


def compile_layout(layout: Mapping[str, Any], devices: int, params: Mapping[str, Sequence[int]]) -> CompiledLayout:
    """Turn a declarative layout into a strategy for `params` ({name: global shape}).

    Parameters no rule matches are left out of the strategy (they are then handled as MindSpore
    handles parameters outside a strategy). Errors name the parameter and the rule.
    """
    mesh = _validate_mesh(layout.get("mesh") or {}, devices)
    axes = list(mesh)
    dev_matrix = tuple(mesh[a] for a in axes)
    opt_axis = layout.get("optimizer_shard")
    if opt_axis is not None and opt_axis not in mesh:
        raise ConfigError(f"target.layout.optimizer_shard: unknown axis {opt_axis!r} (mesh axes: {', '.join(axes)})")
    rules = _parse_rules(layout.get("rules") or [], mesh)
    find = _RuleFinder(rules, list(layout.get("optimizer_prefixes") or []))
    layouts: dict[str, ParamLayout] = {}
    notes: list[str] = []
    rule_of: dict[str, int] = {}
    maps: dict[tuple, tuple] = {}  # (rule, shape) -> (dims, tensor map): names of one shape and rule alike
    # without optimizer sharding a layout follows from the rule and the shape alone: one object for
    # all of them (a model of 600,000 parameters has a handful of layouts)
    alike: dict[tuple, ParamLayout] | None = {} if opt_axis is None else None
    for name, shape in params.items():
        shape = tuple(map(int, shape))
        rule = find(name)
        if rule is None:
            continue
        rule_of[name] = rule.index
        if alike is not None and (rule.index, shape) in alike:
            layouts[name] = alike[rule.index, shape]
            continue
        known = maps.get((rule.index, shape))
        if known is None:
            known = maps[rule.index, shape] = _tensor_map(name, shape, rule, mesh)
        dims, tensor_map = known
        step, size_k = _optimizer_shard(name, shape, dims, mesh, axes, opt_axis, notes)
        layouts[name] = ParamLayout(dev_matrix, tensor_map, step, size_k)
        if alike is not None:
            alike[rule.index, shape] = layouts[name]
    if not layouts:
        raise ConfigError("target.layout.rules match none of the checkpoint's parameters")
    notes.extend(_unmatched(rules, rule_of))
    sf = StrategyFile(layouts, [StrategyItem(NODE_NAME, 0, ())], 1)
    return CompiledLayout(sf, notes, rule_of)


def _tensor_map(name: str, shape: tuple[int, ...], rule: _Rule, mesh: dict[str, int]) -> tuple[tuple, tuple]:
    """(dims, MindSpore tensor map) that `rule` gives a parameter of `shape`; errors name it."""
    n = len(mesh)
    position = {a: i for i, a in enumerate(mesh)}
    dims = rule.dims if rule.dims is not None else (None,) * len(shape)
    if len(dims) != len(shape):
        raise LayoutError(
            f"parameter {name!r} has {len(shape)} dimension(s) {list(shape)} but target.layout.rules"
            f"[{rule.index}] (match {rule.source!r}) gives {len(dims)} dims entries"
        )
    entries = []
    for i, (size, ax) in enumerate(zip(shape, dims)):
        factor = prod(mesh[a] for a in ax) if ax else 1
        if size % factor:
            raise LayoutError(
                f"parameter {name!r}: dimension {i} of size {size} is not divisible by "
                f"{' x '.join(ax)} = {factor} (target.layout.rules[{rule.index}], match {rule.source!r})"
            )
        entries.append(tuple(n - 1 - position[a] for a in ax) if ax else (-1,))
    nested = any(len(e) > 1 for e in entries)
    return dims, (tuple(entries) if nested else tuple(e[0] for e in entries))


def _unmatched(rules: list[_Rule], rule_of: dict[str, int]) -> list[str]:
    """Rules no parameter used: a preset written for other names silently replicates everything."""
    used = set(rule_of.values())
    return [f"target.layout.rules[{r.index}] (match {shorten(repr(r.source), 100)}){UNMATCHED_RULE}"
            for r in rules if r.index not in used]


UNMATCHED_RULE = " matches no parameter of this checkpoint"


def _optimizer_shard(name, shape, dims, mesh, axes, opt_axis, notes) -> tuple[int, int]:
    """(opt_weight_shard_step, opt_weight_shard_size) as MindSpore records them, or (0, 0)."""
    if opt_axis is None or not shape:
        return 0, 0
    used = {a for ax in dims if ax for a in ax}
    start = axes.index(opt_axis)
    inner = [a for a in axes[start:] if a not in used and mesh[a] > 1]
    k = prod(mesh[a] for a in inner)
    if k <= 1:
        return 0, 0
    split0 = prod(mesh[a] for a in dims[0]) if dims[0] else 1
    if shape[0] % (split0 * k):
        notes.append(f"{name}: dimension 0 ({shape[0]}) does not divide into {split0 * k} parts; "
                     "no optimizer sharding for it")
        return 0, 0
    # step: rank distance between consecutive replicas of rank 0 (MindSpore's record)
    weights = {a: prod(mesh[b] for b in axes[i + 1:]) for i, a in enumerate(axes)}
    unused = [a for a in axes if a not in used and mesh[a] > 1]
    step = min(weights[a] for a in unused)
    return step, k
