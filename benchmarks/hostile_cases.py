"""Build hostile inputs and run the job on each as a user would: exit status, wall time, peak RSS.

    python benchmarks/hostile_cases.py [--only NAME ...] [--keep DIR]

Each case is built in a scratch folder from golden scenario S1 (8 -> 4 ranks) and run as
``python -m reshard_job ...`` in a child of ``benchmarks/measure_child.py`` (so the peak RSS is the
job's own, children included once they are waited for). Prints one row per case: name, exit
status, seconds, peak MiB and the first 160 characters of the job's error line (or "ok").
The bounds the project holds itself to: 10 s and 512 MiB for a refusal, 30 s and 512 MiB for the
300,000-parameter conversion, 512 MiB for the 600,000-parameter MindFormers save.
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
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
S1 = ROOT / "tests" / "golden" / "S1_mlp_tutorial_8to4"
CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def _s1(root: Path) -> tuple[Path, Path, Path]:
    ckpts = root / "ckpts"
    shutil.copytree(S1 / "src_checkpoints", ckpts)
    shutil.copy(S1 / "src_strategy.ckpt", root / "src.ckpt")
    shutil.copy(S1 / "dst_strategy.ckpt", root / "dst.ckpt")
    return ckpts, root / "src.ckpt", root / "dst.ckpt"


def _args(ckpts, src, dst, out, *extra) -> list[str]:
    return [f"source.checkpoints={ckpts}", f"source.strategy={src}", "target=strategy", f"target.strategy={dst}",
            f"output.dir={out}", "lineage.enabled=false", *extra]


def _append(path: Path, add) -> None:
    """Rewrite a .ckpt with its entries, then what `add(writer)` adds."""
    from reshard_job.formats.ckpt import CheckpointReader, CheckpointWriter

    with CheckpointReader(path) as r:
        items = [(n, r.read(n), r.entries[n].dtype) for n in r.names()]
    path.unlink()
    with CheckpointWriter(path, mode=0o644) as w:
        for name, array, dtype in items:
            w.add(name, array, dtype)
        add(w)


@case
def name_1mb_in_a_rank_file(root: Path) -> list[str]:
    ckpts, src, dst = _s1(root)
    _append(ckpts / "rank_3" / "checkpoint_3.ckpt", lambda w: w.add("p" * (1 << 20), np.zeros(2, np.float32)))
    return _args(ckpts, src, dst, root / "out")


@case
def name_1mb_in_every_rank_file(root: Path) -> list[str]:
    ckpts, src, dst = _s1(root)
    for r in range(8):
        _append(ckpts / f"rank_{r}" / f"checkpoint_{r}.ckpt",
                lambda w: w.add("p" * (1 << 20), np.zeros(2, np.float32)))
    return _args(ckpts, src, dst, root / "out", "target.unmapped=full")


@case
def million_chunk_records(root: Path) -> list[str]:
    ckpts, src, dst = _s1(root)
    data = np.arange(1_000_000, dtype=np.float32)
    for r in range(8):
        _append(ckpts / f"rank_{r}" / f"checkpoint_{r}.ckpt",
                lambda w: w.add_bytes("chunked", "Float32", (1_000_000,), data, chunk_sizes=[4] * 1_000_000))
    return _args(ckpts, src, dst, root / "out", "target.unmapped=full")


@case
def target_dev_matrix_1024x1024(root: Path) -> list[str]:
    from reshard_job.formats.strategy import read_strategy, write_strategy
    from reshard_job.core.strategy_model import ParamLayout, StrategyFile

    ckpts, src, dst = _s1(root)
    sf = read_strategy(dst)
    huge = {n: ParamLayout((1024, 1024), tuple(-1 for _ in lay.tensor_map)) for n, lay in sf.layouts.items()}
    dst.unlink()
    write_strategy(StrategyFile(huge, sf.items), dst, mode=0o644)
    return _args(ckpts, src, dst, root / "out")


@case
def params_300k_outside_the_source_strategy(root: Path, count: int = 300_000) -> list[str]:
    ckpts, src, dst = _s1(root)
    values = np.zeros(1, np.float32)
    names = [f"extra.p{i}" for i in range(count)]

    def add(w):
        for name in names:
            w.add(name, values)
    for r in range(8):
        _append(ckpts / f"rank_{r}" / f"checkpoint_{r}.ckpt", add)
    return _args(ckpts, src, dst, root / "out", "target.unmapped=full")


@case
def mindformers_600k_layoutless_params(root: Path, count: int = 600_000) -> list[str]:
    """A MindFormers save of 600,000 layout-less parameters (a 226 MB metadata.json, one file),
    converted to the default declarative target of one device: within 512 MiB."""
    for sub in ("tests", "tests/e2e/reliability", "tests/fuzz"):
        if str(ROOT / sub) not in sys.path:
            sys.path.insert(0, str(ROOT / sub))
    from test_hostile_sources import write_layoutless_save

    save = write_layoutless_save(root / "mf", count)
    return [f"source.checkpoints={save}", "target.devices=1", f"output.dir={root / 'out'}", "lineage.enabled=false"]



@case
def mindformers_600k_refused_at_its_last_storage_entry(root: Path) -> list[str]:
    """The 600,000-parameter save whose last storage_data entry names a rank outside its group."""
    args = mindformers_600k_layoutless_params(root)
    meta = next((root / "mf").rglob("metadata.json"))
    data = meta.read_bytes()
    at = data.rindex(b'"storage_rank":0')
    meta.write_bytes(data[:at] + b'"storage_rank":7' + data[at + 16:])
    return args



@case
def strategy_padded_with_300mib_of_a_newer_field(root: Path) -> list[str]:
    from reshard_job.formats.wire import encode_varint

    ckpts, src, dst = _s1(root)
    with open(src, "ab") as f:
        f.write(bytes([(15 << 3) | 2]) + encode_varint(300 << 20))
        for _ in range(300):
            f.write(bytes(1 << 20))
    return _args(ckpts, src, dst, root / "out")


@case
def json_strategy_padded_with_300mib_of_spaces(root: Path) -> list[str]:
    from reshard_job.formats.strategy import read_strategy, to_json_bytes

    ckpts, src, dst = _s1(root)
    text = to_json_bytes(read_strategy(src))
    cut = text.rindex(b"}")
    src_json = root / "src.json"
    with open(src_json, "wb") as f:
        f.write(text[:cut])
        for _ in range(300):
            f.write(b" " * (1 << 20))
        f.write(text[cut:])
    return _args(ckpts, src_json, dst, root / "out")


@case
def lock_file_that_is_a_fifo(root: Path) -> list[str]:
    ckpts, src, dst = _s1(root)
    (root / "out" / ".reshard_job").mkdir(parents=True)
    os.mkfifo(root / "out" / ".reshard_job" / "lock")
    return _args(ckpts, src, dst, root / "out")


@case
def output_dir_of_100000_characters(root: Path) -> list[str]:
    ckpts, src, dst = _s1(root)
    return _args(ckpts, src, dst, root / ("a" * 100_000))


def _chain(root: Path, hops: int) -> tuple[str, Path, Path]:
    """A lineage database of `hops` successive conversions, each reading the last one's output."""
    from reshard_job.lineage import FileRecord, LineageStore

    def record(path: Path, kind: str) -> FileRecord:
        path.write_bytes(path.name.encode())
        return FileRecord.from_file(str(path), kind, 0)

    url = f"sqlite:///{root / 'chain.db'}"
    store = LineageStore(url)
    store.ensure_schema()
    files = [record(root / "hop_0.ckpt", "source_checkpoint")]
    for hop in range(1, hops + 1):
        run = store.start_run(config={}, overrides=[], tool_version="0", output_dir=str(root), source_devices=1,
                              target_devices=1)
        store.record_inputs(run, [files[-1]])
        files.append(record(root / f"hop_{hop}.ckpt", "target_checkpoint"))
        store.complete_run(run, outputs=[files[-1]], plan={"ranks": []})
    store.close()
    return url, root / "hop_0.ckpt", root / f"hop_{hops}.ckpt"


