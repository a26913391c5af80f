"""Rank tasks through Ray against the same tasks run one after another in one process.

Generates (or reuses) the synthetic GPT-like source of ``generate.py`` (8 ranks, mp4 × dp2,
optimizer parallel), plans a target (``--case 8to4`` or ``8to16``), and converts it:

- ``local``: ``run_rank_task`` for every rank in this process, one after another (the baseline,
  and the reference bytes);
- ``ray``: the same tasks through ``RayExecutor``, with target ranks spread over the nodes by
  ``output.placement=per_node`` arithmetic (``reshard_node_<k>``), once per ``--nodes`` count.

Every Ray output is checked against the local one (sha256 of the file and of every tensor). The
report gives the wall time of each run, the per-node table of ``RayExecutor.summary()`` and the
ratio to the baseline. Ray's wall time includes starting its worker processes, which dominates
small models.

Where the cluster comes from:

- ``--address HOST:PORT`` or ``ray://HOST:10001``: an existing cluster whose nodes carry
  ``reshard_node_0`` ... ``reshard_node_<n-1>``; the source and output paths must be visible on
  every node (a shared file system), as in a real conversion with ``output.placement=shared``.
- ``--local-nodes 1,2``: a throw-away cluster on this machine's loopback (the tests' fixture,
  ``tests/ray/local_cluster.py``). All nodes then share one machine's cores and disk, so this
  measures Ray's overhead per rank, not scaling; scaling needs several machines.

Usage::

    python benchmarks/ray_scaling.py --size-gb 0.5 --local-nodes 1,2
    python benchmarks/ray_scaling.py --size-gb 4 --address ray://head:10001 --nodes 1,2,4 --data /shared/bench
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for path in (str(REPO), str(HERE)):
    if path not in sys.path:  # run from a checkout without installing
        sys.path.insert(0, path)

import generate as gen  # noqa: E402

from reshard_job.execute import SourceFiles, run_rank_task  # noqa: E402
from reshard_job.job.placement import per_node_placement  # noqa: E402
from reshard_job.job.ray_executor import RayExecutor  # noqa: E402
from reshard_job.plan import Planner  # noqa: E402
from reshard_job.sources import discover, load_strategy  # noqa: E402
from reshard_job.tasks import RankTask, WriteOptions  # noqa: E402
from reshard_job.text import human_size  # noqa: E402

CASES = {"8to4": 4, "8to16": 16}


def log(msg: str) -> None:
    print(f"[ray_scaling {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def plan_tasks(meta: dict, case: str, out: Path, max_memory: int) -> list[RankTask]:
    src_dir = meta["sources"]["src"]["path"]
    found = discover(src_dir)
    src = load_strategy(meta["strategies"]["src"])
    dst = load_strategy(meta["strategies"][f"dst_{CASES[case]}"])
    with SourceFiles(found.files) as opened:
        plan = Planner(src.topology, dst.topology, opened.index()).plan()
    options = WriteOptions(max_memory=max_memory)
    return [RankTask(rp.target_rank, rp, {r: found.files[r] for r in rp.source_ranks},
                     str(out / f"rank_{rp.target_rank}" / f"checkpoint_{rp.target_rank}.ckpt"), options)
            for rp in plan.ranks]


def retarget(tasks: list[RankTask], out: Path) -> list[RankTask]:
    return [RankTask(t.target_rank, t.plan, t.sources, str(out / Path(t.out_path).relative_to(
        Path(t.out_path).parents[1])), t.options) for t in tasks]


def run_local(tasks: list[RankTask]) -> tuple[float, dict]:
    started = time.perf_counter()
    results = {t.target_rank: run_rank_task(t) for t in tasks}
    return time.perf_counter() - started, results


def run_ray(tasks: list[RankTask], address: str, nodes: int, cpus_per_task: float) -> tuple[float, dict, list]:
    per_node = max(1, -(-len(tasks) // nodes))
    results: dict = {}
    shown = [0]
    executor = RayExecutor(address, placement=per_node_placement(per_node), num_cpus_per_task=cpus_per_task)
    with executor:
        started = time.perf_counter()
        executor.run(tasks, on_bytes=lambda n: shown.__setitem__(0, shown[0] + n),
                     on_done=lambda r: results.__setitem__(r.target_rank, r))
        wall = time.perf_counter() - started
        rows = [{"resources": sorted(n.resources), "address": n.address, "host": n.host, "ranks": n.ranks,
                 "bytes_written": n.bytes_written, "bytes_read": n.bytes_read, "wall_s": round(n.wall_seconds, 3),
                 "busy_s": round(n.busy_seconds, 3)} for n in executor.summary()]
        log("per node:\n" + executor.summary_table())
    return wall, results, rows


def check_same(reference: dict, got: dict) -> None:
    assert sorted(reference) == sorted(got), "ranks differ"
    for rank, ours in reference.items():
        theirs = got[rank]
        if (ours.sha256, ours.tensors) != (theirs.sha256, theirs.tensors):
            raise SystemExit(f"rank {rank}: the Ray output differs from the local one")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=0.5)
    ap.add_argument("--dtype", choices=sorted(gen.DTYPES), default="float16")
    ap.add_argument("--case", choices=sorted(CASES), default="8to4")
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--address", help="an existing cluster (host:port or ray://host:port)")
    where.add_argument("--local-nodes", default="1,2", help="node counts of a loopback cluster started here")
    ap.add_argument("--nodes", default="1,2", help="with --address: how many of its reshard_node_<k> to use")
    ap.add_argument("--cpus-per-task", type=float, default=1)
    ap.add_argument("--max-memory", type=int, default=32 * 1024 * 1024)
    ap.add_argument("--data", default=str(HERE / "data"), help="where sources and outputs go")
    ap.add_argument("--results-dir", default=str(HERE / "results"))
    a = ap.parse_args(argv)

    meta = gen.generate(gen.data_dir_for(a.data, a.size_gb, a.dtype), a.size_gb, a.dtype, sources=("src",),
                        log=log)
    scratch = Path(a.data) / f"ray_scaling_{os.getpid()}"
    runs = []
    try:
        tasks = plan_tasks(meta, a.case, scratch / "local", a.max_memory)
        local_s, reference = run_local(tasks)
        written = sum(r.size for r in reference.values())
        log(f"local, one process: {local_s:.2f} s for {human_size(written)}")
        runs.append({"mode": "local", "nodes": 0, "wall_s": round(local_s, 3)})
        counts = [int(n) for n in (a.nodes if a.address else a.local_nodes).split(",") if n]
        for n in counts:
            out = scratch / f"ray_{n}"
            cluster = None
            address = a.address
            if address is None:
                sys.path.insert(0, str(REPO / "tests" / "ray"))
                import local_cluster

                cluster = local_cluster.start_cluster(n)
                address = cluster.address
            try:
                wall, results, rows = run_ray(retarget(tasks, out), address, n, a.cpus_per_task)
            finally:
                if cluster is not None:
                    local_cluster.stop_cluster(cluster)
            check_same(reference, results)
            log(f"ray, {n} node(s): {wall:.2f} s ({wall / local_s:.2f} x local); outputs identical")
            runs.append({"mode": "ray", "nodes": n, "wall_s": round(wall, 3), "per_node": rows})
            shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    result = {"size_gb": a.size_gb, "dtype": a.dtype, "case": a.case, "bytes_written": written,
              "cluster": a.address or "loopback (one machine)", "cpus_per_task": a.cpus_per_task, "runs": runs}
    os.makedirs(a.results_dir, exist_ok=True)
    path = Path(a.results_dir) / f"ray-{stamp}.json"
    path.write_text(json.dumps(result, indent=2))
    lines = [f"# Ray scaling {stamp}: {a.size_gb} GB {a.dtype}, {a.case}, {result['cluster']}", "",
             "| mode | nodes | wall s | × local |", "|---|---:|---:|---:|"]
    lines += [f"| {r['mode']} | {r['nodes'] or '-'} | {r['wall_s']:.2f} | {r['wall_s'] / local_s:.2f} |" for r in runs]
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    log(f"results in {path} and {path.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
