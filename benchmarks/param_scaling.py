"""Many small parameters: time and peak memory of a whole job against the parameter count.

A large mixture-of-experts checkpoint holds tens of thousands of expert weights per rank, three
times that with Adam states. Cost that grows per parameter (index entries, plan entries, digests,
lineage rows) then dominates, not bytes. This generates 8 source ranks (dp2 x mp4, dimension 0 of
every weight split over mp) holding ``--params`` entries each (a third weights, a third
``adam_m.``, a third ``adam_v.``), converts them 8 -> 4 (mp4) with ``python -m reshard_job`` and
reports, per count, the median over ``--runs`` runs of the wall time, the CPU time (user + sys of
the process tree) and the peak memory: the job's own high-water mark (``os.wait4``) or, with
several worker processes, the summed PSS of its process tree sampled every 50 ms, whichever is
larger (``run.run_timed``, the same measurement as the main benchmark). Every run converts
afresh into an empty output folder with an empty lineage database.

Usage::

    python benchmarks/param_scaling.py --params 30000,100000,300000 --runs 3 --out /tmp/param_scaling
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)
sys.path.insert(0, _HERE)

from run import run_timed  # noqa: E402  (the main benchmark's measurement of a child process)

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
    from reshard_job.formats.strategy import write_strategy
    from reshard_job.core.strategy_model import ParamLayout, StrategyFile, StrategyItem

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
    db = os.path.join(root, "lineage.db")
    for path in (out, os.path.join(root, "run")):
        shutil.rmtree(path, ignore_errors=True)
    if os.path.exists(db):
        os.unlink(db)
    cmd = [sys.executable, "-m", "reshard_job", f"source.checkpoints={root}/src", "source=checkpoints",
           f"source.strategy={root}/src_strategy.ckpt", "target=strategy", f"target.strategy={root}/dst_strategy.ckpt",
           f"output.dir={out}", f"lineage.url=sqlite:///{db}", f"hydra.run.dir={root}/run", *extra]
    log_path = os.path.join(root, "job.log")
    r = run_timed(cmd, log_path, cwd=root)
    if r["rc"] != 0:
        with open(log_path, errors="replace") as f:
            raise SystemExit(f"job failed ({r['rc']}):\n{f.read()[-3000:]}")
    return {"wall_s": r["wall_s"], "cpu_s": r["user_s"] + r["sys_s"], "peak_rss_mib": r["peak_rss_mib"],
            "procs": r["procs"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="30000,100000,300000", help="entries per rank, comma separated")
    ap.add_argument("--out", default="/tmp/param_scaling")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for n in [int(x) for x in args.params.split(",")]:
        root = os.path.join(args.out, f"p{n}")
        t = time.monotonic()
        generate(root, n)
        gen = time.monotonic() - t
        runs = [run_job(root, [f"job.workers={args.workers}"]) for _ in range(args.runs)]
        r = {key: round(statistics.median(x[key] for x in runs), 2) for key in ("wall_s", "cpu_s", "peak_rss_mib")}
        r.update(max_wall_s=round(max(x["wall_s"] for x in runs), 2),
                 max_rss_mib=round(max(x["peak_rss_mib"] for x in runs), 1), procs=max(x["procs"] for x in runs),
                 params_per_rank=n, ranks=DP * MP, runs=args.runs, generate_s=round(gen, 1))
        rows.append(r)
        print(json.dumps(r), flush=True)
    print(f"\n{os.cpu_count()} cores, {platform.platform()}, job.workers={args.workers}, medians of {args.runs} runs "
          "(max in brackets); 8 source ranks (dp2 x mp4) -> 4 target ranks (mp4)\n")
    print("| parameters per rank (x 8 ranks) | wall s | CPU s | peak RSS MiB |\n|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['params_per_rank']:,} ({r['params_per_rank'] * r['ranks']:,} in all) | {r['wall_s']} ({r['max_wall_s']}) | "
              f"{r['cpu_s']} | {r['peak_rss_mib']:.0f} ({r['max_rss_mib']:.0f}) |")


if __name__ == "__main__":
    main()
