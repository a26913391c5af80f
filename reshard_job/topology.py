"""A strategy file's meaning: devices per pipeline stage, stages, and each parameter's layout per stage.

Pure code over a parsed ``StrategyFile``. A merged pipeline file names its layouts
``"<stage>-<name>"``; a plain file is one stage. Global rank ``g`` belongs to stage
``g // stage_devices`` and is local rank ``g % stage_devices`` there (spec §4).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import LayoutError
from .formats.strategy import MERGED_KEY, ParamLayout, StrategyFile
from math import prod


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
        layouts: dict[str, dict[int, ParamLayout]] = {}
        if sf.merged:
            for key, lay in sf.layouts.items():
                m = MERGED_KEY.match(key)
                layouts.setdefault(m.group(2), {})[int(m.group(1))] = lay
        else:
            for key, lay in sf.layouts.items():
                layouts.setdefault(key, {})[0] = lay
        if not layouts:
            raise LayoutError(f"{sf.path}: strategy file has no parameter layouts")
        stages = sorted({s for per in layouts.values() for s in per})
        if stages != list(range(len(stages))):
            missing = sorted(set(range(max(stages) + 1)) - set(stages))
            raise LayoutError(f"{sf.path}: pipeline stages {missing} have no layouts (found stages {stages})")
        sizes = {prod(lay.dev_matrix) for per in layouts.values() for lay in per.values() if lay.dev_matrix}
        if not sizes:
            raise LayoutError(f"{sf.path}: every device matrix is empty (pipeline-only strategy)")
        stage_devices = max(sizes)
        bad = sorted(s for s in sizes if stage_devices % s)
        if bad:
            raise LayoutError(
                f"{sf.path}: device matrices describe {sorted(sizes)} devices; "
                f"{bad} do not divide the stage's {stage_devices} devices"
            )
        return Topology(stage_devices, len(stages), layouts, sf.path)

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
