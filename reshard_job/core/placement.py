"""Which cluster node produces which target rank's file: pure arithmetic, no cluster needed.

Target ranks are laid out over nodes the way training launchers lay out devices: node k holds
ranks ``[k * devices_per_node, (k + 1) * devices_per_node)``. With ``output.placement=per_node``
a rank's file must be written on the node that will load it, so the task producing it runs on
that node. A Ray cluster names its nodes by a custom resource, ``<prefix><k>`` (started with
``ray start --resources='{"reshard_node_<k>": 1000}'``), rather than by address: addresses
change when a node is replaced, the resource goes with whatever machine takes over node k, and
Ray's scheduler already understands resource requests. Each task asks for one unit, so the
amount a node is started with only has to exceed the tasks that may run there at once.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

from reshard_job.errors import ConfigError

DEFAULT_NODE_RESOURCE_PREFIX = "reshard_node_"
PLACEMENT_SHARED = "shared"  # every node sees output.dir (a shared file system): run ranks anywhere
PLACEMENT_PER_NODE = "per_node"  # rank r's file is written on the node that will load it
UNITS_PER_TASK = 1  # of the node's custom resource; nodes are started with far more (1000)

Placement = Callable[[int], "str | None"]  # target rank -> custom resource to run on (None: anywhere)


def node_of(target_rank: int, devices_per_node: int) -> int:
    """Index of the target node that holds `target_rank`."""
    _check_devices_per_node(devices_per_node)
    if target_rank < 0:
        raise ConfigError(f"target rank {target_rank} is negative")
    return target_rank // devices_per_node


def node_resource(node: int, prefix: str = DEFAULT_NODE_RESOURCE_PREFIX) -> str:
    """The Ray custom resource that marks target node `node`."""
    _check_prefix(prefix)
    return f"{prefix}{node}"


def placement_for(target_rank: int, devices_per_node: int, prefix: str = DEFAULT_NODE_RESOURCE_PREFIX) -> str:
    """The custom resource of the node that must write `target_rank`'s file (``reshard_node_<k>``)."""
    return node_resource(node_of(target_rank, devices_per_node), prefix)


def ranks_of_node(node: int, devices_per_node: int, devices: int) -> range:
    """Target ranks held by node `node` of a `devices`-rank target."""
    _check_devices_per_node(devices_per_node)
    start = node * devices_per_node
    return range(min(start, devices), min(start + devices_per_node, devices))


def nodes_needed(devices: int, devices_per_node: int) -> int:
    """How many target nodes a `devices`-rank target spans."""
    _check_devices_per_node(devices_per_node)
    return -(-devices // devices_per_node)


def devices_per_node_for(devices: int, nodes: int | None, devices_per_node: int | None) -> int:
    """``target.cluster`` settled against the target's device count: the ranks each node holds.

    Either key may be left out when the other divides the device count; given both, every node
    must be full (nodes x devices_per_node = devices), as training launchers lay ranks out.
    """
    if nodes is not None and (not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1):
        raise ConfigError(f"target.cluster.nodes must be a positive integer, got {nodes!r}")
    if devices_per_node is None:
        if nodes is None:
            raise ConfigError("output.placement=per_node needs target.cluster.devices_per_node (or target.cluster.nodes)")
        if devices % nodes:
            raise ConfigError(f"target.devices {devices} cannot be spread evenly over target.cluster.nodes {nodes}; "
                              f"set target.cluster.devices_per_node")
        return devices // nodes
    _check_devices_per_node(devices_per_node)
    if nodes is not None and nodes * devices_per_node != devices:
        raise ConfigError(f"target.cluster has {nodes} node(s) x {devices_per_node} device(s) = "
                          f"{nodes * devices_per_node} devices but target.devices is {devices}")
    if devices % devices_per_node:
        raise ConfigError(f"target.devices {devices} is not a multiple of target.cluster.devices_per_node "
                          f"{devices_per_node}")
    return devices_per_node


def placement_from_config(output_placement: str, devices: int, nodes: int | None = None,
                          devices_per_node: int | None = None,
                          prefix: str = DEFAULT_NODE_RESOURCE_PREFIX) -> Placement | None:
    """What ``output.placement`` and ``target.cluster`` mean for the executor: None for shared
    outputs (any node), else the per-node placement function."""
    if output_placement == PLACEMENT_SHARED:
        return None
    if output_placement == PLACEMENT_PER_NODE:
        return per_node_placement(devices_per_node_for(devices, nodes, devices_per_node), prefix)
    raise ConfigError(f"output.placement must be {PLACEMENT_SHARED!r} or {PLACEMENT_PER_NODE!r}, "
                      f"got {output_placement!r}")


def per_node_placement(devices_per_node: int, prefix: str = DEFAULT_NODE_RESOURCE_PREFIX) -> Placement:
    """A placement function for ``output.placement=per_node`` (picklable: no closure over state)."""
    _check_devices_per_node(devices_per_node)
    _check_prefix(prefix)
    return _PerNode(devices_per_node, prefix)


def as_placement(placement: "Placement | Mapping[int, str | None] | None") -> Placement:
    """Normalise the forms an executor accepts: a function, a rank -> resource mapping, or None."""
    if placement is None:
        return _anywhere
    if isinstance(placement, Mapping):
        table = dict(placement)
        return table.get
    if callable(placement):
        return placement
    raise TypeError(f"placement must be a function, a mapping or None, not {type(placement).__name__}")


def resources_by_rank(ranks: Iterable[int], placement: Placement) -> dict[int, str | None]:
    return {r: placement(r) for r in ranks}


class _PerNode:
    def __init__(self, devices_per_node: int, prefix: str):
        self.devices_per_node = devices_per_node
        self.prefix = prefix

    def __call__(self, target_rank: int) -> str:
        return placement_for(target_rank, self.devices_per_node, self.prefix)

    def __repr__(self) -> str:
        return f"per_node_placement({self.devices_per_node}, {self.prefix!r})"


def _anywhere(target_rank: int) -> None:
    return None


def _check_devices_per_node(devices_per_node: int) -> None:
    if not isinstance(devices_per_node, int) or isinstance(devices_per_node, bool) or devices_per_node < 1:
        raise ConfigError(f"target.cluster.devices_per_node must be a positive integer, got {devices_per_node!r}")


def _check_prefix(prefix: str) -> None:
    # Ray resource names are free-form strings, but an empty or spaced prefix is surely a typo
    if not isinstance(prefix, str) or not prefix or prefix != prefix.strip():
        raise ConfigError(f"target.cluster.node_resource_prefix must be a non-empty name, got {prefix!r}")
