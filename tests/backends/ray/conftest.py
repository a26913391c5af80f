"""The Ray tests' cluster: two nodes on loopback (see local_cluster.py), started once per
session, with this process connected to it as a driver, and stopped afterwards.

No ``__init__.py`` in this folder: as a package it would be named ``ray`` and hide the real one.
"""

from __future__ import annotations

import sys
import time

import pytest

from local_cluster import NODE_IP, START_TIMEOUT, ClusterStartError, node_disks_possible, start_cluster, stop_cluster


@pytest.fixture(scope="session")
def ray_cluster():
    """The running cluster; the test process is connected to it as a driver."""
    try:
        import ray
    except ImportError:
        pytest.skip("LOUD SKIP: the ray package is not installed (pip install -e '.[ray]'); Ray tests not run")
    why_not = node_disks_possible()
    if why_not:
        print(f"LOUD WARNING: the Ray test nodes share one disk ({why_not}); per-node placement tests that need "
              "disks of their own are skipped", file=sys.stderr)
    try:
        cluster = start_cluster(node_disks=why_not is None)
    except ClusterStartError as e:
        message = f"LOUD SKIP: a Ray cluster could not be started on {NODE_IP}: {e}"
        print(message, file=sys.stderr)
        pytest.skip(message[:2000])
    try:
        ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
        deadline = time.monotonic() + START_TIMEOUT
        while not all(ray.cluster_resources().get(n.resource) for n in cluster.nodes):
            assert time.monotonic() < deadline, f"nodes did not join: {ray.cluster_resources()}"
            time.sleep(0.5)
        yield cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()
        stop_cluster(cluster)
