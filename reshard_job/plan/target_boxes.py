"""Where each tensor of a target rank lies in its global tensor: the box, from the target layout.

A rank's plan says what shape each of its tensors has and which source boxes fill it, but not
where the tensor sits in the global one: the copies' target boxes are within the rank's own
tensor. A load that fingerprints what it returns needs that place (the fingerprint is keyed by
global position), so it is derived here from the target strategy the way the planner lays the
parameter out: the layout recorded under the parameter's name for the rank's stage, or, for an
optimizer state of a target strategy that lists none, its parameter's layout when the shapes
agree; a parameter the target does not lay out (or no target strategy) is held whole.

Each box is checked against the tensor's planned shape, so a box that disagrees with the plan is
an error here, never a wrong record.
"""

from __future__ import annotations

from typing import Iterator, Sequence

from reshard_job.core.boxes import Box, box_shape, full_box
from reshard_job.core.layout import Layout, unflatten
from reshard_job.core.topology import Topology, optimizer_base
from reshard_job.plan.model import ACTION_COPY, ParamPlans, TensorFacts


def planned_tensors(params) -> Iterator[tuple[TensorFacts, tuple[int, ...]]]:
    """``(facts, target shape)`` of each tensor of a rank's plan (``ParamPlans`` or ParamPlans' items)."""
    if isinstance(params, ParamPlans):
        yield from ((t, tuple(piece[0])) for t, piece in zip(params.tensors, params.slices))
        return
    yield from ((p.tensor, tuple(p.target_shape)) for p in params)


class TargetBoxes:
    """The global box of each tensor target rank `target_rank` holds under `dst` (None: one whole model).

    `shapes`: the global shape of every parameter the rank holds (for the optimizer states that
    follow their parameter's layout)."""

    def __init__(self, dst: Topology | None, target_rank: int, shapes: dict[str, tuple[int, ...]]):
        self.dst, self.shapes = dst, shapes
        self.stage, self.local = divmod(target_rank, dst.stage_devices) if dst is not None else (0, 0)
        self._lists_states = dst is not None and any(optimizer_base(n) is not None for n in dst.layouts)
        # (recorded layout, shape) -> box: a model's parameters are laid out in a few ways (equal
        # recorded layouts are one object in a Topology), so most boxes are found here
        self._boxes: dict[tuple, Box] = {}

    def box(self, tensor: TensorFacts, target_shape: Sequence[int]) -> Box:
        shape = tuple(tensor.global_shape)
        recorded = self._recorded(tensor) if tensor.action != ACTION_COPY else None
        key = (id(recorded), shape)
        box = self._boxes.get(key)
        if box is None:
            box = self._boxes[key] = self._laid_out(tensor.name, recorded, shape)
        if box_shape(box) != tuple(target_shape):
            raise ValueError(f"parameter {tensor.name!r}: its box {list(box)} in the target layout does not have "
                             f"the planned shape {list(target_shape)}")
        return box

    def _laid_out(self, name: str, recorded, shape: tuple[int, ...]) -> Box:
        if recorded is None:
            return full_box(shape)
        stage_devices = self.dst.stage_devices
        layout = Layout.from_recorded(unflatten(recorded, len(shape), stage_devices=stage_devices, global_shape=shape,
                                                name=name), len(shape), stage_devices, name)
        return layout.box(self.local % layout.devices, shape)

    def _recorded(self, tensor: TensorFacts):
        if self.dst is None:
            return None
        per_stage = self.dst.layouts.get(tensor.name)
        if per_stage is None and not self._lists_states:
            base = optimizer_base(tensor.name)
            if base is not None and self.shapes.get(base) == tuple(tensor.global_shape):
                per_stage = self.dst.layouts.get(base)
        return None if per_stage is None else per_stage.get(self.stage)

