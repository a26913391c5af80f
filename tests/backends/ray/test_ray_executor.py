"""Rank tasks on a real two-node Ray cluster (see conftest.py): the same bytes as a local run,
each rank on its node, a killed worker retried without leftovers, one-line failures that stop
the rest, and bad addresses refused in seconds.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="LOUD SKIP: the ray package is not installed (pip install -e '.[ray]')")

import rank_runners  # noqa: E402  (this folder; shipped to the workers by value below)
from local_cluster import add_node, cluster_processes, kill_node  # noqa: E402

from reshard_job.errors import ConfigError, ReshardError  # noqa: E402
from reshard_job.sources.open_files import SourceFiles  # noqa: E402
from reshard_job.execute.rank_task import run_rank_task
from reshard_job.core.placement import per_node_placement  # noqa: E402
from reshard_job.job.run.ray.errors import RankTaskError, RayConnectionError, RayExecutorError
from reshard_job.job.run.ray.executor import RayExecutor, memory_per_task
from reshard_job.plan.planner import Planner  # noqa: E402
from reshard_job.sources.rank_folders import discover, load_strategy  # noqa: E402
from reshard_job.execute.tasks import RankTask  # noqa: E402

ray.cloudpickle.register_pickle_by_value(rank_runners)

TEMP_NAME = re.compile(r"^\..+\.[0-9a-f]{12}\.tmp$")


# ============================================================================ helpers


def plan_tasks(scenario, out_dir: Path, sources: dict[int, str] | None = None) -> list[RankTask]:
    """The scenario's rank tasks, built with today's engine as the job builds them."""
    found = discover(scenario.src_checkpoints)
    src = load_strategy(scenario.src_strategy)
    dst = load_strategy(scenario.dst_strategy)
    files = {r: p for r, p in found.files.items() if r < src.topology.devices}
    with SourceFiles(files) as opened:
        plan = Planner(src.topology, dst.topology if scenario.dst_strategy else None, opened.index()).plan()
    files.update(sources or {})
    return [RankTask(rp.target_rank, rp, {r: files[r] for r in rp.source_ranks},
                     str(out_dir / f"rank_{rp.target_rank}" / f"checkpoint_{rp.target_rank}.ckpt"))
            for rp in plan.ranks]


def two_node_placement(tasks):
    """Spread a scenario's target ranks over the cluster's two nodes, as output.placement=per_node would."""
    ranks = len(tasks)
    return per_node_placement(max(1, -(-ranks // 2)))


def run_locally(tasks, out_dir: Path):
    """The reference: run_rank_task in this process, into `out_dir`; returns results and progress bytes."""
    results, seen = {}, []
    for t in tasks:
        local = RankTask(t.target_rank, t.plan, t.sources, str(out_dir / Path(t.out_path).relative_to(
            Path(t.out_path).parents[1])))
        results[t.target_rank] = run_rank_task(local, progress=seen.append)
    return results, sum(seen)


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def temp_files_under(folder: Path) -> list[str]:
    return [name for name in files_under(folder) if TEMP_NAME.match(Path(name).name)]


def scenario(all_golden_scenarios, prefix: str):
    return next(s for s in all_golden_scenarios if s.name.startswith(prefix))


def node_resources() -> dict[str, dict]:
    return {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}


class Collect:
    def __init__(self):
        self.done, self.bytes, self.threads = [], [], set()

    def on_done(self, result):
        self.threads.add(threading.get_ident())
        self.done.append(result)

    def on_bytes(self, n):
        self.threads.add(threading.get_ident())
        self.bytes.append(n)


# ============================================================================ results


def test_golden_scenario_through_ray_matches_local_run(ray_cluster, golden_scenario, tmp_path, helpers):
    tasks = plan_tasks(golden_scenario, tmp_path / "ray")
    placement = two_node_placement(tasks)
    local, local_bytes = run_locally(tasks, tmp_path / "local")
    got = Collect()
    reserved = memory_per_task(tasks[0].options.max_memory)
    executor = RayExecutor(ray_cluster.address, placement=placement, num_cpus_per_task=1, memory_per_task=reserved)
    with executor:
        executor.run(tasks, on_bytes=got.on_bytes, on_done=got.on_done)
    assert ray.is_initialized(), "the executor joined an existing connection and must leave it open"

    assert got.threads == {threading.get_ident()}, "callbacks run in the caller's thread"
    assert sorted(r.target_rank for r in got.done) == golden_scenario.dst_ranks
    assert sum(got.bytes) == local_bytes > 0
    for result in got.done:
        rank = result.target_rank
        ours = local[rank]
        assert Path(result.path).read_bytes() == Path(ours.path).read_bytes(), f"rank {rank} differs from local"
        assert (result.sha256, result.size, result.tensors) == (ours.sha256, ours.size, ours.tensors)
        assert result.sha256 == helpers.file_sha256(result.path)
        for name, sha in golden_scenario.checked(rank).items():  # MindSpore's tensors (quirks left out)
            assert result.tensors[name] == sha, f"rank {rank} {name}"
    assert temp_files_under(tmp_path / "ray") == []

    # each rank ran on the node carrying its resource, as Ray's scheduler granted it
    nodes = node_resources()
    reports = {r.target_rank: r for r in executor.reports}
    for rank, report in reports.items():
        assert 0 < report.peak_rss <= reserved, "the worker used more memory than its task reserves"
        assert report.resource == placement(rank)
        assert nodes[report.node_id].get(placement(rank), 0) > 0, f"rank {rank} ran on a node without its resource"
    if len(tasks) > 1:
        assert len({r.node_id for r in reports.values()}) == 2

    summary = executor.summary()
    assert sorted(rank for row in summary for rank in row.ranks) == golden_scenario.dst_ranks
    assert sum(row.bytes_written for row in summary) == sum(r.size for r in got.done)
    assert [sorted(row.resources) for row in summary] == [[placement(min(row.ranks))] for row in summary]
    table = executor.summary_table()
    assert "reshard_node_0" in table and "write rate" in table


# ============================================================================ failures and retries


def test_killed_worker_is_retried_and_leaves_nothing_behind(ray_cluster, all_golden_scenarios, tmp_path):
    sc = scenario(all_golden_scenarios, "S1_")
    out = tmp_path / "ray"
    tasks = plan_tasks(sc, out)
    local, _ = run_locally(tasks, tmp_path / "local")
    signals = tmp_path / "signals"
    signals.mkdir()
    victim = 2
    killed: dict = {}

    def kill_when_held():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            pid = rank_runners.held_pid(str(signals), victim)
            if pid:
                killed["temp_files"] = temp_files_under(out)
                killed["pid"] = pid
                os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_when_held, daemon=True)
    killer.start()
    got = Collect()
    executor = RayExecutor(ray_cluster.address, placement=two_node_placement(tasks), max_retries=2,
                           runner=rank_runners.HoldOnce(str(signals), hold=frozenset({victim})))
    executor.run(tasks, on_bytes=got.on_bytes, on_done=got.on_done)
    killer.join(5)

    assert killed.get("pid"), "the held attempt was never seen"
    assert f"rank_{victim}" in " ".join(killed["temp_files"]), "the worker was killed while writing"
    assert rank_runners.attempts(str(signals), victim) == 2
    assert sorted(r.target_rank for r in got.done) == sc.dst_ranks  # each rank reported once
    report = next(r for r in executor.reports if r.target_rank == victim)
    assert report.pid != killed["pid"] and report.resource == "reshard_node_1"
    for result in got.done:
        assert Path(result.path).read_bytes() == Path(local[result.target_rank].path).read_bytes()
    assert temp_files_under(out) == [], "the killed attempt's temporary file was left behind"
    assert files_under(out) == sorted(f"rank_{r}/checkpoint_{r}.ckpt" for r in sc.dst_ranks)
    assert sum(got.bytes) == sum(r.bytes_reported for r in executor.reports)  # a retry is not counted twice


def test_failing_rank_is_one_line_naming_rank_node_cause_and_stops_the_rest(ray_cluster, all_golden_scenarios,
                                                                             tmp_path, capfd):
    sc = scenario(all_golden_scenarios, "S1_")
    out = tmp_path / "ray"
    tasks = plan_tasks(sc, out)
    failing = 3
    corrupt = tmp_path / "corrupt" / "checkpoint_7.ckpt"
    corrupt.parent.mkdir()
    source = next(iter(next(t for t in tasks if t.target_rank == failing).sources.items()))
    corrupt.write_bytes(Path(source[1]).read_bytes()[:1000])  # truncated: the same on every attempt
    tasks = [RankTask(t.target_rank, t.plan, {**t.sources, source[0]: str(corrupt)}, t.out_path)
             if t.target_rank == failing else t for t in tasks]
    others = frozenset(r for r in sc.dst_ranks if r != failing)
    signals = tmp_path / "signals"
    signals.mkdir()
    # the failing rank starts once the others are held mid-write
    runner = rank_runners.HoldOnce(str(signals), hold=others, wait=frozenset({failing}))
    got = Collect()
    executor = RayExecutor(ray_cluster.address, placement=two_node_placement(tasks), max_retries=2,
                           runner=runner, cancel_grace=20)
    started = time.monotonic()
    with pytest.raises(RankTaskError) as info:
        executor.run(tasks, on_bytes=got.on_bytes, on_done=got.on_done)
    assert time.monotonic() - started < 60
    message = str(info.value)
    assert "\n" not in message and len(message) < 600
    assert message.startswith(f"target rank {failing} failed on Ray node 127.0.0.2 (")
    assert "reshard_node_1" in message  # the node it ran on
    assert str(corrupt) in message  # the cause names the file
    assert rank_runners.attempts(str(signals), failing) == 1, "a corrupt source is not worth a retry"
    assert got.done == []
    assert all(rank_runners.held_pid(str(signals), r) for r in others), "the others were running when it failed"
    # the others were stopped mid-write: they removed their temporary files and wrote nothing
    deadline = time.monotonic() + 20
    while temp_files_under(out) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert files_under(out) == []
    assert_no_traceback_printed(capfd)


def assert_no_traceback_printed(capfd):
    time.sleep(1)  # Ray prints cluster messages from a background thread
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err and 'File "' not in out + err, out + err


def test_driver_failing_while_journaling_stops_the_tasks_still_running(ray_cluster, all_golden_scenarios, tmp_path):
    """A failure on the driver's side (the journal's disk is full, Ctrl-C) stops the workers too."""
    sc = scenario(all_golden_scenarios, "S1_")
    out = tmp_path / "ray"
    tasks = plan_tasks(sc, out)
    signals = tmp_path / "signals"
    signals.mkdir()
    held = frozenset({0, 1, 2})
    runner = rank_runners.HoldOnce(str(signals), hold=held, wait=frozenset({3}))

    def journal(result):
        raise OSError(28, "No space left on device")

    executor = RayExecutor(ray_cluster.address, placement=two_node_placement(tasks), runner=runner)
    with pytest.raises(OSError, match="No space left"):
        executor.run(tasks, on_bytes=lambda n: None, on_done=journal)
    deadline = time.monotonic() + 20
    while temp_files_under(out) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert files_under(out) == ["rank_3/checkpoint_3.ckpt"]  # the one that finished; the others stopped


def test_tasks_deaf_to_the_polite_cancel_are_killed_and_their_temporary_files_removed(
        ray_cluster, all_golden_scenarios, tmp_path):
    """Ray's polite cancel can miss a task; the stop then kills it and tidies up on its node."""
    sc = scenario(all_golden_scenarios, "S1_")
    out = tmp_path / "ray"
    tasks = plan_tasks(sc, out)
    signals = tmp_path / "signals"
    signals.mkdir()
    held = frozenset({0, 1, 2})
    runner = rank_runners.HoldDeaf(str(signals), hold=held, wait=frozenset({3}))

    def journal(result):
        assert temp_files_under(out), "the held ranks were writing when the driver failed"
        raise OSError(28, "No space left on device")

    executor = RayExecutor(ray_cluster.address, placement=two_node_placement(tasks), runner=runner, cancel_grace=2)
    started = time.monotonic()
    with pytest.raises(OSError, match="No space left"):
        executor.run(tasks, on_bytes=lambda n: None, on_done=journal)
    assert time.monotonic() - started < 60
    assert all(rank_runners.held_pid(str(signals), r) for r in held)
    # returned only once the killed tasks' temporary files were gone: no waiting needed here
    assert files_under(out) == ["rank_3/checkpoint_3.ckpt"]


