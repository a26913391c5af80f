"""Loading one target rank at load time (``reshard_job.load_rank``) against the ways to get the same
tensors through a converted copy, in one run.

For the synthetic GPT-like source of ``generate.py`` (default 2.07 GB float16, 8 ranks mp4 x dp2
with optimizer parallelism) and target rank 0 of the 4-rank mp4 layout, each round times, as
separate processes measured by ``measure_child.py`` (wall, CPU, peak RSS of the process tree):

* **load (disk)**: ``load_rank(0, ...)`` from the local source;
* **load (S3)**: the same from a bucket of a SeaweedFS server started for the run, through a
  counting proxy (bytes fetched), when ``--start-server DIR`` is given;
* **job, all ranks**: the offline conversion 8 -> 4 (``python -m reshard_job``, lineage off);
* **read converted rank**: reading every tensor of the job's rank-0 file.

Bytes read by a local process are its ``rchar`` (``/proc/self/io``: every byte it read, page cache
included); the plan's ``bytes_read`` for the rank is what it needs. Medians of ``--runs``.

    python benchmarks/load_rank.py --size-gb 2.07 --runs 3 --start-server /tmp/weed-load
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from generate import data_dir_for, generate  # noqa: E402

LOAD = """
import json, sys, reshard_job
opts = json.loads(sys.argv[1])
arrays = reshard_job.load_rank(0, opts["src"], opts["src_strategy"], opts["dst_strategy"],
                               storage_options=opts.get("storage"))
io = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
print(json.dumps({"tensors": len(arrays), "bytes": sum(a.nbytes for a in arrays.values()), "rchar": int(io["rchar"])}))
"""
READ = """
import json, sys
from reshard_job.formats.ckpt import CheckpointReader
with CheckpointReader(sys.argv[1]) as r:
    n = sum(len(r.read_raw(name)) for name in r.names())
io = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
print(json.dumps({"bytes": n, "rchar": int(io["rchar"])}))
"""


def measured(cmd: list[str], env: dict | None = None) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        proc = subprocess.run([sys.executable, "-S", os.path.join(HERE, "measure_child.py"), f.name, "--", *cmd],
                              capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise SystemExit(f"{cmd[:4]} failed: {proc.stderr[-2000:]}")
        out = json.load(open(f.name))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    out.update(json.loads(lines[-1]) if lines else {})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=2.07)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "reshard-bench"))
    ap.add_argument("--start-server", default=None, help="run a SeaweedFS server with its data here")
    opts = ap.parse_args()
    data = data_dir_for(opts.data_dir, opts.size_gb, "float16")
    meta = generate(data, opts.size_gb, sources=("src",))
    src, strategies = os.path.join(data, "src"), meta["strategies"]
    dst = strategies["dst_4"]
    args = {"src": src, "src_strategy": strategies["src"], "dst_strategy": dst}
    from reshard_job.api import build_plan

    plan, prepared = build_plan(src, strategies["src"], dst, target_ranks=[0])
    needed = plan.rank(0).bytes_read
    prepared.close()
    rows: dict[str, list[dict]] = {"load (disk)": [], "job, all ranks": [], "read converted rank": []}
    out = tempfile.mkdtemp(prefix="load-bench-")
    server = _server(opts.start_server, src, strategies["src"], args) if opts.start_server else None
    try:
        for _ in range(opts.runs):
            rows["load (disk)"].append(measured([sys.executable, "-c", LOAD, json.dumps(args)]))
            shutil.rmtree(os.path.join(out, "job"), ignore_errors=True)
            rows["job, all ranks"].append(measured([sys.executable, "-m", "reshard_job", f"source.checkpoints={src}",
                                                   f"source.strategy={strategies['src']}", "target=strategy",
                                                   f"target.strategy={dst}", f"output.dir={out}/job",
                                                   "lineage.enabled=false", f"hydra.run.dir={out}/hydra"]))
            rows["read converted rank"].append(measured([sys.executable, "-c", READ,
                                                         f"{out}/job/rank_0/checkpoint_0.ckpt"]))
            if server is not None:
                rows.setdefault("load (S3)", []).append(server.load())
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(out, ignore_errors=True)
    _report(rows, needed, opts)
    return 0


class _S3Loads:
    """A SeaweedFS server holding the source, and loads from it through a counting proxy."""

    def __init__(self, root: str, src: str, src_strategy: str, args: dict):
        from s3_support import CountingProxy, start_seaweedfs

        self.weed = start_seaweedfs(root)
        import s3fs

        fs = s3fs.S3FileSystem(endpoint_url=self.weed.endpoint, key=self.weed.environment()["AWS_ACCESS_KEY_ID"],
                               secret=self.weed.environment()["AWS_SECRET_ACCESS_KEY"])
        fs.mkdir("loadbench")
        fs.put(src, "loadbench/src", recursive=True)
        fs.put(src_strategy, "loadbench/src_strategy.ckpt")
        self.proxy = CountingProxy(self.weed.endpoint).__enter__()
        env = self.weed.environment()
        self.args = dict(args, src="s3://loadbench/src", src_strategy="s3://loadbench/src_strategy.ckpt",
                         storage={"endpoint_url": self.proxy.endpoint,
                                  "options": {"key": env["AWS_ACCESS_KEY_ID"], "secret": env["AWS_SECRET_ACCESS_KEY"]}})

    def load(self) -> dict:
        before = self.proxy.bytes_read
        row = measured([sys.executable, "-c", LOAD, json.dumps(self.args)])
        row["fetched"] = self.proxy.bytes_read - before
        return row

    def stop(self) -> None:
        self.proxy.__exit__()
        self.weed.stop()


def _server(root, src, src_strategy, args):
    return _S3Loads(root, src, src_strategy, args)


def _report(rows: dict, needed: int, opts) -> None:
    print(f"\nload_rank benchmark: {opts.size_gb} GB float16, 8 -> 4 ranks, target rank 0 needs {needed / 1e6:.1f} MB; "
          f"{os.cpu_count()} cores; medians of {opts.runs}")
    print(f"| {'what':22} | wall s | CPU s | peak RSS MiB | bytes read MB |")
    print("|---|---:|---:|---:|---:|")
    for what, runs in rows.items():
        if not runs:
            continue
        wall = statistics.median(r["wall_s"] for r in runs)
        cpu = statistics.median(r["user_s"] + r["sys_s"] for r in runs)
        rss = statistics.median(r["maxrss_kib"] for r in runs) / 1024
        read = runs[-1].get("fetched", runs[-1].get("rchar"))
        print(f"| {what:22} | {wall:.2f} | {cpu:.2f} | {rss:.0f} | {read / 1e6 if read else float('nan'):.1f} |")


if __name__ == "__main__":
    sys.exit(main())
