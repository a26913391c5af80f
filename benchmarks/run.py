"""Benchmark runner: our conversion against ``cp -r`` of the same source, in one invocation.

For every requested model size and dtype it generates (or reuses) synthetic GPT-like sources
(``generate.py``), then, for ``--runs`` rounds, times as child processes:

* ``cp -r`` of each source directory used, and the baseline the targets are judged against, a
  **durable** copy ``cp -r && sync``: our writer makes each output durable before renaming it
  into place, plain ``cp`` leaves the bytes in the page cache, so only the durable copy does the
  same work;
* our conversion for each case (8->4, 8->16, 8->6, pipeline 2x4->4) and each ``--workers`` value,
  through the batch job (``--via job``) or the Python API (``--via api``);
* optionally MindSpore's ``transform_checkpoints`` (``--mindspore-python``).

Every timed command starts from a warm page cache: the source directory is read once right before
it (nothing is dropped from the cache, which needs no privileges and treats both sides alike).
Outputs are deleted and ``sync`` is called after every run, outside the timed region, so that one
run's write-back does not land in the next one's time. Wall time is measured around the child,
peak RSS from ``os.wait4`` on that child (``ru_maxrss``: the largest single process of its tree)
and from sampling the summed RSS of the child's process tree every 50 ms (for multi-process
workers). Medians over the runs are reported with ratios to ``cp -r`` measured in the same round.

Each case's output is verified once (outside the timed region) against the generator's known
content, so a fast but wrong conversion cannot be reported as a result.

Results: ``benchmarks/results/<timestamp>.json`` (raw), ``latest.md`` (table), ``scaling.png``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
if REPO not in sys.path:
    sys.path.insert(1, REPO)

import generate as gen  # noqa: E402

CASES = {  # name -> (source, target ranks, description)
    "8to4": ("src", 4, "8 (mp4 x dp2, opt) -> 4 (mp4)"),
    "8to16": ("src", 16, "8 (mp4 x dp2, opt) -> 16 (mp4 x dp4, opt)"),
    "8to6": ("src", 6, "8 (mp4 x dp2, opt) -> 6 (mp2 x dp3, opt)"),
    "pp2x4to4": ("src_pp", 4, "pipeline 2 x 4 (mp2 x dp2, opt) -> 4 (mp4)"),
}
MINDSPORE_CASES = {"8to4", "8to16", "pp2x4to4"}  # MindSpore rejects 8 -> 6
MIB = 1024 * 1024
DURABLE_COPY = "cp -r && sync"
SAMPLE_INTERVAL = 0.05

# Reference: MindSpore 2.10 transform_checkpoints on this kind of machine (from the performance issue)
MINDSPORE_REFERENCE = [
    ("8to4", "float16", 2.07, 36.5, 5.5 * 1024),
    ("8to4", "bfloat16", 2.07, 57.5, 9.5 * 1024),
    ("8to16", "float16", 2.07, 47.6, 5.0 * 1024),
]


def log(msg: str) -> None:
    print(msg, flush=True)


# ====================================================================================== measuring


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # the command name may hold spaces and parentheses: the ppid follows the last ')'
        rest = stat[stat.rfind(b")") + 2:].split()
        kids.setdefault(int(rest[1]), []).append(int(entry))
    return kids


def _pss_bytes(pid: int) -> int:
    """Proportional set size: shared pages (e.g. copy-on-write after fork) split among their users."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return 0


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


