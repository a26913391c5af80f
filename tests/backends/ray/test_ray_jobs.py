"""The batch job on a real Ray cluster (``job.executor=ray``), run as users run it: the CLI in a
subprocess, connected to the two-node loopback cluster of conftest.py.

Golden scenarios through Ray give the bytes of a local run; ``output.placement=per_node`` puts
each rank on its node's own disk (the nodes run in mount namespaces, see local_cluster.py) with a
manifest per node that ``audit verify`` accepts; a worker killed mid-write is retried into the same
bytes; a rank whose worker dies on every attempt fails the job with one line and records nothing;
a driver killed with SIGKILL is resumed by running the same command again.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="LOUD SKIP: the ray package is not installed (pip install -e '.[ray]')")

from job_runs import (Launcher, WorkerKiller, app_command, app_env, lineage_runs, log_lines,  # noqa: E402
                      make_big_source, ray_args, temp_files, the_error)

GOLDEN = Path(__file__).resolve().parents[2] / "golden"
S1 = GOLDEN / "S1_mlp_tutorial_8to4"


@pytest.fixture(scope="module")
def app():
    with Launcher() as launcher:
        yield lambda cwd, *args, timeout=300: launcher.run(cwd, list(args), timeout)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def rank_files(root: Path) -> dict[str, str]:
    """rank_<r>/<file> -> sha256 of the target files under `root`."""
    return {str(p.relative_to(root)): sha(p) for p in sorted(root.glob("rank_*/*")) if p.is_file()}


def golden_args(sc) -> list[str]:
    args = [f"source.checkpoints={sc.src_checkpoints}", f"source.strategy={sc.src_strategy or 'null'}"]
    if sc.dst_strategy:
        return args + ["target=strategy", f"target.strategy={sc.dst_strategy}"]
    return args + ["target=single"]


def audit(cwd: Path, capsys, *args: str) -> subprocess.CompletedProcess:
    """``python -m reshard_job.audit`` (its main, in this process: the audit is not what is tested here)."""
    from reshard_job.audit import main

    capsys.readouterr()
    code = main(["--db", f"sqlite:///{cwd / 'runs' / 'lineage.db'}", *args])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


# ============================================================================ same bytes as a local run


def scenario_preset(folder: Path, sc, out: Path) -> str:
    """A config group option standing for one golden scenario (sources, target, output.dir)."""
    target = {"strategy": sc.dst_strategy, "layout": None, "devices": None if sc.dst_strategy else 1}
    doc = {"source": {"checkpoints": str(sc.src_checkpoints), "strategy": sc.src_strategy}, "target": target,
           "output": {"dir": f"{out}/{sc.name}/${{job.executor}}"}}
    (folder / "scenario").mkdir(parents=True, exist_ok=True)
    (folder / "scenario" / f"{sc.name}.yaml").write_text("# @package _global_\n" + json.dumps(doc))
    return sc.name


def test_golden_scenarios_through_ray_give_the_bytes_of_local_runs(ray_cluster, all_golden_scenarios, tmp_path, app):
    """One sweep over every scenario, each converted locally and then on the cluster."""
    out = tmp_path / "out"
    names = [scenario_preset(tmp_path / "conf", sc, out) for sc in all_golden_scenarios]
    res = app(tmp_path, "-m", f"hydra.searchpath=[file://{tmp_path / 'conf'}]", f"+scenario={','.join(names)}",
              "job.executor=local,ray", f"job.ray.address={ray_cluster.address}", "job.progress=false",
              "job.ray.num_cpus_per_task=2", "hydra.sweep.dir=sweep")
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"Sweep summary ({2 * len(names)} job(s), 0 failed)" in res.stdout
    for sc in all_golden_scenarios:
        _same_as_local(out / sc.name / "local", out / sc.name / "ray", sc)
    results = [json.loads(p.read_text()) for p in sorted((tmp_path / "sweep").glob("*/result.json"))]
    on_ray = [r for r in results if r["nodes"]]
    assert len(on_ray) == len(names) and all("job.executor=ray" in r["overrides"] for r in on_ray)
    assert {n["host"] for r in on_ray for n in r["nodes"]} and sum(len(r["nodes"]) for r in on_ray) >= len(names)


def _same_as_local(local: Path, ray: Path, sc) -> None:
    assert rank_files(ray) == rank_files(local), sc.name
    assert sorted(int(name.split("/")[0][5:]) for name in rank_files(ray)) == sc.dst_ranks
    for extra in ("strategy.ckpt", "strategy.json"):
        assert (ray / extra).exists() == (local / extra).exists()
        if (local / extra).exists():
            assert sha(ray / extra) == sha(local / extra)
    manifests = [json.loads((d / "manifest.json").read_text()) for d in (local, ray)]
    assert manifests[0]["fingerprint"] == manifests[1]["fingerprint"]
    assert manifests[0]["tensors"] == manifests[1]["tensors"]
    for rank in sc.dst_ranks:  # and MindSpore's bytes, quirks aside
        for name, want in sc.checked(rank).items():
            assert manifests[1]["tensors"][str(rank)][name] == want, (sc.name, rank, name)
    assert temp_files(ray) == []


# ============================================================================ per-node placement


def node_dir(cluster, node: int, rel: str) -> Path:
    return cluster.disk_of(node) / rel


def test_per_node_placement_writes_each_rank_on_its_node_with_a_manifest_per_node(ray_cluster, tmp_path, app, capsys,
                                                                                  all_golden_scenarios, helpers):
    if not ray_cluster.node_disks:
        pytest.skip("LOUD SKIP: the test nodes share one disk here (no mount namespaces), so where a file "
                    "landed cannot be told apart")
    sc = next(s for s in all_golden_scenarios if s.name == S1.name)
    rel = f"{tmp_path.name}/out"
    out = ray_cluster.local_root / rel  # the driver's own disk: this machine is no target node
    args = [*golden_args(sc), f"output.dir={out}", "output.placement=per_node", "target.cluster.devices_per_node=2",
            *ray_args(ray_cluster)]
    res = app(tmp_path, *args)
    assert res.returncode == 0, res.stderr[-3000:]
    nodes = [node_dir(ray_cluster, k, rel) for k in (0, 1)]

    # where everything is: the record with the driver, each rank's file on its node only
    assert sorted(os.listdir(out)) == [".reshard_job", "manifest.json", "strategy.ckpt"]
    for k, d in enumerate(nodes):
        ranks = [2 * k, 2 * k + 1]
        assert sorted(os.listdir(d)) == [f"manifest.reshard_node_{k}.json"] + [f"rank_{r}" for r in ranks] + \
            ["strategy.ckpt"]
        assert sha(d / "strategy.ckpt") == sha(out / "strategy.ckpt") == sha(Path(sc.dst_strategy))
        for r in ranks:
            got = helpers.tensor_sha256s(d / f"rank_{r}" / f"checkpoint_{r}.ckpt")
            assert {n: got[n] for n in sc.checked(r)} == sc.checked(r)

    manifest = json.loads((out / "manifest.json").read_text())
    target = manifest["target"]
    assert [(f["rank"], f["path"], f["node"]) for f in target["files"]] == [
        (r, str(out / f"rank_{r}" / f"checkpoint_{r}.ckpt"), f"reshard_node_{r // 2}") for r in range(4)]
    for f in target["files"]:
        assert sha(nodes[f["rank"] // 2] / f"rank_{f['rank']}" / f"checkpoint_{f['rank']}.ckpt") == f["sha256"]
    assert target["placement"] == "per_node"
    assert target["cluster"] == {"nodes": 2, "devices_per_node": 2, "node_resource_prefix": "reshard_node_"}
    for k, entry in enumerate(target["node_manifests"]):
        path = nodes[k] / f"manifest.reshard_node_{k}.json"
        assert (entry["node"], entry["path"], entry["sha256"]) == (f"reshard_node_{k}", str(out / path.name), sha(path))
        part = json.loads(path.read_text())
        assert (part["node"], part["fingerprint"], part["run_id"]) == (entry["node"], manifest["fingerprint"],
                                                                        manifest["run_id"])
        assert [f["rank"] for f in part["target"]["files"]] == [2 * k, 2 * k + 1]
        assert sorted(part["tensors"]) == [str(2 * k), str(2 * k + 1)]
    summary = res.stdout[res.stdout.index("per Ray node:"):]
    assert "reshard_node_0" in summary and "reshard_node_1" in summary

    _audit_node_directories(tmp_path, capsys, out, nodes, manifest)
    _rerun_and_repair(tmp_path, capsys, app, args, out, nodes)


def _audit_node_directories(cwd: Path, capsys, out: Path, nodes: list[Path], manifest: dict) -> None:
    run = lineage_runs(cwd / "runs" / "lineage.db")[-1]
    assert run["status"] == "completed"
    recorded = {p for _, _, p in run["outputs"]}
    assert {m["path"] for m in manifest["target"]["node_manifests"]} <= recorded
    for k, d in enumerate(nodes):
        res = audit(cwd, capsys, "verify", str(d))
        assert res.returncode == 0, res.stdout + res.stderr
        assert res.stdout.splitlines()[0].endswith("completed): all 4 files intact")
        assert f"manifest.reshard_node_{k}.json" in res.stdout
    res = audit(cwd, capsys, "verify", str(out))
    assert res.returncode == 2
    assert res.stderr.strip() == (f"error: {out}: its files were written on the target nodes' own disks "
                                  "(output.placement=per_node); verify the same directory on each node "
                                  "(reshard_node_0, reshard_node_1)")
    # a changed file on a node is found there
    victim = nodes[1] / "rank_3" / "checkpoint_3.ckpt"
    original = victim.read_bytes()
    os.chmod(victim, 0o644)
    victim.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    res = audit(cwd, capsys, "verify", str(nodes[1]))
    assert res.returncode == 1 and f"CHANGED    {victim}" in res.stdout


def _rerun_and_repair(cwd: Path, capsys, app, args: list[str], out: Path, nodes: list[Path]) -> None:
    """Run again: node 1's changed file is found on node 1 and redone; node 0 is left alone."""
    kept = {p: os.stat(p).st_ino for p in nodes[0].rglob("rank_*/*")}
    res = app(cwd, *args)
    assert res.returncode == 0, res.stderr[-3000:]
    logs = "\n".join(log_lines(res.stderr))
    assert ("1 file(s) listed in its manifest are missing or changed (rank_3/checkpoint_3.ckpt); redoing what does not "
            "verify") in logs
    assert "resuming: keeping 3 target file(s) that verify: ranks [0, 1, 2]" in logs
    assert {p: os.stat(p).st_ino for p in nodes[0].rglob("rank_*/*")} == kept
    res = audit(cwd, capsys, "verify", str(nodes[1]))
    assert res.returncode == 0, res.stdout
    res = app(cwd, *args)  # and once more: nothing to do, checked on the nodes
    assert res.returncode == 0 and res.stdout.startswith("completed (already done): ")
    assert temp_files(out, *nodes) == []


