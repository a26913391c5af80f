"""A strategy file's meaning: devices per pipeline stage, stages, and each parameter's layout per stage.

Pure code over a parsed ``StrategyFile``. A merged pipeline file names its layouts
``"<stage>-<name>"``; a plain file is one stage. Global rank ``g`` belongs to stage
``g // stage_devices`` and is local rank ``g % stage_devices`` there (spec §4).

Stage numbers must be exactly ``0..k-1`` (gaps are found from the sorted stages, never by listing
``range(max)``), and stages times devices per stage stay within ``MAX_DEVICES``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from math import prod

from reshard_job.errors import LayoutError
from reshard_job.core.strategy_model import (MAX_DEVICES, MAX_STAGES, ParamLayout, StrategyFile, missing_stages,
                                             stage_prefixes)
from reshard_job.text import bounded_list, quoted

# Prefixes of optimizer-state entries and gradient accumulators. Each such entry holds a tensor of
# its parameter's shape, laid out (and optimizer-sharded) like the parameter. The same list as the
# default of ``target.layout.optimizer_prefixes`` in the job configuration.
OPTIMIZER_PREFIXES = (
    "adam_m.", "adam_v.", "moments.", "accu_grads.", "accum.", "exp_avg.", "exp_avg_sq.",
    "moment1.", "moment2.", "mean_grad.", "mean_square.", "momentum.",
)


_OPTIMIZER_STATE = re.compile("(?:" + "|".join(re.escape(p) for p in OPTIMIZER_PREFIXES) + ")(.+)", re.S)


def optimizer_base(name: str) -> str | None:
    """The parameter an optimizer-state entry belongs to (``adam_m.w`` -> ``w``), else None."""
    if not name.startswith(OPTIMIZER_PREFIXES):  # most names: one C-level test, not a regex match
        return None
    m = _OPTIMIZER_STATE.match(name)
    return m.group(1) if m else None


@dataclass
class Topology:
    stage_devices: int
    num_stages: int
    # name -> {stage -> layout as recorded}
    layouts: dict[str, dict[int, ParamLayout]] = field(default_factory=dict)
    source: str | None = None  # where it came from (file path), for messages

    @property
    def devices(self) -> int:
        return self.stage_devices * self.num_stages

    @staticmethod
    def unsharded() -> "Topology":
        """No strategy: one device holds every parameter whole."""
        return Topology(1, 1, {}, None)

    @staticmethod
    def from_strategy(sf: StrategyFile) -> "Topology":
        where = sf.path or "strategy"
        layouts: dict[str, dict[int, ParamLayout]] = {}
        if sf.merged:
            stages = {p: int(p) for p in stage_prefixes(sf.layouts)}  # (keys split on their first "-")
            for key, lay in sf.layouts.items():
                prefix, _, name = key.partition("-")
                stage = stages[prefix]
                if stage >= MAX_STAGES:
                    raise LayoutError(f"{where}: layout {quoted(key)} names pipeline stage {stage}, "
                                      f"beyond the {MAX_STAGES} stages supported")
                layouts.setdefault(name, {})[stage] = lay
        else:
            _check_single_stage(sf)
            # one mapping per distinct layout (a parsed file shares equal layouts already; a compiled
            # one may hold an equal object per parameter, 600,000 of them)
            alike: dict[ParamLayout, dict[int, ParamLayout]] = {}  # (hashes are computed once per layout)
            for key, lay in sf.layouts.items():
                per = alike.get(lay)
                if per is None:
                    per = alike[lay] = {0: lay}
                layouts[key] = per
            return _checked(sf, layouts)
        return _checked(sf, _shared_mappings(layouts))

    # ----------------------------------------------------------------------------------- queries
    def stages_of(self, name: str) -> list[int]:
        return sorted(self.layouts.get(name, {}))

    def __contains__(self, name: str) -> bool:
        return name in self.layouts

    def stage_of_rank(self, rank: int) -> int:
        return rank // self.stage_devices

    def local_rank(self, rank: int) -> int:
        return rank % self.stage_devices

    def global_rank(self, stage: int, local: int) -> int:
        return stage * self.stage_devices + local

    def layout(self, name: str, stage: int) -> ParamLayout | None:
        return self.layouts.get(name, {}).get(stage)

    def lowest_stage(self, name: str) -> int | None:
        stages = self.stages_of(name)
        return stages[0] if stages else None


def _check_single_stage(sf: StrategyFile) -> None:
    """A file without stage prefixes describes one stage, placed at ranks ``0..P-1``. That is right
    for a plain (non-pipeline) file and for stage 0 of a pipeline; a file whose operators belong to
    a later stage (or to several) describes other ranks, and taking it for stage 0 would lay its
    parameters out on the wrong ones."""
    claimed = sorted({it.stage for it in sf.items})
    where = sf.path or "strategy"
    if claimed and claimed != [0]:
        if len(claimed) == 1:
            raise LayoutError(
                f"{where}: is the strategy of pipeline stage {claimed[0]} alone (its operators' stage); "
                "give the per-stage files of all stages (their directory, or a merged file)"
            )
        raise LayoutError(
            f"{where}: its operators claim pipeline stages {bounded_list(claimed)}, but its layout names carry no "
            "matching '<stage>-' prefix; merge the per-stage files of all stages"
        )


def _shared_mappings(layouts: dict[str, dict[int, ParamLayout]]) -> dict[str, dict[int, ParamLayout]]:
    """Parameters laid out alike (at every stage) share one mapping. Alike means the same layout
    objects: a parsed file shares its equal layouts already, and a key of ids is made in C (one of
    layouts, hashed through Python, took half a second for 20,000 stages of 18 parameters)."""
    shared: dict[tuple, dict[int, ParamLayout]] = {}
    canonical: dict[int, dict[int, ParamLayout]] = {}  # id of a mapping -> its shared equal
    for name, per in layouts.items():
        same = canonical.get(id(per))
        if same is None:
            key = (tuple(per), tuple(map(id, per.values())))  # (the layouts are held by `per`)
            same = canonical[id(per)] = shared.setdefault(key, per)
        layouts[name] = same
    return layouts


def _checked(sf: StrategyFile, layouts: dict[str, dict[int, ParamLayout]]) -> Topology:
    """The topology of `layouts` (name -> stage -> layout), its stages and device counts checked."""
    where = sf.path or "strategy"
    if not layouts:
        raise LayoutError(f"{where}: strategy file has no parameter layouts")
    distinct = {id(per): per for per in layouts.values()}.values()
    stages = sorted({s for per in distinct for s in per})
    missing = missing_stages(stages)
    if missing:
        raise LayoutError(f"{where}: pipeline stages {bounded_list(missing)} have no layouts "
                          f"(found stages {bounded_list(stages)})")
    sizes = {prod(lay.dev_matrix) for per in distinct for lay in per.values() if lay.dev_matrix}
    if not sizes:
        raise LayoutError(f"{where}: every device matrix is empty (pipeline-only strategy)")
    stage_devices = max(sizes)
    bad = sorted(s for s in sizes if stage_devices % s)
    if bad:
        raise LayoutError(
            f"{where}: device matrices describe {bounded_list(sorted(sizes))} devices; "
            f"{bounded_list(bad)} do not divide the stage's {stage_devices} devices"
        )
    if stage_devices * len(stages) > MAX_DEVICES:
        raise LayoutError(f"{where}: {len(stages)} pipeline stages of {stage_devices} devices exceed the "
                          f"{MAX_DEVICES} devices supported")
    return Topology(stage_devices, len(stages), layouts, sf.path)