class TreeRssSampler(threading.Thread):
    """Samples the summed RSS and PSS of a process's descendants.

    Forked workers share their parent's pages copy-on-write: summed RSS counts those pages once
    per process, summed PSS once in all, which is what the machine actually spends."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid = pid
        self.peak = 0
        self.peak_pss = 0
        self.max_procs = 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            kids = _children_map()
            tree, todo = [], list(kids.get(self.pid, ()))  # the measured command and its descendants
            while todo:
                p = todo.pop()
                tree.append(p)
                todo.extend(kids.get(p, ()))
            self.peak = max(self.peak, sum(_rss_bytes(p) for p in tree))
            if len(tree) > 1:
                self.peak_pss = max(self.peak_pss, sum(_pss_bytes(p) for p in tree))
            self.max_procs = max(self.max_procs, len(tree))
            self._halt.wait(SAMPLE_INTERVAL)

    def stop(self) -> None:
        self._halt.set()
        self.join()


def run_timed(cmd: list[str], log_path: str, *, cwd: str | None = None, env: dict | None = None) -> dict:
    """Run `cmd` as a child of ``measure_child.py``: wall time and rusage of that child (os.wait4),
    plus the summed RSS of its process tree sampled every 50 ms (for multi-process workers)."""
    res_path = log_path + ".rusage.json"
    if os.path.exists(res_path):
        os.unlink(res_path)
    load_before = os.getloadavg()[0]
    wrapped = [sys.executable, "-S", os.path.join(HERE, "measure_child.py"), res_path, "--", *cmd]
    with open(log_path, "ab") as logf:
        logf.write(("\n$ " + shlex.join(cmd) + "\n").encode())
        logf.flush()
        t0 = time.perf_counter()
        proc = subprocess.Popen(wrapped, stdout=logf, stderr=subprocess.STDOUT, cwd=cwd, env=env)
        sampler = TreeRssSampler(proc.pid)
        sampler.start()
        proc.wait()
        outer_wall = time.perf_counter() - t0
        sampler.stop()
    try:
        with open(res_path) as f:
            ru = json.load(f)
    except (OSError, ValueError):
        ru = {"wall_s": outer_wall, "rc": proc.returncode or 1, "maxrss_kib": 0, "user_s": 0.0, "sys_s": 0.0}
    maxrss = ru["maxrss_kib"] * 1024
    return {
        "loadavg_1min_before": load_before,
        "wall_s": ru["wall_s"],
        "rc": ru["rc"],
        "maxrss_mib": maxrss / MIB,
        "tree_rss_peak_mib": sampler.peak / MIB,
        "tree_pss_peak_mib": sampler.peak_pss / MIB,
        # one process: its exact high-water mark; several: their summed PSS (sampled) if larger
        "peak_rss_mib": max(maxrss, sampler.peak_pss) / MIB,
        "procs": sampler.max_procs,
        "user_s": ru["user_s"],
        "sys_s": ru["sys_s"],
        "oublock": ru.get("oublock"),
    }


def log_tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 8192))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def warm(path: str) -> int:
    """Read every file under `path` once so that it sits in the page cache; return bytes read."""
    buf = bytearray(16 * MIB)
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in sorted(files):
            with open(os.path.join(dirpath, name), "rb", buffering=0) as f:
                while True:
                    n = f.readinto(buf)
                    if not n:
                        break
                    total += n
    return total


def rm(path: str) -> None:
    if os.path.isdir(path):
        for dirpath, dirnames, _ in os.walk(path):  # outputs are written read-only
            for d in dirnames:
                os.chmod(os.path.join(dirpath, d), 0o755)
        shutil.rmtree(path, ignore_errors=True)


def settle() -> None:
    """Flush write-back so that it does not spill into the next timed run."""
    os.sync()
    time.sleep(0.5)


# ========================================================================================= tools


def job_available(python: str) -> tuple[bool, str]:
    try:
        p = subprocess.run([python, "-m", "reshard_job", "--help"], capture_output=True, timeout=180, cwd=REPO)
    except subprocess.TimeoutExpired:
        return False, "python -m reshard_job --help timed out"
    if p.returncode != 0:
        err = (p.stderr or p.stdout).decode(errors="replace").strip().splitlines()
        return False, f"python -m reshard_job --help exited {p.returncode}: {err[-1] if err else ''}"
    return True, ""


def ours_command(via: str, python: str, src: str, src_strategy: str, dst_strategy: str, out: str,
                 workers: int, scratch: str, lineage_name: str = "lineage.db") -> list[str]:
    if via == "job":
        return [
            python, "-m", "reshard_job",
            "source=checkpoints",  # config groups for real inputs (the defaults are the built-in demo)
            "target=strategy",
            f"source.checkpoints={src}",
            f"source.strategy={src_strategy}",
            f"target.strategy={dst_strategy}",
            f"output.dir={out}",
            f"job.workers={workers}",
            # one lineage database for the whole benchmark, as a user has one
            f"lineage.url=sqlite:///{os.path.join(os.path.dirname(scratch), lineage_name)}",
            f"hydra.run.dir={os.path.join(scratch, 'hydra')}",
        ]
    return [python, os.path.join(HERE, "convert_api.py"), src, out, src_strategy, dst_strategy,
            "--workers", str(workers)]


def mindspore_available(python: str) -> tuple[bool, str]:
    try:
        p = subprocess.run([python, "-c", "import mindspore; print(mindspore.__version__)"],
                           capture_output=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, str(e)
    if p.returncode != 0:
        return False, (p.stderr.decode(errors="replace").strip().splitlines() or ["import failed"])[-1]
    return True, p.stdout.decode().strip()


# ===================================================================================== verifying


def _sample_names(d: gen.ModelDims) -> set[str]:
    base = {"embedding_table", "head.weight", "final_ln.gamma", "final_ln.beta"}
    first_stage1 = (d.layers + 1) // 2
    for i in sorted({0, first_stage1 - 1, first_stage1, d.layers - 1}):
        base |= {p.name for p in gen.model_params(d) if p.name.startswith(f"layers.{i}.")}
    return base | {f"{m}.{n}" for m in ("adam_m", "adam_v") for n in base}


def verify_output(out_dir: str, meta: dict, n_target: int, mode: str = "sample") -> dict:
    """Check every target file: entry names, dtypes, shapes; the bytes of all (full) or a sample of
    parameters (first/last layer of each pipeline stage, embedding, head, final norm, their adam
    states) against the generator's pattern for the target layout; the scalar entries."""
    from reshard_job.formats.ckpt import CheckpointReader

    d = gen.ModelDims(**meta["dims"])
    mesh = gen.TARGETS[n_target]
    params = gen.all_params(d)
    sample = None if mode == "full" else _sample_names(d)
    want_names = {p.name for p in params} | {name for name, *_ in gen.scalar_entries()}
    t0 = time.perf_counter()
    checked_bytes = 0
    problems: list[str] = []
    for t in range(n_target):
        path = os.path.join(out_dir, f"rank_{t}", f"checkpoint_{t}.ckpt")
        if not os.path.isfile(path):
            problems.append(f"missing {path}")
            continue
        with CheckpointReader(path) as r:
            names = set(r.entries)
            if names != want_names:
                problems.append(f"rank {t}: missing {sorted(want_names - names)[:5]}, "
                                f"unexpected {sorted(names - want_names)[:5]}")
            for name, dt, dims, arr in gen.scalar_entries():
                if name in r.entries:
                    got = r.read(name)
                    if r[name].dtype != dt or got.tobytes() != arr.tobytes():
                        problems.append(f"rank {t}: {name} = {got!r} ({r[name].dtype}), expected {arr!r}")
            for p in params:
                if p.name not in r.entries:
                    continue
                e = r[p.name]
                box = gen.megatron_box(mesh, p, t)
                shape = tuple(b - a for a, b in box)
                if e.dtype != d.ms_dtype or tuple(e.shape) != shape:
                    problems.append(f"rank {t}: {p.name} is {e.dtype}{list(e.shape)}, expected {d.ms_dtype}{list(shape)}")
                    continue
                if sample is not None and p.name not in sample:
                    continue
                # compare in row blocks so that the check's memory stays small
                rows = shape[0]
                row_elems = int(np.prod(shape[1:])) if len(shape) > 1 else 1
                step = max(1, gen.GEN_CHUNK_ELEMS // max(1, row_elems))
                for lo in range(0, rows, step):
                    hi = min(rows, lo + step)
                    local = ((lo, hi),) + tuple((0, n) for n in shape[1:])
                    glob = ((box[0][0] + lo, box[0][0] + hi),) + box[1:]
                    got = r.read_box(p.name, local)
                    exp = gen.expected_box(p.name, p.shape, glob, d.itemsize)
                    checked_bytes += exp.nbytes
                    if got.view(exp.dtype).tobytes() != exp.tobytes():
                        problems.append(f"rank {t}: {p.name} rows {glob[0]} differ from the expected content")
                        break
    return {
        "ok": not problems,
        "mode": mode,
        "checked_bytes": checked_bytes,
        "seconds": round(time.perf_counter() - t0, 2),
        "problems": problems[:20],
    }


# ======================================================================================= running


def _parse_list(text: str, kind=str) -> list:
    return [kind(x) for x in text.split(",") if x.strip()]


def median(xs):
    return statistics.median(xs) if xs else None


def summarize(rec: dict) -> dict:
    walls = [r["wall_s"] for r in rec["runs"]]
    rss = [r["peak_rss_mib"] for r in rec["runs"]]
    out = dict(rec)
    out["median_wall_s"] = median(walls)
    out["min_wall_s"] = min(walls) if walls else None
    out["max_wall_s"] = max(walls) if walls else None
    out["median_peak_rss_mib"] = median(rss)
    out["median_cpu_s"] = median([r["user_s"] + r["sys_s"] for r in rec["runs"]])
    out["max_peak_rss_mib"] = max(rss) if rss else None
    written = median([r.get("output_bytes") or 0 for r in rec["runs"]])
    out["cpu_s_per_gb"] = out["median_cpu_s"] / (written / 1e9) if written else None
    out["gb_per_s"] = rec["source_bytes"] / 1e9 / out["median_wall_s"] if walls else None
    return out


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, cwd=REPO, timeout=30,
                              text=True).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def machine_info() -> dict:
    mem = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem = round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    cpu = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:
        pass
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu,
        "mem_gib": mem,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--sizes", default="0.5,1,2", help="model sizes in GB (1e9 bytes), comma list")
    ap.add_argument("--dtypes", default="float16",
                    help="comma list of float16, bfloat16, float32; DTYPE@S1+S2 limits a dtype to those sizes "
                         "(e.g. float16,bfloat16@2 runs bfloat16 at 2 GB only)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    ap.add_argument("--runs", type=int, default=3, help="timed runs of each command (medians are reported)")
    ap.add_argument("--workers", default="1", help="comma list of worker counts, e.g. 1,2")
    ap.add_argument("--via", choices=("job", "api"), default=None,
                    help="how our conversion is invoked (default: job if `python -m reshard_job` works, else api)")
    ap.add_argument("--keep-data", action="store_true", help="keep generated sources under --data-dir afterwards")
    ap.add_argument("--data-dir", default=os.path.join(HERE, "data"))
    ap.add_argument("--results-dir", default=os.path.join(HERE, "results"))
    ap.add_argument("--verify", choices=("sample", "full", "none"), default="sample",
                    help="how much of each case's output to check against the known content (once per case)")
    ap.add_argument("--no-fixed-costs", action="store_true",
                    help="skip timing `job.mode=plan` and a no-op rerun of a completed job (first case, first "
                         "workers value; `--via job` only)")
    ap.add_argument("--previous-repo", default=None,
                    help="also time the job from this source tree (e.g. a `git worktree` of an earlier commit), "
                         "to give the cost of a change in the same run")
    ap.add_argument("--no-fsync-baseline", action="store_true", help="skip the `cp -r && sync` baseline")
    ap.add_argument("--mindspore-python", default=os.environ.get("MINDSPORE_PYTHON"),
                    help="a Python that can `import mindspore` (own venv, numpy<2): also time MindSpore")
    ap.add_argument("--python", default=sys.executable, help="interpreter for our conversion")
    ap.add_argument("--cold-cache", action="store_true",
                    help="empty the job's source-digest cache before every run (every run hashes its sources)")
    ap.add_argument("--prefault-gb", type=float, default=0.0,
                    help="touch this much memory once before measuring (see README: first-touch cost in VMs)")
    ap.add_argument("--gen-jobs", type=int, default=None, help="processes used to generate sources")
    ap.add_argument("--render", metavar="RESULTS_JSON",
                    help="only re-render <stamp>.md, latest.md and scaling.png from an existing results JSON")
    a = ap.parse_args(argv)
    if a.render:
        return render_files(a.render, a.results_dir)

    sizes = _parse_list(a.sizes, float)
    dtype_sizes: dict[str, list[float]] = {}
    for spec in _parse_list(a.dtypes):
        name, _, only = spec.partition("@")
        dtype_sizes[name] = [float(x) for x in only.split("+")] if only else sizes
    dtypes = list(dtype_sizes)
    cases = _parse_list(a.cases)
    workers_list = _parse_list(a.workers, int)
    for c in cases:
        if c not in CASES:
            ap.error(f"unknown case {c!r}; choose from {', '.join(CASES)}")
    for dt in dtypes:
        if dt not in gen.DTYPES:
            ap.error(f"unknown dtype {dt!r}")
    notes: list[str] = []

    via = a.via
    ok, why = job_available(a.python)
    if via is None:
        via = "job" if ok else "api"
        if not ok:
            notes.append(f"`python -m reshard_job` is not usable ({why}); timed through the Python API instead.")
            log(f"[note] {notes[-1]}")
    elif via == "job" and not ok:
        log(f"[error] --via job: {why}")
        return 2

    ms_python = None
    if a.mindspore_python:
        ok_ms, ms_info = mindspore_available(a.mindspore_python)
        if ok_ms:
            ms_python = a.mindspore_python
            log(f"[mindspore] {ms_python}: MindSpore {ms_info}")
        else:
            notes.append(f"MindSpore not timed: {a.mindspore_python} cannot import mindspore ({ms_info}).")
            log(f"[note] {notes[-1]}")

    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    os.makedirs(a.results_dir, exist_ok=True)
    scratch_root = os.path.join(a.data_dir, "_work", stamp)
    os.makedirs(scratch_root, exist_ok=True)
    log_path = os.path.join(scratch_root, "children.log")
    env = dict(os.environ)
    # as a user runs it: with cached bytecode (a PYTHONDONTWRITEBYTECODE left in the shell would
    # recompile every module on every run and add a fixed cost no install has)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # The job's source-digest cache lives in the benchmark's scratch (not the user's cache): the
    # first run of every source hashes it, later runs reuse the digests as a user's reruns would;
    # --cold-cache empties it before every run.
    digest_cache = os.path.join(scratch_root, "digest-cache")
    env["RESHARD_JOB_CACHE_DIR"] = digest_cache
    previous, previous_env = None, None
    if a.previous_repo:
        prev_repo = os.path.abspath(a.previous_repo)
        previous = subprocess.run(["git", "-C", prev_repo, "rev-parse", "--short", "HEAD"], capture_output=True,
                                  text=True).stdout.strip() or os.path.basename(prev_repo)
        # its own digest cache and lineage database: an earlier version may lay them out differently
        previous_env = dict(env, PYTHONPATH=prev_repo,
                            RESHARD_JOB_CACHE_DIR=os.path.join(scratch_root, "digest-cache-previous"))

    result = {
        "timestamp": stamp,
        "cold_cache": bool(a.cold_cache),
        "command": shlex.join(["python", os.path.relpath(os.path.abspath(__file__), REPO)] + sys.argv[1:]),
        "argv": sys.argv,
        "via": via,
        "git_commit": git_commit(),
        "machine": machine_info(),
        "notes": notes,
        "measurements": [],
        "verifications": [],
    }
    if a.prefault_gb > 0:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import numpy as np, sys; "
                        "a = np.ones(int(float(sys.argv[1]) * 2**30), dtype=np.uint8)", str(a.prefault_gb)], check=True)
        notes.append(f"{a.prefault_gb:g} GiB of memory touched once before measuring ({time.perf_counter() - t0:.1f} s).")
        log(f"[note] {notes[-1]}")
    generated: list[str] = []
    failed = False
    measurements = result["measurements"]

    def record(key: dict, res: dict, source_bytes: int) -> dict:
        for m in measurements:
            if all(m.get(k) == v for k, v in key.items()):
                m["runs"].append(res)
                return m
        m = dict(key, source_bytes=source_bytes, runs=[res])
        measurements.append(m)
        return m

    try:
        for dtype in dtypes:
            for size in dtype_sizes[dtype]:
                data = gen.data_dir_for(a.data_dir, size, dtype)
                needed = sorted({CASES[c][0] for c in cases})
                existed = os.path.exists(os.path.join(data, "meta.json"))
                meta = gen.generate(data, size, dtype, sources=needed, jobs=a.gen_jobs, log=log)
                if not existed:
                    generated.append(data)
                strategies = meta["strategies"]
                src_bytes = {s: meta["sources"][s]["bytes"] for s in needed}
                base = {"size_gb": size, "dtype": dtype, "model_bytes": meta["model_bytes"]}
                verified: set = set()
                for run_i in range(a.runs):
                    for s in needed:
                        src = os.path.join(data, s)
                        tools = [("cp -r", ["cp", "-r"])]
                        if not a.no_fsync_baseline:
                            tools.append((DURABLE_COPY, None))
                        for tool, _ in tools:
                            out = os.path.join(scratch_root, "out")
                            rm(out)
                            if tool == "cp -r":
                                cmd = ["cp", "-r", src, out]
                            else:
                                cmd = ["sh", "-c", 'cp -r "$0" "$1" && sync', src, out]
                            warm(src)
                            res = run_timed(cmd, log_path)
                            rm(out)
                            settle()
                            if res["rc"] != 0:
                                failed = True
                                raise RuntimeError(f"{tool} failed (rc {res['rc']}): {log_tail(log_path)}")
                            res["output_bytes"] = src_bytes[s]
                            record(dict(base, case=f"copy:{s}", source=s, tool=tool, workers=1), res, src_bytes[s])
                            log(f"[{size:g} GB {dtype}] run {run_i + 1}/{a.runs} {tool:<14} {s:<7} "
                                f"{res['wall_s']:7.2f} s  peak RSS {res['peak_rss_mib']:7.1f} MiB")
                    for case in cases:
                        s, n_target, _desc = CASES[case]
                        src = os.path.join(data, s)
                        src_strategy = strategies[s]
                        dst_strategy = strategies[f"dst_{n_target}"]
                        runners = [("reshard_job", w) for w in workers_list]
                        if previous:
                            runners += [("previous", w) for w in workers_list]
                        if ms_python and case in MINDSPORE_CASES:
                            runners.append(("mindspore", 1))
                        for tool, w in runners:
                            out = os.path.join(scratch_root, "out")
                            scratch = os.path.join(scratch_root, "scratch")
                            rm(out)
                            rm(scratch)
                            os.makedirs(scratch)
                            if tool == "mindspore":
                                cmd = [ms_python, os.path.join(HERE, "convert_mindspore.py"), src, out,
                                       src_strategy, dst_strategy]
                                run_env = None
                            elif tool == "previous":
                                cmd = ours_command(via, a.python, src, src_strategy, dst_strategy, out, w, scratch,
                                                   lineage_name="lineage-previous.db")
                                run_env = previous_env
                            else:
                                cmd = ours_command(via, a.python, src, src_strategy, dst_strategy, out, w, scratch)
                                run_env = env
                            if a.cold_cache:
                                rm(digest_cache)
                            warm(src)
                            res = run_timed(cmd, log_path, cwd=scratch, env=run_env)
                            label = (f"{tool} ({via})" if tool == "reshard_job" else
                                     f"reshard_job ({via}, previous {previous})" if tool == "previous" else tool)
                            if res["rc"] != 0:
                                log(f"[error] {label} {case} workers={w} failed (rc {res['rc']}); see {log_path}:\n"
                                    + log_tail(log_path))
                                failed = True
                                res["failed"] = True
                            key = dict(base, case=case, source=s, tool=label, workers=w)
                            m = record(key, res, src_bytes[s])
                            res["output_bytes"] = gen.dir_bytes(out) if res["rc"] == 0 else 0
                            vkey = (case, tool, w)
                            if res["rc"] == 0 and tool == "reshard_job" and a.verify != "none" and vkey not in verified:
                                v = verify_output(out, meta, n_target, a.verify)
                                verified.add(vkey)
                                m["verified"] = v
                                result["verifications"].append(dict(key, **v))
                                if not v["ok"]:
                                    failed = True
                                    log(f"[WRONG OUTPUT] {case} workers={w}: {v['problems'][:3]}")
                                else:
                                    log(f"[verify] {case} workers={w}: ok ({v['mode']}, "
                                        f"{v['checked_bytes'] / 1e6:.0f} MB compared in {v['seconds']} s)")
                            if (via == "job" and not a.no_fixed_costs and tool != "mindspore" and res["rc"] == 0
                                    and case == cases[0] and w == workers_list[0]):
                                failed |= time_fixed_costs(cmd, out, log_path, scratch, run_env, dict(key), record,
                                                           src_bytes[s], f"[{size:g} GB {dtype}] run {run_i + 1}/{a.runs}")
                            rm(out)
                            rm(scratch)
                            settle()
                            log(f"[{size:g} GB {dtype}] run {run_i + 1}/{a.runs} {case:<9} {label} w={w} "
                                f"{res['wall_s']:7.2f} s  peak RSS {res['peak_rss_mib']:7.1f} MiB"
                                f"{'  FAILED' if res['rc'] else ''}")
                if not a.keep_data and data in generated:
                    shutil.rmtree(data, ignore_errors=True)
    finally:
        result["measurements"] = [summarize(m) for m in measurements]
        add_ratios(result)
        json_path = os.path.join(a.results_dir, f"{stamp}.json")
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2, sort_keys=True)
        md = render_markdown(result)
        for name in (f"{stamp}.md", "latest.md"):
            with open(os.path.join(a.results_dir, name), "w") as f:
                f.write(md)
        png = plot_scaling(result, os.path.join(a.results_dir, "scaling.png"))
        log(md)
        log(f"[results] {json_path}, {os.path.join(a.results_dir, 'latest.md')}" + (f", {png}" if png else ""))
        if failed:
            log(f"[results] child output kept in {log_path}")
        else:
            shutil.rmtree(scratch_root, ignore_errors=True)
        try:
            os.rmdir(os.path.join(a.data_dir, "_work"))
        except OSError:
            pass
    return 1 if failed else 0