# ============================================================================ faults


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """64 MiB over two source ranks, four 16 MiB target files each needing both."""
    return make_big_source(tmp_path_factory.mktemp("big"), n_tensors=4)


@pytest.fixture(scope="module")
def big_reference(tmp_path_factory, big, app) -> dict[str, str]:
    cwd = tmp_path_factory.mktemp("big_reference")
    res = app(cwd, *big.args(cwd / "out", "job.workers=1", "lineage.enabled=false"))
    assert res.returncode == 0, res.stderr
    return rank_files(cwd / "out")


# slices of 2 KiB make each 16 MiB target take about a second: long enough to stop its writer mid-file
SLOW = "job.max_memory=4KiB"


def test_worker_killed_mid_write_is_retried_into_the_bytes_of_a_local_run(ray_cluster, tmp_path, app, big,
                                                                          big_reference):
    out = tmp_path / "out"
    killer = WorkerKiller(ray_cluster, out / "rank_1")
    killer.start()
    try:
        res = app(tmp_path, *big.args(out, *ray_args(ray_cluster), SLOW, "job.ray.max_retries=2"))
    finally:
        killer.stop()
    assert len(killer.killed) == 1, f"rank 1's writer was never stopped mid-file ({killer.missed} missed)"
    assert res.returncode == 0, res.stderr[-3000:]
    assert rank_files(out) == big_reference
    assert temp_files(out) == []
    runs = lineage_runs(tmp_path / "runs" / "lineage.db")
    assert [r["status"] for r in runs] == ["completed"]
    assert len([o for o in runs[0]["outputs"] if o[0] == "target_checkpoint"]) == 4


