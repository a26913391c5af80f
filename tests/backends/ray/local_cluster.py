"""A real two-node Ray cluster on loopback for the tests: started, inspected and stopped by pid.

Each node is a ``ray start --block`` process in its own process group (stopped by signalling that
group: nothing else on the machine is touched). Both nodes advertise 127.0.0.2 — Ray replaces
127.0.0.1 by the host's network address, any other loopback address it keeps — and every port
Ray would otherwise pick at random is chosen here from free ones, so the test can check that
nothing listens where it should not. Node k carries the custom resource ``reshard_node_<k>``,
standing for target node k. Small CPU counts and object stores keep it within a 2-core CI machine.

Node-local disks (``node_disks=True``): every node runs in a mount namespace of its own, where
one path, ``cluster.local_root``, is its own folder (``cluster.disk_of(k)``), as the same local
path is a different disk on each machine of a real cluster. The test process sees the plain
folder at ``local_root``: a driver on a machine that is not a target node. Needs ``unshare``
and the right to mount (root, or unprivileged user namespaces); ``node_disks`` stays False when
they are missing.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

NODE_IP = "127.0.0.2"
NODES = 2
CPUS_PER_NODE = 2
OBJECT_STORE_BYTES = 80 * 1024 * 1024  # Ray's minimum is 75 MiB
WORKER_PORTS_PER_NODE = 24  # workers, actors and drivers of one node each hold one
START_TIMEOUT = 120.0


class ClusterStartError(RuntimeError):
    pass


@dataclass
class RayNode:
    index: int
    resource: str
    process: subprocess.Popen
    log: Path
    ports: dict[str, int]
    worker_ports: range


@dataclass
class RayTestCluster:
    temp_dir: Path
    gcs_port: int
    client_port: int
    nodes: list[RayNode] = field(default_factory=list)
    node_disks: bool = False  # each node sees its own folder at local_root
    cpus_per_node: int = CPUS_PER_NODE

    @property
    def local_root(self) -> Path:
        """A path every node has, on its own disk when node_disks is set."""
        return self.temp_dir / "local"

    def disk_of(self, index: int) -> Path:
        """What node `index` sees at local_root (local_root itself without node_disks)."""
        return self.temp_dir / "disks" / f"node{index}" if self.node_disks else self.local_root

    @property
    def address(self) -> str:
        return f"{NODE_IP}:{self.gcs_port}"

    @property
    def client_address(self) -> str:
        return f"ray://{NODE_IP}:{self.client_port}"

    @property
    def process_groups(self) -> list[int]:
        return [n.process.pid for n in self.nodes]

    def assigned_ports(self) -> set[int]:
        out = {self.gcs_port, self.client_port}
        for n in self.nodes:
            out |= set(n.ports.values()) | set(n.worker_ports)
        return out


def _port_is_free(port: int) -> bool:
    # bind the wildcard address: Ray's gRPC servers listen there, so a port taken on any
    # address (another project's 127.0.0.1:port) would make them fail
    for family, addr in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr, port))
        except OSError as e:
            if family == socket.AF_INET6 and e.errno in (97, 99):  # no IPv6 on this machine
                continue
            return False
    return True


class _PortPicker:
    def __init__(self) -> None:
        self.taken: set[int] = set()

    def one(self) -> int:
        for _ in range(200):
            with socket.socket() as s:
                s.bind(("0.0.0.0", 0))
                port = s.getsockname()[1]
            if port not in self.taken and _port_is_free(port):
                self.taken.add(port)
                return port
        raise ClusterStartError("no free port found")

    def block(self, size: int) -> range:
        """A run of `size` consecutive free ports (Ray's worker port range)."""
        import random

        for _ in range(200):
            # below the kernel's ephemeral ports (32768 up), above the ports Ray's client proxy
            # gives each Ray Client its own server on (23000-23999)
            start = random.randrange(24000, 32000 - size)
            ports = range(start, start + size)
            if not self.taken.intersection(ports) and all(_port_is_free(p) for p in ports):
                self.taken.update(ports)
                return ports
        raise ClusterStartError(f"no {size} consecutive free ports found")


def _ray_cli() -> str:
    cli = Path(sys.executable).with_name("ray")
    return str(cli) if cli.exists() else shutil.which("ray") or "ray"


def _environment() -> dict:
    env = dict(os.environ)
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_DISABLE_DOCKER_CPU_WARNING="1",
               # a loaded CI machine may take longer than Ray's 30 s to start a Ray Client's server
               RAY_CLIENT_SERVER_CHECK_CHANNEL_TIMEOUT_S="180")
    env.pop("RAY_ADDRESS", None)
    return env