FIXED_COST_KINDS = {"plan": "job.mode=plan", "noop": "no-op rerun"}  # case prefix -> what is timed


def time_fixed_costs(cmd: list[str], out: str, log_path: str, scratch: str, env, key: dict, record,
                     source_bytes: int, prefix: str) -> bool:
    """Time the job's fixed costs on the case just converted (its output still in place):
    ``job.mode=plan`` (index, plan, report; writes nothing but plan.json) and a rerun of the same
    command, which finds the output complete, verifies it and records a no-op run. True if one failed."""
    failed = False
    manifest = os.path.join(out, "manifest.json")
    before = os.stat(manifest).st_mtime_ns if os.path.exists(manifest) else None
    for kind, extra in (("plan", ["job.mode=plan"]), ("noop", [])):
        res = run_timed(cmd + extra, log_path, cwd=scratch, env=env)
        res["output_bytes"] = 0
        if res["rc"] != 0:
            failed = True
            res["failed"] = True
            log(f"[error] {FIXED_COST_KINDS[kind]} failed (rc {res['rc']}); see {log_path}:\n" + log_tail(log_path))
        elif kind == "noop" and (before is None or os.stat(manifest).st_mtime_ns != before):
            failed = True  # a rerun that rewrote the output was not a no-op
            res["failed"] = True
            log(f"[error] the rerun rewrote {manifest}: not a no-op")
        record(dict(key, case=f"{kind}:{key['case']}"), res, source_bytes)
        log(f"{prefix} {FIXED_COST_KINDS[kind]:<15} {key['tool']} {res['wall_s']:7.2f} s  "
            f"CPU {res['user_s'] + res['sys_s']:.2f} s")
    return failed