def test_rank_whose_worker_dies_on_every_attempt_fails_the_job_in_one_line(ray_cluster, tmp_path, app, big):
    out = tmp_path / "out"
    killer = WorkerKiller(ray_cluster, out / "rank_1", times=2)
    killer.start()
    try:
        res = app(tmp_path, *big.args(out, *ray_args(ray_cluster), SLOW, "job.ray.max_retries=1"))
    finally:
        killer.stop()
    assert len(killer.killed) == 2, f"rank 1's writers were not stopped mid-file ({killer.missed} missed)"
    error = the_error(res)
    assert res.returncode == 2
    assert error.startswith("target rank 1 failed on Ray node 127.0.0.2 (host "), error
    assert "after 2 attempts: its worker died on every attempt" in error
    assert not (out / "manifest.json").exists()
    assert not (out / "rank_1" / "checkpoint_1.ckpt").exists()
    [run] = lineage_runs(tmp_path / "runs" / "lineage.db")
    assert run["status"] == "failed" and run["outputs"] == []
    assert run["error"] == error
    deadline = time.monotonic() + 30  # the other ranks were stopped; their writers clean up
    while temp_files(out) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert temp_files(out) == []


def _journaled(out: Path) -> list[dict]:
    try:
        lines = (out / ".reshard_job" / "journal.jsonl").read_text().splitlines()[1:]
    except FileNotFoundError:
        return []
    entries = []
    for line in lines:
        try:
            entries.append(json.loads(line))
        except ValueError:
            pass  # a line being written
    return entries


