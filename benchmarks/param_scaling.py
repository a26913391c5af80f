"""Many small parameters: time and peak memory of a whole job against the parameter count.

A large mixture-of-experts checkpoint holds tens of thousands of expert weights per rank, three
times that with Adam states. Cost that grows per parameter (index entries, plan entries, digests,
lineage rows) then dominates, not bytes. This generates 8 source ranks (dp2 x mp4, dimension 0 of
every weight split over mp) holding ``--params`` entries each (a third weights, a third
``adam_m.``, a third ``adam_v.``), converts them 8 -> 4 (mp4) with ``python -m reshard_job`` and
reports wall time, CPU time and the peak RSS of the process tree (``/usr/bin/time``-style, from
``resource.getrusage`` of the children), for each count.

Usage::

    python benchmarks/param_scaling.py --params 30000,100000,300000 --out /tmp/param_scaling
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

SHAPE = (8, 4)  # global shape of every weight: dimension 0 split 4 ways over mp
DP, MP = 2, 4


def _names(n_entries: int) -> list[str]:
    base = [f"experts.{i}.w" for i in range(max(1, n_entries // 3))]
    return base + [f"adam_m.{b}" for b in base] + [f"adam_v.{b}" for b in base]


def _write_rank(args) -> None:
    from reshard_job.formats.ckpt import CheckpointWriter

    root, rank, n_entries = args
    mp = rank % MP
    rows = SHAPE[0] // MP
    block = np.arange(rows * SHAPE[1], dtype=np.float16).reshape(rows, SHAPE[1]) + mp
    with CheckpointWriter(os.path.join(root, "src", f"rank_{rank}", f"checkpoint_{rank}.ckpt")) as w:
        for name in _names(n_entries):
            w.add(name, block)


def generate(root: str, n_entries: int) -> None:
    from reshard_job.formats.strategy import ParamLayout, StrategyFile, StrategyItem, write_strategy

    if os.path.exists(os.path.join(root, "done")):
        return
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    names = _names(n_entries)
    src = {n: ParamLayout((DP, MP), (0, -1)) for n in names}
    dst = {n: ParamLayout((MP,), (0, -1)) for n in names}
    write_strategy(StrategyFile(src, [StrategyItem("op", 0, ())]), os.path.join(root, "src_strategy.ckpt"))
    write_strategy(StrategyFile(dst, [StrategyItem("op", 0, ())]), os.path.join(root, "dst_strategy.ckpt"))
    with ProcessPoolExecutor(2) as pool:
        list(pool.map(_write_rank, [(root, r, n_entries) for r in range(DP * MP)]))
    open(os.path.join(root, "done"), "w").close()


def run_job(root: str, extra: list[str]) -> dict:
    out = os.path.join(root, "out")
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "reshard_job", f"source.checkpoints={root}/src", "source=checkpoints",
           f"source.strategy={root}/src_strategy.ckpt", "target=strategy", f"target.strategy={root}/dst_strategy.ckpt",
           f"output.dir={out}", f"lineage.url=sqlite:///{root}/lineage.db", f"hydra.run.dir={root}/run", *extra]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=root)
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if res.returncode != 0:
        raise SystemExit(f"job failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return {"wall_s": round(wall, 2), "cpu_s": round((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), 2),
            "peak_rss_mib": round(after.ru_maxrss / 1024, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="30000,100000,300000", help="entries per rank, comma separated")
    ap.add_argument("--out", default="/tmp/param_scaling")
    ap.add_argument("--workers", type=int, default=1)
    args = ap.parse_args()
    rows = []
    for n in [int(x) for x in args.params.split(",")]:
        root = os.path.join(args.out, f"p{n}")
        t = time.monotonic()
        generate(root, n)
        gen = time.monotonic() - t
        r = run_job(root, [f"job.workers={args.workers}"])
        r.update(params_per_rank=n, ranks=DP * MP, generate_s=round(gen, 1))
        rows.append(r)
        print(json.dumps(r), flush=True)
    print("\n| parameters per rank | wall s | CPU s | peak RSS MiB (largest process) |\n|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['params_per_rank']:,} | {r['wall_s']} | {r['cpu_s']} | {r['peak_rss_mib']} |")


if __name__ == "__main__":
    main()