def _start_node(cluster: RayTestCluster, index: int, picker: _PortPicker) -> RayNode:
    resource = f"reshard_node_{index}"
    ports = {"object-manager-port": picker.one(), "node-manager-port": picker.one(),
             "dashboard-agent-listen-port": picker.one(), "dashboard-agent-grpc-port": picker.one(),
             "runtime-env-agent-port": picker.one(), "metrics-export-port": picker.one()}
    worker_ports = picker.block(WORKER_PORTS_PER_NODE)
    args = [_ray_cli(), "start", "--block", f"--node-ip-address={NODE_IP}", f"--num-cpus={cluster.cpus_per_node}",
            "--num-gpus=0", f"--object-store-memory={OBJECT_STORE_BYTES}", f"--resources={{\"{resource}\": 1000}}",
            "--disable-usage-stats", f"--min-worker-port={worker_ports.start}",
            f"--max-worker-port={worker_ports.stop - 1}"]
    args += [f"--{k}={v}" for k, v in ports.items()]
    if index == 0:
        args += ["--head", f"--port={cluster.gcs_port}", f"--temp-dir={cluster.temp_dir}",
                 "--include-dashboard=false", f"--ray-client-server-port={cluster.client_port}"]
    else:
        args += [f"--address={cluster.address}"]
    if cluster.node_disks:
        disk = cluster.disk_of(index)
        disk.mkdir(parents=True, exist_ok=True)
        # the node's own disk at local_root, seen by the node and every process it starts
        args = _unshare_command() + ["sh", "-c", 'mount --bind "$1" "$2" && shift 2 && exec "$@"', "node-disk",
                                     str(disk), str(cluster.local_root), *args]
    log = cluster.temp_dir / f"node{index}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=_environment(), start_new_session=True)
    node = RayNode(index, resource, proc, log, ports, worker_ports)
    cluster.nodes.append(node)
    return node


def _wait_started(node: RayNode, deadline: float) -> None:
    while time.monotonic() < deadline:
        text = node.log.read_text(errors="replace")
        if "Ray runtime started" in text or "--block" in text and "block forever" in text:
            return
        if node.process.poll() is not None:
            raise ClusterStartError(f"ray start for node {node.index} exited with {node.process.returncode}:\n"
                               + text[-3000:])
        time.sleep(0.25)
    raise ClusterStartError(f"node {node.index} did not start within {START_TIMEOUT:.0f} s:\n"
                       + node.log.read_text(errors="replace")[-3000:])