# ====================================================================================== reporting


def render_files(json_path: str, results_dir: str) -> int:
    with open(json_path) as f:
        result = json.load(f)
    result["measurements"] = [summarize(m) for m in result["measurements"]]
    add_ratios(result)
    md = render_markdown(result)
    for name in (f"{result['timestamp']}.md", "latest.md"):
        with open(os.path.join(results_dir, name), "w") as f:
            f.write(md)
    plot_scaling(result, os.path.join(results_dir, "scaling.png"))
    log(md)
    return 0


def _find(ms: list[dict], **key) -> dict | None:
    for m in ms:
        if all(m.get(k) == v for k, v in key.items()):
            return m
    return None


def add_ratios(result: dict) -> None:
    ms = result["measurements"]
    for m in ms:
        if m["case"].startswith("copy:") or _fixed_cost(m):
            continue
        for tool, field in (("cp -r", "ratio_to_cp"), (DURABLE_COPY, "ratio_to_cp_fsync")):
            cp = _find(ms, case=f"copy:{m['source']}", tool=tool, size_gb=m["size_gb"], dtype=m["dtype"])
            if cp and cp["median_wall_s"] and m["median_wall_s"]:
                m[field] = m["median_wall_s"] / cp["median_wall_s"]


def _fixed_cost(m: dict) -> str | None:
    """'plan' or 'noop' for a fixed-cost measurement, else None."""
    kind = m["case"].split(":", 1)[0]
    return kind if kind in FIXED_COST_KINDS else None