def test_transient_failure_is_retried_then_reported_with_its_attempts(ray_cluster, all_golden_scenarios, tmp_path,
                                                                      capfd):
    sc = scenario(all_golden_scenarios, "S1_")
    tasks = [t for t in plan_tasks(sc, tmp_path / "ray") if t.target_rank == 0]
    signals = tmp_path / "signals"
    signals.mkdir()
    executor = RayExecutor(ray_cluster.address, placement={0: "reshard_node_0"}, max_retries=2,
                           runner=rank_runners.StorageKeepsResetting(str(signals)))
    with pytest.raises(RankTaskError) as info:
        executor.run(tasks, on_bytes=lambda n: None, on_done=lambda r: None)
    assert rank_runners.attempts(str(signals), 0) == 3
    message = str(info.value)
    assert message.startswith("target rank 0 failed on Ray node 127.0.0.2 (")
    assert "reshard_node_0" in message and "after 3 attempts" in message
    assert "ConnectionResetError" in message and "Connection reset by peer" in message
    assert_no_traceback_printed(capfd)


def test_worker_dying_on_every_attempt_is_reported_with_its_attempts(ray_cluster, all_golden_scenarios, tmp_path):
    sc = scenario(all_golden_scenarios, "S1_")
    tasks = [t for t in plan_tasks(sc, tmp_path / "ray") if t.target_rank == 0]
    signals = tmp_path / "signals"
    signals.mkdir()
    executor = RayExecutor(ray_cluster.address, placement={0: "reshard_node_0"}, max_retries=1,
                           runner=rank_runners.DiesEveryTime(str(signals)))
    with pytest.raises(RankTaskError) as info:
        executor.run(tasks, on_bytes=lambda n: None, on_done=lambda r: None)
    assert rank_runners.attempts(str(signals), 0) == 2
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("target rank 0 failed on ")
    assert "reshard_node_0" in message and "after 2 attempts: its worker died on every attempt" in message
    assert not (tmp_path / "ray" / "rank_0" / "checkpoint_0.ckpt").exists()


