"""Where a stored record of one source rank lies in its global tensor, foreseen from the strategy alone.

A remote source is hashed while it is indexed: its bytes stream past once, before any plan exists.
The sources' fingerprints need, for each record, the global tensor it belongs to and the box it
fills there, which the one-device plan (``proof.collect``) says only after every rank is indexed.
For the common records (a parameter's slice stored whole in one record, laid out by the source
strategy, or not laid out and stored whole) that box follows from the strategy, the rank and the
record's own dims, which the walk knows as the record passes: ``RecordBoxes`` works it out then,
so that the record's partial fingerprint is taken from the bytes already streaming
(``proof.stream_taps``). It is a forecast: the plan's own box is compared with it later, and a
record forecast wrong is read again, never used.

Pure: no I/O, no protobuf.
"""

from __future__ import annotations

from reshard_job.core.boxes import Box
from reshard_job.core.layout import Layout, unflatten
from reshard_job.core.topology import Topology, optimizer_base
from reshard_job.errors import ReshardError


class RecordBoxes:
    """(global shape, box) of the records of one source rank, by name and stored dims; None where
    the strategy does not say (the record is then fingerprinted when the plan says how)."""

    def __init__(self, topology: Topology | None, rank: int):
        self.topology = topology
        self.rank = rank
        self._known: dict[tuple, tuple[tuple[int, ...], Box] | None] = {}  # (layout, dims) -> answer

    def __call__(self, name: str, dims: tuple[int, ...]) -> tuple[tuple[int, ...], Box] | None:
        recorded = self._recorded(name)
        if recorded is None:  # not laid out: every file holds it whole
            shape = tuple(dims)
            return shape, tuple((0, n) for n in shape)
        key = (recorded, tuple(dims))
        if key not in self._known:
            self._known[key] = self._box(recorded, tuple(dims), name)
        return self._known[key]

    def _recorded(self, name: str):
        """The layout the strategy records for `name` in this rank's stage (or for the parameter an
        optimizer state follows); None where it records none."""
        topo = self.topology
        if topo is None:
            return None
        per_stage = topo.layouts.get(name)
        if per_stage is None:
            base = optimizer_base(name)
            per_stage = topo.layouts.get(base) if base is not None else None
        if per_stage is None:
            return None
        stage = topo.stage_of_rank(self.rank)
        return per_stage.get(stage) or next(iter(per_stage.values()))

    def _box(self, recorded, dims: tuple[int, ...], name: str) -> tuple[tuple[int, ...], Box] | None:
        stage_devices = self.topology.stage_devices
        try:
            folded = unflatten(recorded, len(dims), stage_devices=stage_devices, local_shape=dims, name=name)
            layout = Layout.from_recorded(folded, len(dims), stage_devices, name)
            shape = layout.global_shape(dims)
            return shape, layout.box(self.topology.local_rank(self.rank) % layout.devices, shape)
        except (ReshardError, ValueError, ZeroDivisionError, IndexError):
            return None  # the planner says what is wrong with it, if anything is
