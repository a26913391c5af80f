"""The floor under a conversion on this machine: what any tool must spend to move the same bytes
with the checks the contract asks for, timed beside a durable copy and the job in one invocation.

    python benchmarks/floor.py --data-dir /tmp/bdata/gpt_2.07gb_float16 --runs 3 --workers 2 [--job]

Variants, each run in turn (``--runs`` rounds, medians reported), on the source folder of a case that
``generate.py`` made (8 ranks, mp4 x dp2 with optimizer sharding: its 8 -> 4 conversion writes as
many bytes as it reads):

- ``cp -r && sync``: the durable copy the targets are ratios of;
- ``floor: copy``: every source byte read once (``preadv`` into one page-aligned 32 MiB buffer) and
  written once with ``O_DIRECT``, each file fsynced, the files split over ``--workers`` processes:
  a durable copy in Python, no hashing;
- ``floor: copy + 2 x sha256``: the same, each buffer also hashed twice (the contract's file digest
  and per-tensor digests: two sha256 passes over every output byte; a third over the sources is
  saved by the digest cache, as in the job's reruns);
- ``job`` (with ``--job``): ``python -m reshard_job`` 8 -> 4 as ``run.py`` runs it (digest cache
  warm: the first, cold run is not counted).

What the floor leaves out, and the job cannot: interpreter and framework start-up (``python -c
pass``, a Hydra app that does nothing, importing SQLAlchemy: timed once each below the table),
reading and planning the strategies, the fingerprint (``fingerprint_kernel.py``: ~0.1 CPU-s/GB),
the per-tensor work. Wall and CPU (user + sys of the process tree, ``os.wait4``) per variant.
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CHUNK = 32 << 20
ALIGN = 4096


def copy_files(pairs: list[tuple[str, str]], hashes: int) -> None:
    """Copy each (source, destination) with O_DIRECT writes, `hashes` sha256 passes over the bytes."""
    buf = mmap.mmap(-1, CHUNK)  # page-aligned, as O_DIRECT needs
    view = memoryview(buf)
    direct = getattr(os, "O_DIRECT", 0)
    for src, dst in pairs:
        digests = [hashlib.sha256() for _ in range(hashes)]
        fd_in = os.open(src, os.O_RDONLY)
        fd_out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct, 0o644)
        try:
            size, offset = os.fstat(fd_in).st_size, 0
            while offset < size:
                n = os.preadv(fd_in, [view], offset)
                if n <= 0:
                    raise OSError(f"{src}: short read at {offset}")
                for d in digests:
                    d.update(view[:n])
                padded = -(-n // ALIGN) * ALIGN
                view[n:padded] = bytes(padded - n)
                os.write(fd_out, view[:padded])
                offset += n
            os.ftruncate(fd_out, size)  # the tail was written padded to the block size
            os.fsync(fd_out)
        finally:
            os.close(fd_in)
            os.close(fd_out)


def timed_floor(src: str, out: str, workers: int, hashes: int) -> dict:
    """Fork `workers` processes over the files (largest first, to the least loaded), wait for them."""
    files = sorted(((os.path.getsize(os.path.join(d, f)), os.path.join(d, f))
                    for d, _, names in os.walk(src) for f in names), reverse=True)
    shares: list[list[tuple[str, str]]] = [[] for _ in range(workers)]
    loads = [0] * workers
    for size, path in files:
        k = loads.index(min(loads))
        dst = os.path.join(out, os.path.relpath(path, src))
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shares[k].append((path, dst))
        loads[k] += size
    t0 = time.perf_counter()
    pids = []
    for share in shares:
        pid = os.fork()
        if pid == 0:
            try:
                copy_files(share, hashes)
                os._exit(0)
            except BaseException:
                os._exit(1)
        pids.append(pid)
    cpu, ok = 0.0, True
    for pid in pids:
        _, status, ru = os.wait4(pid, 0)
        ok &= os.waitstatus_to_exitcode(status) == 0
        cpu += ru.ru_utime + ru.ru_stime
    wall = time.perf_counter() - t0
    if not ok:
        raise RuntimeError("a floor worker failed")
    return {"wall_s": wall, "cpu_s": cpu}


def timed_command(cmd: list[str], cwd: str | None = None) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, ru = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{cmd[:4]} failed: {err[-2000:]}")
    return {"wall_s": wall, "cpu_s": ru.ru_utime + ru.ru_stime}


def job_command(data: str, out: str, scratch: str, workers: int) -> list[str]:
    strategies = os.path.join(data, "strategy")
    return [sys.executable, "-m", "reshard_job", "source=checkpoints", "target=strategy",
            f"source.checkpoints={os.path.join(data, 'src')}",
            f"source.strategy={os.path.join(strategies, 'src_8_mp4dp2.ckpt')}",
            f"target.strategy={os.path.join(strategies, 'dst_4_mp4.ckpt')}", f"output.dir={out}",
            f"job.workers={workers}", f"lineage.url=sqlite:///{os.path.join(scratch, 'lineage.db')}",
            f"hydra.run.dir={os.path.join(scratch, 'hydra')}"]


def warm(path: str) -> None:
    subprocess.run(["find", path, "-type", "f", "-exec", "cat", "{}", "+"], stdout=subprocess.DEVNULL, check=False)


def clear(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.sync()


def start_up_costs() -> list[tuple[str, float]]:
    """Wall seconds of what every run of a Python, Hydra-driven, SQLAlchemy-recording job pays first."""
    app = os.path.join(HERE, "data", "floor_hydra_app")
    os.makedirs(os.path.join(app, "conf"), exist_ok=True)
    with open(os.path.join(app, "conf", "config.yaml"), "w") as f:
        f.write("a: 1\nhydra:\n  output_subdir: null\n  run:\n    dir: .\n")
    with open(os.path.join(app, "app.py"), "w") as f:
        f.write("import hydra\n\n@hydra.main(version_base=None, config_path='conf', config_name='config')\n"
                "def main(cfg):\n    pass\n\nmain()\n")
    cases = [("python -c pass", [sys.executable, "-c", "pass"]),
             ("a Hydra app that does nothing", [sys.executable, os.path.join(app, "app.py")]),
             ("python -c 'import sqlalchemy.orm'", [sys.executable, "-c", "import sqlalchemy.orm"]),
             ("python -c 'import numpy'", [sys.executable, "-c", "import numpy"])]
    return [(name, statistics.median(timed_command(cmd, cwd=app)["wall_s"] for _ in range(5))) for name, cmd in cases]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", required=True, help="a generate.py case folder (src/, strategy/)")
    ap.add_argument("--scratch", default=None, help="where outputs go (default: beside --data-dir)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--job", action="store_true", help="time the 8 -> 4 job beside the floor")
    a = ap.parse_args(argv)
    src = os.path.join(a.data_dir, "src")
    scratch = a.scratch or os.path.join(os.path.dirname(os.path.abspath(a.data_dir)), "floor-scratch")
    os.makedirs(scratch, exist_ok=True)
    out = os.path.join(scratch, "out")
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(src) for f in names)
    variants = [("cp -r && sync", lambda: timed_command(["sh", "-c", 'cp -r "$0" "$1" && sync', src, out])),
                ("floor: copy", lambda: timed_floor(src, out, a.workers, 0)),
                ("floor: copy + 2 x sha256", lambda: timed_floor(src, out, a.workers, 2))]
    if a.job:
        variants.append(("job 8 -> 4", lambda: timed_command(job_command(a.data_dir, out, scratch, a.workers))))
        clear(out)
        timed_command(job_command(a.data_dir, out, scratch, a.workers))  # fills the digest cache: not counted
    results: dict[str, list[dict]] = {name: [] for name, _ in variants}
    for _ in range(a.runs):
        for name, run in variants:
            clear(out)
            warm(src)
            results[name].append(run())
    clear(out)
    gb = size / 1e9
    base = statistics.median(r["wall_s"] for r in results["cp -r && sync"])
    print(f"{size / 1e9:.2f} GB in {src}; {os.cpu_count()} cores; workers {a.workers}; medians of {a.runs}\n")
    print("| variant | wall s (median) | min–max | × cp -r && sync | CPU s | CPU s/GB |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, rs in results.items():
        walls = [r["wall_s"] for r in rs]
        cpu = statistics.median(r["cpu_s"] for r in rs)
        print(f"| {name} | {statistics.median(walls):.2f} | {min(walls):.2f}–{max(walls):.2f} | "
              f"{statistics.median(walls) / base:.2f} | {cpu:.2f} | {cpu / gb:.2f} |")
    print("\nStart-up paid by every run (wall s, median of 5):\n")
    for name, wall in start_up_costs():
        print(f"- {name}: {wall:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