@pytest.mark.slow  # two more jobs, each starting its workers afresh: half a minute on a loaded 2-core machine
def test_driver_killed_then_the_same_command_resumes_on_the_nodes(ray_cluster, tmp_path, app, big, big_reference):
    rel = f"{tmp_path.name}/out"
    out = ray_cluster.local_root / rel
    nodes = [node_dir(ray_cluster, k, rel) for k in (0, 1)]
    # one task per node at a time (ray_args), so the ranks land in two waves
    args = big.args(out, *ray_args(ray_cluster), SLOW, "output.placement=per_node", "target.cluster.nodes=2")
    driver = subprocess.Popen(app_command(*args), cwd=tmp_path, env=app_env(), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while not _journaled(out):
            assert driver.poll() is None, "the job ended before any file landed"
            assert time.monotonic() < deadline, "no target file landed in time"
            time.sleep(0.005)
        driver.send_signal(signal.SIGKILL)
    finally:
        if driver.poll() is None:
            driver.kill()
        driver.wait()
    done = _journaled(out)
    assert 1 <= len(done) < 4 and not (out / "manifest.json").exists()
    kept = {e["path"]: os.stat(nodes[e["rank"] // 2] / e["path"]).st_ino for e in done}

    res = app(tmp_path, *args)
    assert res.returncode == 0, res.stderr[-3000:]
    logs = "\n".join(log_lines(res.stderr))
    assert f"resuming: keeping {len(done)} target file(s) that verify" in logs
    assert "marked 1 run(s) left 'started' by killed processes as abandoned" in logs
    assert {e["path"]: os.stat(nodes[e["rank"] // 2] / e["path"]).st_ino for e in done} == kept  # not rewritten
    on_nodes = {**rank_files(nodes[0]), **rank_files(nodes[1])}
    assert on_nodes == big_reference
    assert temp_files(out, *nodes) == []
    manifest = json.loads((out / "manifest.json").read_text())
    assert [f["node"] for f in manifest["target"]["files"]] == ["reshard_node_0"] * 2 + ["reshard_node_1"] * 2
    assert [r["status"] for r in lineage_runs(tmp_path / "runs" / "lineage.db")] == ["abandoned", "completed"]
