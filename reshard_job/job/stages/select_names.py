"""Applying ``target.include``/``exclude``/``rename`` to a prepared source (``plan.selection``).

The selection is a view of the source: its index, its strategy's layouts and its readers
(``SourceFiles.select``) answer under the new names and hold only what is kept, so the planner,
the writer, the target strategy's matching and the proof see the converted names and nothing
else, without knowing a selection was made. Cross-checks of the source against itself run before
it, on the files' own names.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace

from reshard_job.core.topology import Topology
from reshard_job.execute.tasks import FORMAT_SAFETENSORS_INDEX
from reshard_job.job.config.spec import TargetSpec
from reshard_job.plan.export_shards import INCLUDE_ALL, INCLUDE_WEIGHTS, is_training_state
from reshard_job.plan.selection import Selected, Selection, kept, select
from reshard_job.sources.mindformers_absent import unavailable_error
from reshard_job.sources.rank_folders import LoadedStrategy
from reshard_job.text import listed, shorten

log = logging.getLogger("reshard_job")


def include_of(target: TargetSpec):
    """``target.include`` as given, or the format's default: ``weights`` for an export, else ``all``."""
    if target.include is not None:
        return target.include
    return INCLUDE_WEIGHTS if target.format == FORMAT_SAFETENSORS_INDEX else INCLUDE_ALL


def export_include(target: TargetSpec) -> str:
    """What an export's own rule leaves out (``plan.export_shards``): ``weights`` or ``all``; name
    patterns are the source's selection, so the export then keeps all it is given."""
    include = include_of(target)
    return include if isinstance(include, str) else INCLUDE_ALL


def selection_of(target: TargetSpec, optimizer_prefixes=None) -> Selection | None:
    """The source-side selection `target` asks for; None when every parameter is kept as it is.
    An export's ``weights``/``all`` stay the export's own rule (its omissions are listed as before)."""
    include = include_of(target)
    if target.format == FORMAT_SAFETENSORS_INDEX and isinstance(include, str):
        include = INCLUDE_ALL
    extra = {"optimizer_prefixes": tuple(optimizer_prefixes)} if optimizer_prefixes else {}
    selection = Selection(include, tuple(target.exclude or ()), tuple(target.rename or ()), **extra)
    return selection if selection.active else None


def optimizer_prefixes(target: TargetSpec):
    """The optimizer prefixes ``include=weights`` leaves out: a declarative target layout's own."""
    return (target.layout or {}).get("optimizer_prefixes") or None


def under_stored_names(plan, selected: Selected | None):
    """`plan` as far as which files it reads goes, under the source's own names."""
    if selected is None or not selected.renamed:
        return plan
    from types import SimpleNamespace

    stored = selected.stored
    return SimpleNamespace(ranks=[SimpleNamespace(params=[SimpleNamespace(name=stored.get(p.name, p.name),
                                                                          copies=p.copies) for p in rp.params])
                                  for rp in plan.ranks])


def renamed_strategy(strategy: LoadedStrategy, selection: Selection | None) -> LoadedStrategy:
    """The strategy's layouts under the new names (every one: what is left out is known later)."""
    if selection is None or not selection.rename:
        return strategy
    return _with_layouts(strategy, {selection.new_name(n): lay for n, lay in strategy.topology.layouts.items()})


def apply_selection(selection: Selection | None, strategy: LoadedStrategy, readers, index):
    """(strategy, index, Selected) seen through `selection`: `readers` answer under the new names
    from now on. Unchanged when there is no selection."""
    if selection is None:
        return strategy, index, None
    selected = _select_all(selection, index)
    readers.select(selected.stored)
    kept = selected.stored
    layouts = {n: lay for n, lay in renamed_strategy(strategy, selection).topology.layouts.items() if n in kept}
    return _with_layouts(strategy, layouts), readers.index(), selected