def test_rank_no_node_can_run_is_refused_before_anything_runs(ray_cluster, all_golden_scenarios, tmp_path):
    sc = scenario(all_golden_scenarios, "S1_")
    tasks = plan_tasks(sc, tmp_path / "ray")
    executor = RayExecutor(ray_cluster.address, placement=per_node_placement(1))  # ranks 2, 3: nodes 2, 3
    started = time.monotonic()
    with pytest.raises(RayExecutorError) as info:
        executor.run(tasks, on_bytes=lambda n: None, on_done=lambda r: None)
    assert time.monotonic() - started < 10
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"target rank 2 (and 1 other rank(s)) needs CPU=1, reshard_node_2=1, which no live "
                              f"node of the Ray cluster at {ray_cluster.address} offers (nodes: 127.0.0.2 {{CPU=2, ")
    assert "reshard_node_0=1000" in message and "reshard_node_1=1000" in message
    assert not (tmp_path / "ray").exists()

    too_big = RayExecutor(ray_cluster.address, num_cpus_per_task=64)
    with pytest.raises(RayExecutorError, match=r"^target rank 0 \(and 3 other rank\(s\)\) needs CPU=64"):
        too_big.run(tasks, on_bytes=lambda n: None, on_done=lambda r: None)


@pytest.mark.slow
def test_node_lost_for_good_fails_the_run_instead_of_waiting_for_ever(ray_cluster, all_golden_scenarios, tmp_path):
    """Ray would keep the retried task waiting for a node with the resource; the executor gives up."""
    sc = scenario(all_golden_scenarios, "S1_")
    tasks = [t for t in plan_tasks(sc, tmp_path / "ray") if t.target_rank == 0]
    node = add_node(ray_cluster, 9)
    try:
        deadline = time.monotonic() + 60
        while not ray.cluster_resources().get("reshard_node_9"):
            assert time.monotonic() < deadline, "node 9 did not join"
            time.sleep(0.5)
        signals = tmp_path / "signals"
        signals.mkdir()

        def kill_when_held():
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and node in ray_cluster.nodes:
                if rank_runners.held_pid(str(signals), 0):
                    kill_node(ray_cluster, node)
                    return
                time.sleep(0.05)

        killer = threading.Thread(target=kill_when_held, daemon=True)
        killer.start()
        executor = RayExecutor(ray_cluster.address, placement={0: "reshard_node_9"}, max_retries=1,
                               node_loss_grace=3, runner=rank_runners.HoldOnce(str(signals), hold=frozenset({0})))
        started = time.monotonic()
        with pytest.raises(ReshardError) as info:
            executor.run(tasks, on_bytes=lambda n: None, on_done=lambda r: None)
        killer.join(5)
        assert time.monotonic() - started < 150
        message = str(info.value)
        assert "\n" not in message and message.startswith("target rank 0 ")
        # Ray either reports the node's death itself, or the retry waits for a node that never returns
        assert "needs CPU=1, reshard_node_9=1, which no live node" in message and "for the last 3 s" in message \
            or "died" in message, message
    finally:
        if node in ray_cluster.nodes:
            kill_node(ray_cluster, node)