def _fmt(x, spec=".2f", none="–"):
    return none if x is None else format(x, spec)


def render_markdown(result: dict) -> str:
    mach = result["machine"]
    ms = result["measurements"]
    lines = [
        f"# reshard_job benchmark — {result['timestamp']}",
        "",
        f"- command: `{result['command']}`",
        f"- conversion invoked via: **{result['via']}**"
        + (" (`python -m reshard_job …`)" if result["via"] == "job" else " (`benchmarks/convert_api.py` → `transform_checkpoints`)"),
        f"- machine: {mach['cpu_count']} cores (os.cpu_count()), {mach['cpu_model']}, {mach['mem_gib']} GiB RAM, "
        f"{mach['platform']}, Python {mach['python']}, numpy {mach['numpy']}",
        f"- git commit: `{result['git_commit']}`",
        "- warm page cache (source read once before every timed command); outputs deleted and `sync` after each run;"
        " medians over the runs; ratios against `cp -r` and against a durable copy (`cp -r && sync`) of the same"
        " source, measured in the same invocation; CPU s/GB = user + sys of the process tree per GB written.",
        ("- the job's source-digest cache was emptied before every run: every run hashed its sources"
         if result.get("cold_cache") else
         "- the job hashes a source on its first run and reuses the digests of unchanged files afterwards"
         " (`job.hash_cache`); the medians are such reruns (`--cold-cache` times first runs)")
        if result["via"] == "job" else "- the API path does not hash its sources",
    ]
    loads = [r.get("loadavg_1min_before") for m in ms for r in m["runs"] if r.get("loadavg_1min_before") is not None]
    if loads:
        lines.append(f"- machine load (1-min load average before each timed command): median {statistics.median(loads):.1f}, "
                     f"range {min(loads):.1f}–{max(loads):.1f} on {mach['cpu_count']} cores; CPU s = user + sys of the command's process tree")
    for n in result["notes"]:
        lines.append(f"- note: {n}")
    lines += [
        "",
        "| size GB | dtype | case | tool | workers | runs | median s | min–max s | CPU s | CPU s/GB | source GB/s | peak RSS MiB median (max) | × cp -r | × cp -r && sync | output check |",
        "|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    fixed = [m for m in ms if _fixed_cost(m)]
    ms = [m for m in ms if not _fixed_cost(m)]
    order = {c: i for i, c in enumerate(["copy:src", "copy:src_pp", *CASES])}
    dtype_order = {d: i for i, d in enumerate(dict.fromkeys(m["dtype"] for m in ms))}
    for m in sorted(ms, key=lambda m: (dtype_order[m["dtype"]], m["size_gb"], order.get(m["case"], 99), m["tool"], m["workers"])):
        v = m.get("verified")
        check = "–" if v is None else (f"ok ({v['mode']})" if v["ok"] else "**WRONG**")
        if any(r.get("failed") for r in m["runs"]):
            check = "**FAILED**"
        case = m["case"].replace("copy:", "copy of ")
        lines.append(
            f"| {m['size_gb']:g} | {m['dtype']} | {case} | {m['tool']} | {m['workers']} | {len(m['runs'])} | "
            f"{_fmt(m['median_wall_s'])} | {_fmt(m['min_wall_s'])}–{_fmt(m['max_wall_s'])} | {_fmt(m.get('median_cpu_s'))} | "
            f"{_fmt(m.get('cpu_s_per_gb'))} | {_fmt(m['gb_per_s'])} | "
            f"{_fmt(m['median_peak_rss_mib'], '.0f')} ({_fmt(m['max_peak_rss_mib'], '.0f')}) | {_fmt(m.get('ratio_to_cp'))} | {_fmt(m.get('ratio_to_cp_fsync'))} | {check} |"
        )
    if fixed:
        lines += ["", "Fixed costs (on the first case's source, right after its conversion; a no-op rerun finds the "
                  "output complete, verifies its files against the journal and records a no-op run in the lineage "
                  "database):", "",
                  "| size GB | dtype | what | case | tool | workers | runs | median s | min–max s | CPU s | peak RSS MiB |",
                  "|---:|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
        kinds = list(FIXED_COST_KINDS)
        for m in sorted(fixed, key=lambda m: (m["size_gb"], m["dtype"], kinds.index(_fixed_cost(m)), m["tool"])):
            kind, case = m["case"].split(":", 1)
            bad = " **FAILED**" if any(r.get("failed") for r in m["runs"]) else ""
            lines.append(f"| {m['size_gb']:g} | {m['dtype']} | {FIXED_COST_KINDS[kind]}{bad} | {case} | {m['tool']} | "
                         f"{m['workers']} | {len(m['runs'])} | {_fmt(m['median_wall_s'])} | {_fmt(m['min_wall_s'])}–"
                         f"{_fmt(m['max_wall_s'])} | {_fmt(m.get('median_cpu_s'))} | {_fmt(m['median_peak_rss_mib'], '.0f')} |")
    lines += ["", "## Against the targets", ""]
    lines += target_lines(ms) + fixed_cost_lines(fixed)
    lines += ["", "MindSpore 2.10 `transform_checkpoints` reference (from the issue, same machine kind, not measured here):", ""]
    lines += ["| case | dtype | size GB | wall s | peak RSS MiB | ours (this run, closest size, workers 1) |", "|---|---|---:|---:|---:|---|"]
    for case, dtype, size, wall, rss in MINDSPORE_REFERENCE:
        ours = _closest(ms, case, dtype, size, 1)
        txt = "–" if not ours else (f"{ours['median_wall_s']:.2f} s, {ours['median_peak_rss_mib']:.0f} MiB (max {ours['max_peak_rss_mib']:.0f}) at {ours['size_gb']:g} GB"
                                    f" ({wall / ours['median_wall_s'] * ours['size_gb'] / size:.1f}× faster per byte)")
        lines.append(f"| {case} | {dtype} | {size} | {wall} | {rss:.0f} | {txt} |")
    return "\n".join(lines) + "\n"


def _ours(ms):
    return [m for m in ms if m["tool"].startswith("reshard_job") and "previous" not in m["tool"]]


def _previous(ms):
    return [m for m in ms if "previous" in m["tool"]]


def _closest(ms, case, dtype, size, workers):
    cands = [m for m in _ours(ms) if m["case"] == case and m["dtype"] == dtype and m["workers"] == workers and m["median_wall_s"]]
    return min(cands, key=lambda m: abs(m["size_gb"] - size)) if cands else None


# (case, size GB, wall as a multiple of the durable copy): the performance issue's targets
WALL_TARGETS = (("8to4", 2.07, 1.5), ("8to16", 2.07, 1.5), ("8to4", 16, 1.1))


def target_lines(ms) -> list[str]:
    out = []
    for case, size, limit in WALL_TARGETS:
        for w in sorted({m["workers"] for m in _ours(ms)}):
            m = _find(_ours(ms), case=case, dtype="float16", size_gb=size, workers=w)
            if m and m.get("ratio_to_cp_fsync"):
                ok = "met" if m["ratio_to_cp_fsync"] <= limit else "NOT met"
                out.append(f"- {case.replace('to', '→')} wall ≤ {limit} × `cp -r && sync` (fp16, {size:g} GB, workers {w}): "
                           f"{m['ratio_to_cp_fsync']:.2f}× — **{ok}** (against plain `cp -r`: {_fmt(m.get('ratio_to_cp'))}×)")
    for m in _ours(ms):
        if m["case"] in ("8to4", "8to16") and m.get("cpu_s_per_gb"):
            ok = "met" if m["cpu_s_per_gb"] <= 1.0 else "NOT met"
            out.append(f"- CPU ≤ 1.0 s per GB written ({m['case']}, {m['size_gb']:g} GB {m['dtype']}, workers {m['workers']}): "
                       f"{m['cpu_s_per_gb']:.2f} — **{ok}**")
    for m in _ours(ms):
        p = next((p for p in _previous(ms) if all(p[k] == m[k] for k in ("case", "dtype", "size_gb", "workers"))), None)
        if p and p["median_wall_s"] and m["median_wall_s"]:
            out.append(f"- against {p['tool']} ({m['case']}, {m['size_gb']:g} GB {m['dtype']}, workers {m['workers']}): "
                       f"wall {m['median_wall_s']:.2f} s vs {p['median_wall_s']:.2f} s "
                       f"({m['median_wall_s'] / p['median_wall_s']:.2f}×), CPU {_fmt(m.get('median_cpu_s'))} s vs "
                       f"{_fmt(p.get('median_cpu_s'))} s, peak RSS {m['median_peak_rss_mib']:.0f} vs "
                       f"{p['median_peak_rss_mib']:.0f} MiB")
    big = [m for m in _ours(ms) if m["size_gb"] >= 16]
    if big:
        peak = max(big, key=lambda m: m["max_peak_rss_mib"] or 0)
        ok = "met" if peak["max_peak_rss_mib"] <= 512 else "NOT met"
        out.append(f"- peak RSS of the process tree ≤ 512 MiB at {peak['size_gb']:g} GB: max {peak['max_peak_rss_mib']:.0f} MiB "
                   f"({peak['case']}, workers {peak['workers']}) — **{ok}**")
    ours = _ours(ms)
    if ours:
        peak = max(ours, key=lambda m: m["max_peak_rss_mib"] or 0)
        ok = "met" if peak["max_peak_rss_mib"] <= 512 else "NOT met"
        out.append(f"- peak RSS ≤ 512 MiB: max {peak['max_peak_rss_mib']:.0f} MiB ({peak['case']}, {peak['size_gb']:g} GB "
                   f"{peak['dtype']}, workers {peak['workers']}) — **{ok}**")
    for case in CASES:
        for dtype in ("float16", "bfloat16", "float32"):
            for w in sorted({m["workers"] for m in ours}):
                # Judged on the medians over runs, like the times; the growth of the per-run
                # maxima is printed too, so a one-off high first run stays visible.
                pts = sorted((m["size_gb"], m["median_peak_rss_mib"], m["max_peak_rss_mib"]) for m in ours
                             if m["case"] == case and m["dtype"] == dtype and m["workers"] == w and m["size_gb"] >= 1)
                if len(pts) >= 2 and pts[-1][0] > pts[0][0]:
                    growth = pts[-1][1] - pts[0][1]
                    ok = "met" if growth < 64 else "NOT met"
                    out.append(f"- peak RSS growth {pts[0][0]:g} → {pts[-1][0]:g} GB ({case}, {dtype}, workers {w}): "
                               f"{growth:+.0f} MiB between medians ({pts[0][1]:.0f} → {pts[-1][1]:.0f}; maxima "
                               f"{pts[0][2]:.0f} → {pts[-1][2]:.0f}, {pts[-1][2] - pts[0][2]:+.0f}) — **{ok}** "
                               f"(target < 64 MiB from 1 to 4 GB)")
    for case in CASES:
        for dtype in ("float16", "bfloat16", "float32"):
            for size in sorted({m["size_gb"] for m in ours}):
                w1 = _find(ours, case=case, dtype=dtype, size_gb=size, workers=1)
                w2 = _find(ours, case=case, dtype=dtype, size_gb=size, workers=2)
                if w1 and w2 and w1["median_wall_s"] and w2["median_wall_s"]:
                    sp = w1["median_wall_s"] / w2["median_wall_s"]
                    ok = "faster" if w2["max_wall_s"] < w1["min_wall_s"] else "not measurably faster (ranges overlap)"
                    out.append(f"- workers 2 vs 1 ({case}, {size:g} GB {dtype}): {sp:.2f}× — {ok}")
    for case in CASES:
        for size in sorted({m["size_gb"] for m in ours}):
            for w in sorted({m["workers"] for m in ours}):
                f16 = _find(ours, case=case, dtype="float16", size_gb=size, workers=w)
                b16 = _find(ours, case=case, dtype="bfloat16", size_gb=size, workers=w)
                if f16 and b16 and f16["gb_per_s"] and b16["gb_per_s"]:
                    out.append(f"- bfloat16 time per byte / float16 time per byte ({case}, {size:g} GB, workers {w}): "
                               f"{f16['gb_per_s'] / b16['gb_per_s']:.2f} (1.00 = same cost)")
    return out or ["- (not enough measurements for the target checks)"]


FIXED_COST_TARGETS = {"plan": 0.5, "noop": 0.7}  # seconds, the issue's targets on the 2 GB case


def fixed_cost_lines(fixed: list[dict]) -> list[str]:
    out = []
    for m in _ours(fixed):
        kind = _fixed_cost(m)
        limit = FIXED_COST_TARGETS[kind]
        if m["median_wall_s"]:
            ok = "met" if m["median_wall_s"] <= limit else "NOT met"
            out.append(f"- {FIXED_COST_KINDS[kind]} ≤ {limit} s ({m['case'].split(':', 1)[1]}, {m['size_gb']:g} GB "
                       f"{m['dtype']}): {m['median_wall_s']:.2f} s — **{ok}**")
        p = next((p for p in _previous(fixed) if all(p[k] == m[k] for k in ("case", "dtype", "size_gb", "workers"))),
                 None)
        if p and p["median_wall_s"] and m["median_wall_s"]:
            out.append(f"  - against {p['tool']}: {m['median_wall_s']:.2f} s vs {p['median_wall_s']:.2f} s")
    return out


def plot_scaling(result: dict, path: str) -> str | None:
    ms = result["measurements"]
    sizes = sorted({m["size_gb"] for m in ms})
    if not ms:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    dtype = "float16" if any(m["dtype"] == "float16" for m in ms) else ms[0]["dtype"]
    fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(12, 4.8))
    series = {}
    ms = [m for m in ms if not _fixed_cost(m)]
    for m in ms:
        if m["dtype"] != dtype or m["workers"] != min(mm["workers"] for mm in ms) or not m["median_wall_s"]:
            continue
        label = f"{m['case'].replace('copy:', 'copy ')} ({m['tool']})" if m["case"].startswith("copy:") else f"{m['case']} ({m['tool']})"
        series.setdefault(label, []).append((m["size_gb"], m["median_wall_s"], m["median_peak_rss_mib"], m["case"].startswith("copy:")))
    for label, pts in sorted(series.items()):
        pts.sort()
        xs = [p[0] for p in pts]
        style = "--" if pts[0][3] else "-"
        ax_t.plot(xs, [p[1] for p in pts], style, marker="o", label=label)
        if not pts[0][3]:
            ax_r.plot(xs, [p[2] for p in pts], style, marker="o", label=label)
    ax_t.set_xlabel("model size (GB, weights + adam states)")
    ax_t.set_ylabel("median wall time (s)")
    ax_t.set_title(f"Time vs model size ({dtype}, warm cache)")
    ax_t.grid(alpha=0.3)
    ax_t.legend(fontsize=7)
    ax_r.axhline(512, color="red", lw=0.8, ls=":", label="512 MiB target")
    ax_r.set_xlabel("model size (GB)")
    ax_r.set_ylabel("median peak RSS (MiB)")
    ax_r.set_title("Peak RSS vs model size")
    ax_r.set_ylim(bottom=0)
    ax_r.grid(alpha=0.3)
    ax_r.legend(fontsize=7)
    for ax in (ax_t, ax_r):
        ax.set_xticks(sizes)
    fig.suptitle(f"reshard_job ({result['via']}) vs cp -r — {result['machine']['cpu_count']} cores, {result['timestamp']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    sys.exit(main())