def _stop(cluster: RayTestCluster) -> None:
    """SIGTERM each node's process group, then SIGKILL what is left of it (Ray's own processes
    take their time over SIGTERM; nothing of a throw-away cluster needs saving). Workers run in
    process groups of their own: those started by the nodes are killed by pid as well."""
    started = {pid: _start_time(pid) for pid in cluster_processes(cluster.process_groups)}
    for node in cluster.nodes:
        _signal_group(node.process.pid, signal.SIGTERM)
    deadline = time.monotonic() + 3
    for node in cluster.nodes:
        while time.monotonic() < deadline and _group_alive(node.process.pid):
            time.sleep(0.2)
        _signal_group(node.process.pid, signal.SIGKILL)
        try:
            node.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    for pid, when in started.items():
        if when is not None and _start_time(pid) == when:  # the same process, not a reused pid
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _start_time(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else int(fields[19])


def _process_table() -> dict[int, tuple[str, int, int, str]]:
    """pid -> (command name, parent pid, process group, state), from /proc."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        head, rest = stat.rsplit(")", 1)
        fields = rest.split()
        out[int(entry)] = (head.split("(", 1)[1], int(fields[1]), int(fields[2]), fields[0])
    return out


def cluster_processes(pgids: list[int], also: tuple[int, ...] = ()) -> dict[int, str]:
    """pid -> command name of the cluster's live processes: its process groups, their
    descendants (workers start process groups of their own), and the pids in `also`."""
    table = _process_table()
    ours = {pid for pid, (_, _, group, _) in table.items() if group in pgids} | set(also)
    while True:
        grown = ours | {pid for pid, (_, ppid, _, _) in table.items() if ppid in ours}
        if grown == ours:
            break
        ours = grown
    return {pid: table[pid][0] for pid in ours if pid in table and table[pid][3] != "Z"}


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    return any(group == pgid and state != "Z" for _, _, group, state in _process_table().values())




def _unshare_command() -> list[str]:
    """A new mount namespace (a user namespace too when not root), with mounts private to it."""
    base = ["unshare", "--mount", "--propagation", "private"]
    return base if os.geteuid() == 0 else base[:1] + ["--user", "--map-root-user"] + base[1:]


def node_disks_possible() -> str | None:
    """None when nodes can have disks of their own here; else why not."""
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return "the unshare and mount programs are missing (util-linux)"
    with tempfile.TemporaryDirectory(prefix="rsj-ns-") as d:
        a, b = Path(d, "a"), Path(d, "b")
        a.mkdir()
        b.mkdir()
        probe = subprocess.run(_unshare_command() + ["sh", "-c", 'mount --bind "$0" "$1"', str(a), str(b)],
                               capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot mount in a namespace of its own: {(probe.stderr.strip() or 'failed').splitlines()[-1]}"
    return None


def start_cluster(nodes: int = NODES, *, node_disks: bool = False,
                  cpus_per_node: int = CPUS_PER_NODE) -> RayTestCluster:
    """Start the head and the other nodes; on failure, stop what started and raise ClusterStartError.
    `node_disks`: each node gets its own disk at ``local_root`` (see the module docstring)."""
    temp_dir = Path(tempfile.mkdtemp(prefix="rsj-ray-", dir="/tmp"))  # short: Ray's socket paths are limited
    picker = _PortPicker()
    cluster = RayTestCluster(temp_dir, picker.one(), picker.one(), node_disks=node_disks, cpus_per_node=cpus_per_node)
    cluster.local_root.mkdir()
    try:
        deadline = time.monotonic() + START_TIMEOUT
        for k in range(nodes):
            _wait_started(_start_node(cluster, k, picker), deadline)
    except BaseException:
        stop_cluster(cluster)
        raise
    return cluster


def add_node(cluster: RayTestCluster, index: int) -> RayNode:
    """One more node, carrying ``reshard_node_<index>``."""
    picker = _PortPicker()
    picker.taken = cluster.assigned_ports()
    node = _start_node(cluster, index, picker)
    _wait_started(node, time.monotonic() + START_TIMEOUT)
    return node


def kill_node(cluster: RayTestCluster, node: RayNode) -> None:
    """The node dies at once, as a machine that loses power: SIGKILL to all its processes."""
    doomed = cluster_processes([node.process.pid])
    _signal_group(node.process.pid, signal.SIGKILL)
    for pid in doomed:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    node.process.wait(timeout=10)
    cluster.nodes.remove(node)


def stop_cluster(cluster: RayTestCluster) -> None:
    _stop(cluster)
    shutil.rmtree(cluster.temp_dir, ignore_errors=True)