# ============================================================================ connecting


def test_bad_addresses_fail_in_one_line_naming_the_address(ray_cluster):
    with pytest.raises(RayConnectionError) as info:
        RayExecutor("127.0.0.2:1").connect()
    assert str(info.value) == "cannot connect to the Ray cluster at 127.0.0.2:1: connection refused"

    with pytest.raises(RayConnectionError, match=r"^cannot connect to the Ray cluster at nowhere\.invalid:6379: "
                                                 r"unknown host 'nowhere\.invalid'"):
        RayExecutor("nowhere.invalid:6379").connect()

    for bad in ("localhost", "ray://", "host:0", "host:99999", "tcp://host:1"):
        with pytest.raises(ConfigError, match=r"^Ray address .* is not 'auto', 'ray://host:port' or 'host:port'$"):
            RayExecutor(bad)

    # something listens, but not Ray: ray.init alone would wait for ever
    with _silent_listener() as port:
        for address, what in ((f"127.0.0.2:{port}", "a Ray head's GCS"), (f"ray://127.0.0.2:{port}", "a Ray Client")):
            started = time.monotonic()
            with pytest.raises(RayConnectionError) as info:
                RayExecutor(address, connect_timeout=2).connect()
            assert time.monotonic() - started < 15
            assert str(info.value).startswith(f"cannot connect to the Ray cluster at {address}: something listens "
                                              f"there but does not answer as {what}")

    # the head's GCS port given as a Ray Client address
    with pytest.raises(RayConnectionError, match=r"that is a Ray head's GCS port, not a Ray Client server"):
        RayExecutor(f"ray://{ray_cluster.address}").connect()


