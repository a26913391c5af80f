"""Planner cost against model size: time and peak memory of planning a mixture-of-experts
checkpoint of 30k / 100k / 300k parameters per rank on 8 source ranks.

The model is synthetic and the planner pure, so no file is involved: an index (what each source
file holds: name, dtype, local shape) and two strategies are built in memory, then planned. The
source is 8 ranks = data parallel 2 x model parallel 4 with optimizer parallel over dp (like
golden S2); the target 4 ranks of model parallel 4 (``--target 8`` for 8 ranks of mp 8). A third
of the entries are weights (expert MLPs w1/w2/w3, attention, norms), two thirds their Adam states.

Each measurement runs in a child process, twice: once timed, once under ``tracemalloc`` for the
peak of Python allocations made while planning (the index and strategies it is given are built
before and reported apart, since the job holds them anyway). RSS is the child's peak.

    .venv/bin/python benchmarks/plan_scaling.py                 # 30k, 100k, 300k
    .venv/bin/python benchmarks/plan_scaling.py --sizes 300000 --json

Memory measured (tracemalloc, MiB) for 8 -> 4 ranks, planning every target rank:

    entries per rank   planned (rank x param)   planning peak   plan kept   index + strategies
              30,000                  120,000             8.2         3.9                 16.4
             100,000                  399,996            27.9        13.4                 60.2
             300,000                1,200,000            85.0        40.9                143.4

about 70 bytes of peak and 35 kept per (target rank, parameter), linear in the parameters; the
plan's JSON form is 42 MB at 300k (``--to-json``). Times are printed too but were not recorded
here: the machine they were taken on was shared and loaded.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
import tracemalloc


def build(per_rank: int, target_devices: int):
    """(source topology, target topology, index) of a MoE model with `per_rank` entries per rank."""
    from reshard_job.core.strategy_model import ParamLayout, StrategyFile, StrategyItem
    from reshard_job.core.tensor_meta import TensorMeta
    from reshard_job.core.topology import Topology

    hidden, ffn = 128, 256
    sharded = dict(opt_shard_step=4, opt_shard_size=-1)  # optimizer parallel over dp
    col = ParamLayout((2, 4), (-1, 0), **sharded)  # [hidden, ffn] split by mp on columns
    row = ParamLayout((2, 4), (0, -1), **sharded)  # [ffn, hidden] split by mp on rows
    norm = ParamLayout((2, 4), (-1,), **sharded)
    t_col, t_row, t_norm = (ParamLayout((target_devices,), m) for m in ((-1, 0), (0, -1), (-1,)))
    weights: list[tuple[str, tuple[int, ...], ParamLayout, ParamLayout]] = []
    layer = 0
    while 3 * len(weights) < per_rank:
        p = f"model.layers.{layer}"
        weights += [(f"{p}.attention_norm.weight", (hidden,), norm, t_norm),
                    (f"{p}.attention.wq.weight", (hidden, hidden * 4), col, t_col),
                    (f"{p}.attention.wo.weight", (hidden * 4, hidden), row, t_row)]
        for e in range(64):
            q = f"{p}.feed_forward.experts.{e}"
            weights += [(f"{q}.w1.weight", (hidden, ffn), col, t_col), (f"{q}.w3.weight", (hidden, ffn), col, t_col),
                        (f"{q}.w2.weight", (ffn, hidden), row, t_row)]
        layer += 1
    weights = weights[:per_rank // 3]
    src_layouts, dst_layouts, local = {}, {}, {}
    for name, shape, s, t in weights:
        for prefix in ("", "adam_m.", "adam_v."):
            src_layouts[prefix + name] = s
            dst_layouts[prefix + name] = t
            local[prefix + name] = shape
    items = [StrategyItem("op", 0, ())]
    src = Topology.from_strategy(StrategyFile(src_layouts, items, path="synthetic source"))
    dst = Topology.from_strategy(StrategyFile(dst_layouts, items, path="synthetic target"))
    metas: dict[tuple, TensorMeta] = {}  # equal metadata shared, as an index builder should
    index = {}
    for rank in range(8):
        entries = {}
        for name, shape in local.items():
            lay = src_layouts[name]
            # local shape: mp splits one dimension by 4, optimizer parallel splits dimension 0 by 2
            split = [4 if m == 0 else 1 for m in lay.tensor_map]
            ls = tuple(n // d for n, d in zip(shape, split))
            ls = (ls[0] // 2,) + ls[1:]
            meta = metas.setdefault(ls, TensorMeta("Float32", ls, "tensor", 4 * _prod(ls)))
            entries[name] = meta
        index[rank] = entries
    return src, dst, index


def _prod(shape) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def child(per_rank: int, target_devices: int, traced: bool, to_json: bool) -> dict:
    from reshard_job.plan.planner import Planner

    if traced:
        tracemalloc.start()
    t0 = time.perf_counter()
    src, dst, index = build(per_rank, target_devices)
    built = time.perf_counter() - t0
    inputs = tracemalloc.get_traced_memory()[0] if traced else None
    if traced:
        tracemalloc.reset_peak()
    t1 = time.perf_counter()
    plan = Planner(src, dst, index).plan()
    planned = time.perf_counter() - t1
    out = {"per_rank": per_rank, "target_devices": target_devices, "params_planned": sum(len(rp.params) for rp in plan.ranks),
           "build_s": round(built, 2), "plan_s": round(planned, 2)}
    if traced:
        current, peak = tracemalloc.get_traced_memory()
        out.update(inputs_mib=round(inputs / 2**20, 1), plan_peak_mib=round((peak - inputs) / 2**20, 1),
                   plan_kept_mib=round((current - inputs) / 2**20, 1))
    if to_json:
        t2 = time.perf_counter()
        doc = json.dumps(plan.to_json())
        out.update(json_s=round(time.perf_counter() - t2, 2), json_mib=round(len(doc) / 2**20, 1))
    out["rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return out


def run(sizes: list[int], target_devices: int, to_json: bool) -> list[dict]:
    rows = []
    for n in sizes:
        row = {}
        for traced in (False, True):
            cmd = [sys.executable, __file__, "--child", str(n), "--target", str(target_devices)]
            cmd += ["--traced"] if traced else []
            cmd += ["--to-json"] if to_json and not traced else []
            res = subprocess.run(cmd, capture_output=True, text=True, check=True)
            got = json.loads(res.stdout)
            if traced:
                row.update({k: got[k] for k in ("inputs_mib", "plan_peak_mib", "plan_kept_mib")})
            else:
                row.update(got)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="30000,100000,300000", help="entries per source rank, comma-separated")
    ap.add_argument("--target", type=int, default=4, help="target ranks (model parallel)")
    ap.add_argument("--to-json", action="store_true", help="also time Plan.to_json and report its size")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--traced", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.target, args.traced, args.to_json)))
        return
    rows = run([int(s) for s in args.sizes.split(",")], args.target, args.to_json)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    from reshard_job.text import table

    cols = ["per_rank", "params_planned", "plan_s", "plan_peak_mib", "plan_kept_mib", "inputs_mib", "rss_mib"]
    cols += ["json_s", "json_mib"] if args.to_json else []
    print(table(cols, [[r.get(c) for c in cols] for r in rows], align_right=set(range(len(cols)))))


if __name__ == "__main__":
    main()