AUDIT = "reshard_job.audit"
TIMEOUT_S = 600  # a case still running then is reported as hung


@case
def audit_trace_of_1000_successive_conversions(root: Path) -> list[str]:
    url, first, last = _chain(root, 1000)
    return [AUDIT, "--db", url, "trace", str(last)]


@case
def audit_trace_json_of_2000_successive_conversions(root: Path) -> list[str]:
    url, first, last = _chain(root, 2000)
    return [AUDIT, "--db", url, "trace", str(last), "--json"]


@case
def audit_descendants_graph_of_1000_successive_conversions(root: Path) -> list[str]:
    url, first, last = _chain(root, 1000)
    return [AUDIT, "--db", url, "graph", str(first), "--descendants", "--format", "dot"]


def run(name: str, scratch: Path, attempt: int = 0) -> dict:
    root = scratch / (name if not attempt else f"{name}.{attempt}")
    root.mkdir(parents=True)
    args = CASES[name](root)
    module = "reshard_job"
    if args[0] == AUDIT:
        module, args = AUDIT, args[1:]
    result = root / "result.json"
    cmd = [sys.executable, "-S", str(ROOT / "benchmarks" / "measure_child.py"), str(result), "--",
           sys.executable, "-m", module, *args]
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "RESHARD_JOB_FULL_ERROR")}
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"name": name, "rc": "hung", "wall_s": float(TIMEOUT_S), "peak_mib": float("nan"),
                "line": f"(> {TIMEOUT_S} s)"}
    measured = json.loads(result.read_text())
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith("[")]
    if module == AUDIT and measured["rc"] == 0:
        lines = [f"ok, {len(proc.stdout.splitlines())} lines printed"]
    line = lines[0] if len(lines) == 1 else (f"{len(lines)} lines: " + " | ".join(lines[:3]) if lines else "ok")
    return {"name": name, "rc": measured["rc"], "wall_s": measured["wall_s"],
            "peak_mib": measured["maxrss_kib"] / 1024, "line": line}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--keep", type=Path, default=None)
    parser.add_argument("--runs", type=int, default=1,
                        help="runs of each case (fresh inputs each); seconds and MiB are then their medians, with "
                             "the range in brackets: a noisy machine's one run says little")
    opts = parser.parse_args()
    scratch = opts.keep or Path(tempfile.mkdtemp(prefix="hostile-"))
    try:
        print(f"{'case':45} {'exit':>4} {'s':>7} {'MiB':>6}  line  ({os.cpu_count()} cores)")
        for name in opts.only or CASES:
            runs = [run(name, scratch, i) for i in range(max(1, opts.runs))]
            print(_row(runs), flush=True)
    finally:
        if opts.keep is None:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0


def _row(runs: list[dict]) -> str:
    """One case's line: its exit statuses, the median seconds and MiB (and their range)."""
    r = runs[0]
    rc = r["rc"] if all(x["rc"] == r["rc"] for x in runs) else "/".join(str(x["rc"]) for x in runs)
    wall = statistics.median(x["wall_s"] for x in runs)
    peak = statistics.median(x["peak_mib"] for x in runs)
    line = f"{r['name']:45} {rc:>4} {wall:7.1f} {peak:6.0f}  {r['line'][:160]}"
    if len(runs) > 1:
        line += (f"  [{min(x['wall_s'] for x in runs):.1f}-{max(x['wall_s'] for x in runs):.1f} s, "
                 f"{min(x['peak_mib'] for x in runs):.0f}-{max(x['peak_mib'] for x in runs):.0f} MiB]")
    return line


if __name__ == "__main__":
    sys.exit(main())
