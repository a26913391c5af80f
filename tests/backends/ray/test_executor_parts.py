"""The Ray executor's pure parts, without a cluster: placement arithmetic, per-node throughput,
address parsing, the progress board's bookkeeping, leftover removal and error messages."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reshard_job.errors import ConfigError, ReshardError
from reshard_job.core import placement as pl
from reshard_job.job.config.ray_address import parse_address
from reshard_job.job.run.ray.errors import RankTaskError, TransientRankTaskError, first_line
from reshard_job.job.run.ray.executor import memory_per_task
from reshard_job.job.run.ray.progress import ProgressBoard
from reshard_job.job.run.ray.worker import remove_leftovers_of
from reshard_job.job.run.throughput import TaskReport, per_node, render
from reshard_job.storage.atomic import temp_name_for

# ============================================================================ placement


@given(devices=st.integers(1, 300), per_node=st.integers(1, 64))
def test_every_rank_lies_on_exactly_the_node_placement_names(devices, per_node):
    nodes = pl.nodes_needed(devices, per_node)
    seen = []
    for k in range(nodes):
        ranks = pl.ranks_of_node(k, per_node, devices)
        assert 0 < len(ranks) <= per_node
        for r in ranks:
            assert pl.node_of(r, per_node) == k
            assert pl.placement_for(r, per_node) == f"reshard_node_{k}"
        seen.extend(ranks)
    assert seen == list(range(devices))
    assert len(pl.ranks_of_node(nodes, per_node, devices)) == 0


def test_placement_function_and_mapping_forms():
    f = pl.per_node_placement(4, "rack_")
    assert [f(r) for r in (0, 3, 4, 9)] == ["rack_0", "rack_0", "rack_1", "rack_2"]
    again = pickle.loads(pickle.dumps(f))  # shipped to Ray workers and between processes
    assert [again(r) for r in range(12)] == [f(r) for r in range(12)]
    assert pl.as_placement(None)(5) is None
    table = pl.as_placement({0: "reshard_node_3", 1: None})
    assert (table(0), table(1), table(2)) == ("reshard_node_3", None, None)
    assert pl.as_placement(f) is f
    with pytest.raises(TypeError, match="placement must be a function, a mapping or None, not int"):
        pl.as_placement(3)


@pytest.mark.parametrize("bad", [0, -2, True, 1.5, "8"])
def test_devices_per_node_must_be_a_positive_integer(bad):
    with pytest.raises(ConfigError, match=r"^target\.cluster\.devices_per_node must be a positive integer, got "):
        pl.placement_for(0, bad)


@pytest.mark.parametrize("bad", ["", " node_", None])
def test_resource_prefix_must_be_a_name(bad):
    with pytest.raises(ConfigError, match=r"^target\.cluster\.node_resource_prefix must be a non-empty name"):
        pl.placement_for(0, 8, bad)


def test_negative_rank_is_refused():
    with pytest.raises(ConfigError, match="target rank -1 is negative"):
        pl.node_of(-1, 8)


# ============================================================================ throughput


def report(rank, node, resource, started, seconds, written, read=0, rss=0):
    return TaskReport(rank, node * 8, "10.0.0.1", "h", 1, resource, "a", started, seconds, written, read, written, rss)


def test_per_node_throughput_uses_wall_time_and_orders_nodes_by_number():
    rows = per_node([
        report(0, "b", "reshard_node_10", 100.0, 4.0, 4000),
        report(1, "a", "reshard_node_2", 100.0, 2.0, 1000, 500, rss=100 << 20),
        report(2, "a", "reshard_node_2", 101.0, 2.0, 1000, 500, rss=120 << 20),  # overlaps rank 1
        report(3, "c", None, 50.0, 1.0, 10),
    ])
    assert [sorted(r.resources) for r in rows] == [["reshard_node_2"], ["reshard_node_10"], []]
    two = rows[0]
    assert (two.tasks, two.ranks, two.bytes_written, two.bytes_read) == (2, [1, 2], 2000, 1000)
    assert (two.wall_seconds, two.busy_seconds) == (3.0, 4.0)
    assert two.write_rate == pytest.approx(2000 / 3.0)
    assert (two.peak_rss, rows[1].peak_rss) == (120 << 20, 0)
    text = render(rows)
    lines = text.splitlines()
    assert len(lines) == 4 and lines[0].split()[:3] == ["node", "address", "id"]
    assert lines[1].startswith("reshard_node_2 ") and "1-2" in lines[1] and "666 B/s" in lines[1]
    assert lines[1].endswith("120.0 MiB") and lines[2].endswith("-")
    assert per_node([]) == []


def test_memory_per_task_covers_slices_staging_and_the_worker():
    from reshard_job.storage.atomic import DIRECT_CHUNK

    mib = 1 << 20
    assert memory_per_task(32 * mib) == 96 * mib + 32 * mib + 2 * DIRECT_CHUNK  # two staging blocks
    assert memory_per_task(1024 * mib) - memory_per_task(32 * mib) == 992 * mib


# ============================================================================ placement from config


def test_placement_from_config():
    assert pl.placement_from_config("shared", 16) is None
    f = pl.placement_from_config("per_node", 16, nodes=2)
    assert (f(7), f(8)) == ("reshard_node_0", "reshard_node_1")
    g = pl.placement_from_config("per_node", 16, devices_per_node=4, prefix="host_")
    assert g(15) == "host_3"
    assert pl.placement_from_config("per_node", 16, nodes=2, devices_per_node=8)(15) == "reshard_node_1"


@pytest.mark.parametrize("args, message", [
    (("per_node", 16), "output.placement=per_node needs target.cluster.devices_per_node (or target.cluster.nodes)"),
    (("per_node", 16, 3), "target.devices 16 cannot be spread evenly over target.cluster.nodes 3; set "
                          "target.cluster.devices_per_node"),
    (("per_node", 16, 2, 4), "target.cluster has 2 node(s) x 4 device(s) = 8 devices but target.devices is 16"),
    (("per_node", 12, None, 8), "target.devices 12 is not a multiple of target.cluster.devices_per_node 8"),
    (("per_node", 8, 0), "target.cluster.nodes must be a positive integer, got 0"),
    (("nearby", 8), "output.placement must be 'shared' or 'per_node', got 'nearby'"),
])
def test_placement_config_errors_are_one_line(args, message):
    with pytest.raises(ConfigError) as info:
        pl.placement_from_config(*args)
    assert str(info.value) == message


# ============================================================================ addresses


@pytest.mark.parametrize("address, parsed", [
    ("auto", ("auto", None, None)), (None, ("auto", None, None)), (" auto ", ("auto", None, None)),
    ("127.0.0.2:6379", ("gcs", "127.0.0.2", 6379)), ("head-0.cluster.local:6380", ("gcs", "head-0.cluster.local", 6380)),
    ("ray://head:10001", ("client", "head", 10001)), ("[::1]:6379", ("gcs", "::1", 6379)),
])
def test_addresses_parse(address, parsed):
    assert parse_address(address) == parsed


@pytest.mark.parametrize("address", ["", "head", "head:", ":6379", "head:0", "head:65536", "ray://head",
                                     "http://head:80", "head:6379/x", "a b:1"])
def test_malformed_addresses_are_one_line_config_errors(address):
    with pytest.raises(ConfigError) as info:
        parse_address(address)
    assert str(info.value).endswith("is not 'auto', 'ray://host:port' or 'host:port'")


# ============================================================================ progress board


def test_board_keeps_one_count_per_task_and_ignores_replaced_attempts():
    board = ProgressBoard()
    board.started(0, "first", "node A")
    board.add(0, "first", 100)
    board.add(0, "first", 250)
    board.add(1, "x", 7)  # an update that overtook its "started" message
    assert board.drain() == {0: 250, 1: 7}
    assert board.drain() == {}
    board.started(0, "second", "node B")  # a retry starts from zero elsewhere
    board.add(0, "first", 400)  # late update of the killed attempt: ignored
    assert board.drain() == {}
    board.add(0, "second", 50)
    assert board.drain() == {0: 50}
    assert (board.where(0), board.where(5)) == ("node B", None)


# ============================================================================ leftovers and errors


def test_leftovers_of_one_output_only_are_removed(tmp_path):
    out = tmp_path / "rank_0" / "checkpoint_0.ckpt"
    out.parent.mkdir()
    mine = [temp_name_for(str(out)) for _ in range(2)]
    theirs = temp_name_for(str(out.with_name("checkpoint_10.ckpt")))
    kept = [theirs, str(out.parent / ".checkpoint_0.ckpt.notes.tmp"), str(out.parent / "checkpoint_0.ckpt.tmp")]
    for path in mine + kept:
        open(path, "w").close()
    target = tmp_path / "elsewhere.tmp"
    target.write_text("x")
    link = temp_name_for(str(out))
    os.symlink(target, link)
    out.write_text("final")
    assert remove_leftovers_of(str(out)) == 2
    assert sorted(os.listdir(out.parent)) == sorted([os.path.basename(p) for p in kept + [link]] + [out.name])
    assert target.read_text() == "x"
    assert remove_leftovers_of(str(tmp_path / "missing" / "x.ckpt")) == 0
    assert remove_leftovers_of("s3://bucket/rank_0/checkpoint_0.ckpt") == 0


def test_rank_errors_are_one_line_and_survive_pickling():
    err = TransientRankTaskError(3, "Ray node 10.0.0.2 (host n2, node 1a2b3c4d, reshard_node_1)",
                                 "ConnectionResetError: reset", attempts=4, details="Traceback ...")
    assert str(err) == ("target rank 3 failed on Ray node 10.0.0.2 (host n2, node 1a2b3c4d, reshard_node_1) "
                        "after 4 attempts: ConnectionResetError: reset")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is TransientRankTaskError and isinstance(back, ReshardError)
    assert (str(back), back.target_rank, back.attempts, back.details) == (str(err), 3, 4, "Traceback ...")
    assert str(RankTaskError(0, "node", "bad", attempts=1)) == "target rank 0 failed on node: bad"


def test_missing_ray_says_how_to_install_it():
    code = ("import sys; sys.modules['ray'] = None\n"
            "from reshard_job.job.run.ray.executor import RayExecutor\n"
            "try:\n    RayExecutor('auto').connect()\n"
            "except Exception as e:\n    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ConfigError the Ray executor needs the ray package: pip install -e '.[ray]'"
    # importing the executor module does not import Ray
    code = "import sys, reshard_job.job.run.ray.executor; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False"


def test_error_text_from_ray_becomes_one_line():
    server_side = ConnectionAbortedError("Initialization failure from server:\nTraceback (most recent call last):\n"
                                         '  File "proxier.py", line 1, in Datapath\n'
                                         "RuntimeError: Proxy failed to Connect to backend!\n")
    assert first_line(server_side) == "Initialization failure from server: RuntimeError: Proxy failed to Connect to backend!"
    assert first_line(ValueError("first\nsecond")) == "first"
    assert first_line(ValueError()) == "ValueError"
    assert len(first_line(ValueError("x" * 5000))) == 400
