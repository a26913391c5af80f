"""Convert a checkpoint through the Python API, as a user of MindSpore's function would call it.

    python benchmarks/convert_api.py SRC_DIR DST_DIR SRC_STRATEGY DST_STRATEGY [--workers N]

With one worker this is exactly ``transform_checkpoints(SRC_DIR, DST_DIR, "checkpoint_", src, dst)``.
A directory of per-stage pipeline strategies is first merged with ``merge_pipeline_strategies`` (as
MindSpore users do with ``merge_pipeline_strategys``; the merge is part of the timed work).

With N > 1 workers the target ranks are split over N processes, each calling
``transform_checkpoint_by_rank`` with the files ``rank_list_for_transform`` names: a stand-in for
the batch job's ``job.workers`` for use before the job exists, and a way to compare the two.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

PREFIX = "checkpoint_"


def _src_files(src_dir: str) -> dict[int, str]:
    out = {}
    for entry in os.listdir(src_dir):
        if entry.startswith("rank_") and entry[5:].isdigit():
            d = os.path.join(src_dir, entry)
            ckpts = sorted(n for n in os.listdir(d) if n.endswith(".ckpt"))
            if ckpts:
                out[int(entry[5:])] = os.path.join(d, ckpts[-1])
    return out


def _convert_ranks(args) -> int:
    ranks, src_dir, dst_dir, src_strategy, dst_strategy = args
    from reshard_job import rank_list_for_transform, transform_checkpoint_by_rank

    files = _src_files(src_dir)
    for r in ranks:
        needed = rank_list_for_transform(r, src_strategy, dst_strategy)
        out = os.path.join(dst_dir, f"rank_{r}", f"{PREFIX}{r}.ckpt")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        transform_checkpoint_by_rank(r, {n: files[n] for n in needed}, out, src_strategy, dst_strategy)
    return len(ranks)


def convert(src_dir: str, dst_dir: str, src_strategy: str, dst_strategy: str, workers: int = 1) -> None:
    from reshard_job import merge_pipeline_strategies, transform_checkpoints

    with tempfile.TemporaryDirectory(prefix="bench_merge_") as tmp:
        if os.path.isdir(src_strategy):
            src_strategy = merge_pipeline_strategies(src_strategy, os.path.join(tmp, "src_merged.ckpt"))
        if workers <= 1:
            transform_checkpoints(src_dir, dst_dir, PREFIX, src_strategy, dst_strategy)
            return
        from reshard_job.sources.rank_folders import load_strategy

        n_target = load_strategy(dst_strategy).topology.devices
        shares = [list(range(w, n_target, workers)) for w in range(workers)]
        with ProcessPoolExecutor(workers) as ex:
            list(ex.map(_convert_ranks, [(s, src_dir, dst_dir, src_strategy, dst_strategy) for s in shares if s]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Convert through reshard_job's Python API.")
    ap.add_argument("src_dir")
    ap.add_argument("dst_dir")
    ap.add_argument("src_strategy", help="strategy file, or a directory of per-stage pipeline strategy files")
    ap.add_argument("dst_strategy")
    ap.add_argument("--workers", type=int, default=1)
    a = ap.parse_args(argv)
    convert(a.src_dir, a.dst_dir, a.src_strategy, a.dst_strategy, a.workers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
