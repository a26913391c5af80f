"""Settling the target: a strategy file, a declarative layout compiled into one, or one whole rank.

The target strategy that is used is also the one written next to the outputs
(``strategy.ckpt``, or ``strategy.json`` when the user's file was JSON): its bytes are read once,
parsed from those bytes, and copied from them, so the copy is exactly what was planned against.
"""

from __future__ import annotations

import hashlib
import logging
import zlib
from dataclasses import dataclass, field
from typing import Mapping

from reshard_job.errors import ConfigError
import reshard_job.core.dtypes as dtypes
from reshard_job.formats.strategy import format_for, to_protobuf_bytes
from reshard_job.core.strategy_model import FORMAT_JSON, ParamLayout
from reshard_job.core.layout import Layout
from reshard_job.core.tensor_meta import TensorMeta
from reshard_job.sources.rank_folders import LoadedStrategy, load_strategy, read_strategy_bytes
from reshard_job.storage import StorageOptions, storage_for
from reshard_job.core.topology import Topology
from reshard_job.job.config.declarative import UNMATCHED_RULE, compile_layout
from reshard_job.text import listed
from reshard_job.job.config.settle import MAX_TARGET_RANKS
from reshard_job.job.config.spec import TargetSpec

LAYOUT_SOURCE = "target.layout"
log = logging.getLogger("reshard_job")


@dataclass(frozen=True)
class HeldBytes:
    """A document held through the job compressed (a compiled strategy of 600,000 parameters is
    tens of MiB that compress a hundredfold), with its size and sha256 at hand."""

    packed: bytes
    size: int
    sha256: str

    @classmethod
    def of(cls, data: bytes) -> "HeldBytes":
        return cls(zlib.compress(data, 1), len(data), hashlib.sha256(data).hexdigest())

    def unpacked(self) -> bytes:
        return zlib.decompress(self.packed)


@dataclass(frozen=True)
class Target:
    topology: Topology | None  # None: one whole, unsharded checkpoint
    devices: int
    strategy_file: str | None = None  # name of the copy in output.dir ("strategy.ckpt" | "strategy.json")
    strategy: HeldBytes | None = None  # its bytes
    strategy_from: str | None = None  # the user's file, or "target.layout"
    notes: tuple[str, ...] = field(default_factory=tuple)
    # strategy_bytes are the user's file byte for byte (not merged from stages, nor compiled from a
    # layout): lineage records that file as an input and the one beside the outputs as its copy
    strategy_copied: bool = False

    @property
    def strategy_bytes(self) -> bytes | None:
        """The target strategy's bytes (unpacked for each use: let go once used)."""
        return None if self.strategy is None else self.strategy.unpacked()


def settle_target(spec: TargetSpec, source: LoadedStrategy, index: Mapping[int, Mapping[str, TensorMeta]],
                  storage_options: StorageOptions | None = None) -> Target:
    if spec.strategy is not None:
        return _from_file(spec, storage_options)
    if spec.layout is not None:
        compiled = compile_layout(spec.layout, spec.devices, global_shapes(source, index))
        compiled.strategy.path = LAYOUT_SOURCE
        _share_equal_layouts(compiled.strategy.layouts)
        # on one device every layout is the whole tensor: a rule there changes nothing (the
        # default demo rules, with target.devices=1 given for a real checkpoint, said so 4 times)
        unmatched = [note for note in compiled.notes if note.endswith(UNMATCHED_RULE)]
        if unmatched and spec.devices > 1:
            log.warning("%s", unmatched[0] if len(unmatched) == 1 else
                        f"{len(unmatched)} target.layout.rules match no parameter of this checkpoint: "
                        f"{listed([n.removesuffix(UNMATCHED_RULE) for n in unmatched])}")
        return Target(Topology.from_strategy(compiled.strategy), spec.devices, "strategy.ckpt",
                      HeldBytes.of(to_protobuf_bytes(compiled.strategy)), LAYOUT_SOURCE, tuple(compiled.notes))
    return Target(None, 1)


def _share_equal_layouts(layouts: dict[str, ParamLayout]) -> None:
    """Equal layouts as one object, in place: a layout compiled per parameter is one of a handful
    (600,000 parameters held 600,000 equal layouts until the job ended)."""
    shared: dict[ParamLayout, ParamLayout] = {}
    for name, layout in layouts.items():
        layouts[name] = shared.setdefault(layout, layout)


def _from_file(spec: TargetSpec, storage_options: StorageOptions | None) -> Target:
    info = storage_for(spec.strategy, storage_options).info(spec.strategy)
    if info is not None and info.is_dir:  # per-stage files: merged, and written as one merged file
        loaded = load_strategy(spec.strategy, storage_options)
        sf, data, name = loaded.strategy, to_protobuf_bytes(loaded.strategy), "strategy.ckpt"
    else:
        sf, data = read_strategy_bytes(spec.strategy, storage_options)
        name = "strategy.json" if format_for(spec.strategy) == FORMAT_JSON else "strategy.ckpt"
    topology = Topology.from_strategy(sf)
    if topology.devices > MAX_TARGET_RANKS:
        raise ConfigError(f"target.strategy {spec.strategy} lays out {topology.devices} devices: more target ranks "
                          f"than the {MAX_TARGET_RANKS} one job writes (one file each)")
    if spec.devices is not None and spec.devices != topology.devices:
        raise ConfigError(f"target.devices={spec.devices} but target.strategy {spec.strategy} describes "
                          f"{topology.devices} devices")
    merged = info is not None and info.is_dir
    return Target(topology, topology.devices, name, HeldBytes.of(data), spec.strategy, strategy_copied=not merged)


def global_shapes(source: LoadedStrategy, index: Mapping[int, Mapping[str, TensorMeta]]) -> dict[str, tuple[int, ...]]:
    """Every sliceable tensor's global shape, from one rank's local shape and the source layout.

    What a declarative layout is compiled against; shapes the planner will check in detail.
    """
    topo = source.topology
    shapes: dict[str, tuple[int, ...]] = {}
    for rank in sorted(index):
        for name, meta in index[rank].items():
            if name in shapes or meta.kind != "tensor" or not dtypes.BY_NAME[meta.dtype].sliceable:
                continue
            rec = topo.layout(name, topo.stage_of_rank(rank)) if name in topo else None
            if rec is None:
                shapes[name] = tuple(meta.shape)
                continue
            layout = Layout.from_recorded(rec, len(meta.shape), topo.stage_devices, name)
            shapes[name] = layout.global_shape(tuple(meta.shape))
    return shapes