def select_index(selection: Selection | None, strategy: LoadedStrategy, index, absent: list[str] = ()):
    """Like ``apply_selection``, for an index known before any file is open (a MindFormers save);
    `absent`: parameters of files absent from the save, which the selection leaves out."""
    if selection is None:
        return strategy, index, None
    selected = _select_all(selection, index, absent)
    stored = selected.stored
    view = {r: {new: held[old] for new, old in stored.items() if old in held} for r, held in index.items()}
    layouts = {n: lay for n, lay in renamed_strategy(strategy, selection).topology.layouts.items() if n in stored}
    return _with_layouts(strategy, layouts), view, selected


def narrow_target(target, selected: Selected | None):
    """The target strategy without what the selection left out: a strategy of the whole network
    lays out the parameters not converted too, which the outputs then rightly lack."""
    if selected is None or not selected.left_out or target.topology is None:
        return target
    gone = {selected.selection.new_name(n) for n in selected.left_out} - set(selected.stored)
    layouts = target.topology.layouts
    if not gone & layouts.keys():
        return target
    return replace(target, topology=replace(target.topology, layouts={n: v for n, v in layouts.items()
                                                                       if n not in gone}))


def _select_all(selection: Selection, index, absent: list[str] = ()) -> Selected:
    """`selection` over every rank's names (in the order the source holds them) and `absent`, said in the log."""
    names: dict[str, None] = {}
    for held in index.values():
        names.update(dict.fromkeys(held))
    names.update(dict.fromkeys(absent))
    selected = select(selection, names)
    unmatched = selected.unmatched
    if len(unmatched) == 1:
        log.warning("target.include/target.exclude pattern %s matches no parameter of the source",
                    shorten(repr(unmatched[0]), 100))
    elif unmatched:  # one line for them all (100,000 patterns were 100,000 lines)
        log.warning("%d target.include/target.exclude patterns match no parameter of the source: %s",
                    len(unmatched), listed(unmatched, show=lambda p: shorten(repr(p), 100)))
    log.info("%s", selected.note())
    return selected


def _with_layouts(strategy: LoadedStrategy, layouts: dict) -> LoadedStrategy:
    topology: Topology = strategy.topology
    return replace(strategy, topology=replace(topology, layouts=layouts))


def record_in_plan(plan, selected: Selected | None) -> None:
    """The plan says what the selection kept out and renamed (its report and its JSON)."""
    if selected is None:
        return
    plan.notes.append(selected.note())
    plan.selection = selected.summary()


def leave_out_unavailable(save, target: TargetSpec, selection: Selection | None) -> tuple[list[str], list[str]]:
    """The parameters of a MindFormers save whose files are absent (``save.unavailable``): refused
    in one line when the conversion needs any of them, else (those the selection leaves out, those
    an export's ``weights`` leaves out)."""
    names = list(save.unavailable)
    if not names:
        return [], []
    wanted = names if selection is None else kept(selection, names)
    kept_ones = set(wanted)
    by_selection = [n for n in names if n not in kept_ones]
    prefixes = selection.optimizer_prefixes if selection is not None else Selection().optimizer_prefixes
    by_export = []
    if target.format == FORMAT_SAFETENSORS_INDEX and export_include(target) == INCLUDE_WEIGHTS:
        by_export = [n for n in wanted if is_training_state(n, prefixes)]
        wanted = [n for n in wanted if not is_training_state(n, prefixes)]
    if wanted:
        hint = ""
        if include_of(target) == INCLUDE_ALL and all(is_training_state(n, prefixes) for n in wanted):
            hint = "; target.include=weights converts the weights without them"
        raise unavailable_error(save, wanted, hint)
    files = save.absent_files
    log.warning("%d file(s) of the save are absent (%s%s): their %d parameter(s) are left out, as %s leaves them out "
                "anyway", len(files), ", ".join(os.path.basename(f) for f in files[:3]), ", …" if len(files) > 3 else "",
                len(names), "the export's include=weights" if by_export else "target.include/exclude")
    return by_selection, by_export