class _silent_listener:
    """A TCP port on loopback that accepts connections and answers nothing useful."""

    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.2", 0))
        self.sock.listen(8)
        self.stop = False

        def serve():
            self.sock.settimeout(0.2)
            while not self.stop:
                try:
                    conn, _ = self.sock.accept()
                except OSError:
                    continue
                with conn:
                    conn.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n")

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        return self.sock.getsockname()[1]

    def __exit__(self, *exc):
        self.stop = True
        self.thread.join(2)
        self.sock.close()


@pytest.mark.slow  # Ray Client starts a server process per connection: 10-30 s on a loaded 2-core machine
def test_ray_client_address_converts_and_disconnects(ray_cluster, all_golden_scenarios, tmp_path):
    """A driver outside the cluster (Ray Client, ray://): its own connection, closed afterwards."""
    sc = scenario(all_golden_scenarios, "S1_")
    tasks = plan_tasks(sc, tmp_path / "ray")
    local, _ = run_locally(tasks, tmp_path / "local")
    script = tmp_path / "drive.py"
    script.write_text(_CLIENT_DRIVER)
    spec = tmp_path / "tasks.pickle"
    import pickle

    spec.write_bytes(pickle.dumps(tasks))
    out = subprocess.run([sys.executable, str(script), ray_cluster.client_address, str(spec)],
                         capture_output=True, text=True, timeout=240, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    assert out.returncode == 0, out.stderr[-3000:]
    answer = json.loads(out.stdout.strip().splitlines()[-1])
    assert answer["connected_after_close"] is False
    assert sorted(int(r) for r in answer["sha256"]) == sc.dst_ranks
    for rank, sha in answer["sha256"].items():
        assert sha == local[int(rank)].sha256
    assert sorted(answer["resources"]) == ["reshard_node_0", "reshard_node_1"]
    assert "Traceback" not in out.stderr


_CLIENT_DRIVER = '''
import json, pickle, sys
import ray
from reshard_job.core.placement import per_node_placement
from reshard_job.job.run.ray.executor import RayExecutor
tasks = pickle.loads(open(sys.argv[2], "rb").read())
done = []
executor = RayExecutor(sys.argv[1], placement=per_node_placement(2))
with executor:
    executor.run(tasks, on_bytes=lambda n: None, on_done=done.append)
print(json.dumps({"sha256": {r.target_rank: r.sha256 for r in done},
                  "resources": sorted({r.resource for r in executor.reports}),
                  "connected_after_close": ray.is_initialized()}))
'''


# ============================================================================ the cluster stays on loopback


def _listening_sockets() -> dict[int, tuple[str, int]]:
    """Socket inode -> (local address, port) of every listening TCP socket (from /proc/net)."""
    out = {}
    for name, v6 in (("tcp", False), ("tcp6", True)):
        try:
            lines = Path(f"/proc/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != "0A":  # LISTEN
                continue
            addr_hex, port_hex = fields[1].split(":")
            out[int(fields[9])] = (_decode_address(addr_hex, v6), int(port_hex, 16))
    return out


def _decode_address(text: str, v6: bool) -> str:
    import ipaddress

    raw = bytes.fromhex(text)
    if not v6:
        return str(ipaddress.IPv4Address(raw[::-1]))
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))  # four little-endian words
    address = ipaddress.IPv6Address(words)
    return str(address.ipv4_mapped or address)


def test_cluster_listens_only_on_loopback_or_on_ports_it_was_given(ray_cluster):
    processes = cluster_processes(ray_cluster.process_groups, also=(os.getpid(),))
    sockets = _listening_sockets()
    listeners = []  # (process, address, port)
    for pid, name in processes.items():
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            m = re.fullmatch(r"socket:\[(\d+)\]", target)
            if m and int(m.group(1)) in sockets:
                listeners.append((name, *sockets[int(m.group(1))]))
    assert listeners, "no listening socket found for the cluster's processes"
    print("\nRay cluster listeners (process, address, port):\n" + "\n".join(map(str, sorted(set(listeners)))))
    assigned = ray_cluster.assigned_ports()
    for name, address, port in listeners:
        if address in ("0.0.0.0", "::"):
            # Ray's C++ gRPC servers (GCS, raylet, core workers) bind the wildcard address in this
            # Ray version; they may do so only on the ports this fixture chose for them
            assert port in assigned, f"{name} listens on {address}:{port}, a port nobody assigned"
        else:
            assert address.startswith("127.") or address == "::1", f"{name} listens on {address}:{port}"
    # and every node advertises the loopback address, so all traffic between them stays there
    assert {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]} == {"127.0.0.2"}
