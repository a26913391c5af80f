"""One conversion on 1, 2, 4 ... Ray nodes against the same conversion on one machine.

Generates (or reuses) the synthetic GPT-like source of ``generate.py`` (8 ranks, mp4 × dp2,
optimizer parallel), and converts it to ``--case 8to4`` or ``8to16`` several ways in one
invocation, so the numbers compare:

- ``local``: ``job.executor=local`` with ``--local-workers`` processes (the baseline, and the
  reference outputs);
- ``ray, n nodes``: ``job.executor=ray`` for each ``--nodes`` count, with
  ``output.placement=per_node`` and ``target.cluster.nodes=n``, so the target ranks are spread
  evenly over the nodes ``reshard_node_0 .. reshard_node_<n-1>``.

``--via job`` (the default) runs ``python -m reshard_job`` as a child process, as a user would:
hashing, journal, manifest and lineage included. ``--via executor`` hands the same rank tasks to
``RayExecutor`` directly (no job around them), which isolates Ray's own overhead per rank.

Reported per run: wall seconds; CPU seconds of the job's own process tree (its rusage) and, on a
loopback cluster, of the cluster's processes (sampled from /proc every 0.2 s, so a worker that
exits between samples loses at most that much), plus what the rank tasks themselves used; and,
per node, the ranks it wrote, bytes read and written, and its tasks' CPU seconds, from the job's
``result.json``. Every Ray output is checked against the local one (sha256 of every file).

Where the cluster comes from:

- ``--local-cluster`` (default): a throw-away cluster of n nodes on this machine's loopback, each
  with ``--cpus-per-node`` CPUs (the tests' fixture, ``tests/backends/ray/local_cluster.py``). All nodes
  share this machine's cores and disk: it shows how the work spreads and what Ray adds, and on a
  many-core machine how far more nodes help before the disk is the limit.
- ``--address HOST:PORT`` or ``ray://HOST:10001``: an existing cluster whose nodes carry
  ``reshard_node_0`` ... and see the source and output paths (per-node outputs land on each node's
  own disk under ``--data``).

Usage::

    python benchmarks/ray_scaling.py --size-gb 0.5 --case 8to16 --nodes 1,2
    python benchmarks/ray_scaling.py --size-gb 8 --case 8to16 --nodes 1,2,4 --cpus-per-node 4 --local-workers 16
    python benchmarks/ray_scaling.py --size-gb 8 --case 8to16 --address head:6379 --nodes 1,2,4 --data /shared/bench
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for path in (str(REPO), str(HERE), str(REPO / "tests" / "backends" / "ray")):
    if path not in sys.path:  # run from a checkout without installing
        sys.path.insert(0, path)

import generate as gen  # noqa: E402

from reshard_job.text import human_size  # noqa: E402

CASES = {"8to4": 4, "8to16": 16}
SAMPLE_INTERVAL = 0.2


def log(msg: str) -> None:
    print(f"[ray_scaling {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ==================================================================================== CPU time


class ClusterCpu(threading.Thread):
    """CPU seconds used by a loopback cluster's processes while it runs: every process's
    utime + stime is sampled; a process's use is its last sample minus its first (0 for one
    born during the run)."""

    def __init__(self, pgids: list[int]):
        super().__init__(daemon=True)
        self.pgids = pgids
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self._done = threading.Event()
        self._sample(initial=True)

    def _sample(self, initial: bool = False) -> None:
        from local_cluster import cluster_processes

        tick = os.sysconf("SC_CLK_TCK")
        for pid in cluster_processes(self.pgids):
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            used = (int(fields[11]) + int(fields[12])) / tick
            self.first.setdefault(pid, used if initial else 0.0)
            self.last[pid] = used

    def run(self) -> None:
        while not self._done.wait(SAMPLE_INTERVAL):
            self._sample()

    def stop(self) -> float:
        self._done.set()
        self.join(5)
        self._sample()
        return sum(self.last[p] - self.first[p] for p in self.last)


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# ==================================================================================== through the job


def job_args(meta: dict, case: str, out: Path, scratch: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "reshard_job", "source=checkpoints", "target=strategy",
            f"source.checkpoints={meta['sources']['src']['path']}", f"source.strategy={meta['strategies']['src']}",
            f"target.strategy={meta['strategies'][f'dst_{CASES[case]}']}", f"output.dir={out}",
            "job.progress=false", f"lineage.url=sqlite:///{scratch / 'lineage.db'}",
            f"hydra.run.dir={scratch / 'hydra' / out.name}", *extra]


def run_job(args: list[str], cwd: Path, cluster=None) -> dict:
    """One job as a child process: wall, CPU seconds, its result.json."""
    sampler = ClusterCpu(cluster.process_groups) if cluster is not None else None
    if sampler:
        sampler.start()
    cpu0, started = children_cpu(), time.perf_counter()
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - started, children_cpu() - cpu0
    cluster_cpu = sampler.stop() if sampler else None
    if proc.returncode != 0:
        raise SystemExit(f"the job failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    run_dir = Path(next(a.split("=", 1)[1] for a in args if a.startswith("hydra.run.dir=")))
    result = json.loads((run_dir / "result.json").read_text())
    return {"wall_s": round(wall, 3), "cpu_job_s": round(cpu, 3),
            "cpu_cluster_s": None if cluster_cpu is None else round(cluster_cpu, 3), "result": result}


def outputs_of(out: Path) -> dict[int, str]:
    manifest = json.loads((out / "manifest.json").read_text())
    return {f["rank"]: f["sha256"] for f in manifest["target"]["files"]}


def row_of(mode: str, nodes: int, run: dict, reference_s: float) -> dict:
    per_node = [{"node": ",".join(n["resources"]) or n["node_id"][:8], "ranks": n["ranks"],
                 "bytes_read": n["bytes_read"], "bytes_written": n["bytes_written"],
                 "cpu_tasks_s": n["cpu_seconds"], "wall_s": n["wall_seconds"]}
                for n in run["result"].get("nodes") or []]
    cpu_tasks = round(sum(n["cpu_tasks_s"] for n in per_node), 3) if per_node else None
    return {"mode": mode, "nodes": nodes, "wall_s": run["wall_s"], "x_local": round(run["wall_s"] / reference_s, 3),
            "cpu_job_s": run["cpu_job_s"], "cpu_cluster_s": run["cpu_cluster_s"], "cpu_tasks_s": cpu_tasks,
            "per_node": per_node}


def via_job(a, meta: dict, scratch: Path) -> tuple[list[dict], int]:
    cwd = scratch / "cwd"
    cwd.mkdir(parents=True, exist_ok=True)
    local_out = scratch / "local"
    run = run_job(job_args(meta, a.case, local_out, scratch, f"job.workers={a.local_workers}",
                           f"job.max_memory={a.max_memory}"), cwd)
    reference = outputs_of(local_out)
    written = sum(f["size"] for f in json.loads((local_out / "manifest.json").read_text())["target"]["files"])
    rows = [row_of("local", 0, run, run["wall_s"])]
    log(f"local, {a.local_workers} worker(s): {run['wall_s']:.2f} s, {run['cpu_job_s']:.1f} CPU s")
    shutil.rmtree(local_out, ignore_errors=True)
    for n in [int(x) for x in a.nodes.split(",") if x]:
        out = scratch / f"ray_{n}"
        with cluster_for(a, n) as (address, cluster):
            args = job_args(meta, a.case, out, scratch, "job.executor=ray", f"job.ray.address={address}",
                            f"job.ray.num_cpus_per_task={a.cpus_per_task}", f"job.max_memory={a.max_memory}",
                            "output.placement=per_node", f"target.cluster.nodes={n}")
            run = run_job(args, cwd, cluster)
        if outputs_of(out) != reference:
            raise SystemExit(f"ray, {n} node(s): the outputs differ from the local run")
        rows.append(row_of("ray", n, run, rows[0]["wall_s"]))
        log(f"ray, {n} node(s): {run['wall_s']:.2f} s ({rows[-1]['x_local']:.2f} x local); outputs identical")
        for node in rows[-1]["per_node"]:
            log(f"  {node['node']}: ranks {node['ranks']}, read {human_size(node['bytes_read'])}, "
                f"wrote {human_size(node['bytes_written'])}, tasks {node['cpu_tasks_s']:.1f} CPU s")
        shutil.rmtree(out, ignore_errors=True)
    return rows, written


class cluster_for:
    """The cluster for n nodes: a loopback one started here (and stopped after), or --address."""

    def __init__(self, a, nodes: int):
        self.a, self.nodes, self.cluster = a, nodes, None

    def __enter__(self):
        if self.a.address:
            return self.a.address, None
        import local_cluster

        self.cluster = local_cluster.start_cluster(self.nodes, cpus_per_node=self.a.cpus_per_node)
        return self.cluster.address, self.cluster

    def __exit__(self, *exc):
        if self.cluster is not None:
            import local_cluster

            local_cluster.stop_cluster(self.cluster)


# ==================================================================================== the executor alone


def via_executor(a, meta: dict, scratch: Path) -> tuple[list[dict], int]:
    """The rank tasks handed to RayExecutor directly, against run_rank_task one after another here."""
    from reshard_job.execute.rank_task import run_rank_task

    tasks = plan_tasks(meta, a.case, scratch / "local", a.max_memory_bytes)
    started = time.perf_counter()
    reference = {t.target_rank: run_rank_task(t) for t in tasks}
    local_s = time.perf_counter() - started
    rows = [{"mode": "local (one process)", "nodes": 0, "wall_s": round(local_s, 3), "x_local": 1.0, "per_node": []}]
    for n in [int(x) for x in a.nodes.split(",") if x]:
        out = scratch / f"ray_{n}"
        with cluster_for(a, n) as (address, _):
            wall, results, per_node = run_executor(retarget(tasks, out), address, n, a.cpus_per_task)
        if any((results[r].sha256, results[r].tensors) != (ref.sha256, ref.tensors) for r, ref in reference.items()):
            raise SystemExit(f"ray, {n} node(s): the outputs differ from the local run")
        rows.append({"mode": "ray (executor)", "nodes": n, "wall_s": round(wall, 3),
                     "x_local": round(wall / local_s, 3), "per_node": per_node})
        log(f"ray executor, {n} node(s): {wall:.2f} s ({wall / local_s:.2f} x local); outputs identical")
        shutil.rmtree(out, ignore_errors=True)
    return rows, sum(r.size for r in reference.values())


def plan_tasks(meta: dict, case: str, out: Path, max_memory: int):
    from reshard_job.sources.open_files import SourceFiles
    from reshard_job.plan.planner import Planner
    from reshard_job.sources.rank_folders import discover, load_strategy
    from reshard_job.execute.tasks import RankTask, WriteOptions

    found = discover(meta["sources"]["src"]["path"])
    src = load_strategy(meta["strategies"]["src"])
    dst = load_strategy(meta["strategies"][f"dst_{CASES[case]}"])
    with SourceFiles(found.files) as opened:
        plan = Planner(src.topology, dst.topology, opened.index()).plan()
    return [RankTask(rp.target_rank, rp, {r: found.files[r] for r in rp.source_ranks},
                     str(out / f"rank_{rp.target_rank}" / f"checkpoint_{rp.target_rank}.ckpt"),
                     WriteOptions(max_memory=max_memory)) for rp in plan.ranks]


def retarget(tasks, out: Path):
    from dataclasses import replace

    return [replace(t, out_path=str(out / Path(t.out_path).relative_to(Path(t.out_path).parents[1]))) for t in tasks]


def run_executor(tasks, address: str, nodes: int, cpus_per_task: float) -> tuple[float, dict, list]:
    from reshard_job.core.placement import per_node_placement
    from reshard_job.job.run.ray.executor import RayExecutor
    from reshard_job.job.run.throughput import to_json

    results: dict = {}
    executor = RayExecutor(address, placement=per_node_placement(max(1, -(-len(tasks) // nodes))),
                           num_cpus_per_task=cpus_per_task)
    with executor:
        started = time.perf_counter()
        executor.run(tasks, on_bytes=lambda n: None, on_done=lambda r: results.__setitem__(r.target_rank, r))
        wall = time.perf_counter() - started
        log("per node:\n" + executor.summary_table())
        return wall, results, to_json(executor.summary())


# ==================================================================================== report


def report(a, rows: list[dict], written: int) -> str:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    result = {"size_gb": a.size_gb, "dtype": a.dtype, "case": a.case, "via": a.via, "bytes_written": written,
              "cluster": a.address or f"loopback, {a.cpus_per_node} CPU(s) per node",
              "cpus_per_task": a.cpus_per_task, "local_workers": a.local_workers, "cpu_count": os.cpu_count(),
              "runs": rows}
    os.makedirs(a.results_dir, exist_ok=True)
    path = Path(a.results_dir) / f"ray-{stamp}.json"
    path.write_text(json.dumps(result, indent=2))
    lines = [f"# Ray scaling {stamp}: {a.size_gb} GB {a.dtype}, {a.case}, via {a.via}, {result['cluster']}, "
             f"{os.cpu_count()} cores", "",
             "| mode | nodes | wall s | × local | CPU s (job) | CPU s (cluster) | CPU s (tasks) | read per node |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        read = ", ".join(f"{n['node']} {human_size(n['bytes_read'])}" for n in r["per_node"]) or "-"
        lines.append(f"| {r['mode']} | {r['nodes'] or '-'} | {r['wall_s']:.2f} | {r['x_local']:.2f} | "
                     f"{_num(r.get('cpu_job_s'))} | {_num(r.get('cpu_cluster_s'))} | {_num(r.get('cpu_tasks_s'))} | "
                     f"{read} |")
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    log(f"results in {path} and {path.with_suffix('.md')}")
    return "\n".join(lines)


def _num(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=0.5)
    ap.add_argument("--dtype", choices=sorted(gen.DTYPES), default="float16")
    ap.add_argument("--case", choices=sorted(CASES), default="8to16")
    ap.add_argument("--via", choices=("job", "executor"), default="job")
    ap.add_argument("--address", help="an existing cluster (host:port or ray://host:port); default: loopback")
    ap.add_argument("--nodes", default="1,2", help="node counts to run on, e.g. 1,2,4")
    ap.add_argument("--cpus-per-node", type=int, default=2, help="CPUs of each loopback node")
    ap.add_argument("--cpus-per-task", type=float, default=1)
    ap.add_argument("--local-workers", type=int, default=os.cpu_count() or 1, help="job.workers of the local run")
    ap.add_argument("--max-memory", default="32MiB")
    ap.add_argument("--data", default=str(HERE / "data"), help="where sources and outputs go")
    ap.add_argument("--results-dir", default=str(HERE / "results"))
    a = ap.parse_args(argv)
    from reshard_job.core.sizes import parse_size as parse_bytes

    a.max_memory_bytes = parse_bytes(a.max_memory)
    meta = gen.generate(gen.data_dir_for(a.data, a.size_gb, a.dtype), a.size_gb, a.dtype, sources=("src",),
                        log=log)
    scratch = Path(a.data) / f"ray_scaling_{os.getpid()}"
    try:
        rows, written = (via_job if a.via == "job" else via_executor)(a, meta, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(report(a, rows, written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
