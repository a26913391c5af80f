"""Helpers for the reliability tests: running the job as users do, reading what it left behind.

The job runs in a subprocess (``python -m reshard_job``), as in ``tests/func``; a test then checks
the exit status, that stderr carries exactly one ``reshard_job: error: ...`` line, what is on disk
(no manifest, no partial file under a final name) and what the lineage database recorded. Source
trees are snapshotted (content hash, size, mtime) before and after every run that reads them.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from job_launcher import Launcher  # noqa: F401 (re-exported: the reliability and Ray tests import it from here)

TESTS = Path(__file__).parents[2]
GOLDEN = TESTS / "golden"
S1 = GOLDEN / "S1_mlp_tutorial_8to4"
S3 = GOLDEN / "S3_pipeline2x4opt_to_4"

# Hydra's job logging: "[2026-11-22 10:12:32,091][reshard_job][WARNING] - ..."
LOG_LINE = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+\]\[[^\]]*\]\[[A-Z]+\] - ")
ERROR_PREFIX = "reshard_job: error: "


# ================================================================================== running


def app_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "RESHARD_JOB_FULL_ERROR")}


def app_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "reshard_job", *args]


def run_app(cwd: Path, *args: str, timeout: int = 180, preexec_fn=None) -> subprocess.CompletedProcess:
    return subprocess.run(app_command(*args), cwd=cwd, env=app_env(), capture_output=True, text=True,
                          timeout=timeout, preexec_fn=preexec_fn)


def message_lines(stderr: str) -> list[str]:
    """stderr without the job's log lines (and without blank lines)."""
    return [ln for ln in stderr.splitlines() if ln.strip() and not LOG_LINE.match(ln)]


def log_lines(stderr: str, level: str | None = None) -> list[str]:
    return [ln for ln in stderr.splitlines() if LOG_LINE.match(ln) and (level is None or f"[{level}]" in ln)]


def the_error(res: subprocess.CompletedProcess) -> str:
    """The one error line of a failed run (without its prefix); fails unless there is exactly one."""
    assert res.returncode != 0, f"expected a failure, got exit 0\n{res.stdout}\n{res.stderr}"
    assert "Traceback" not in res.stderr, res.stderr
    lines = message_lines(res.stderr)
    assert len(lines) == 1, f"expected one error line, got:\n{res.stderr}"
    assert lines[0].startswith(ERROR_PREFIX), lines[0]
    return lines[0][len(ERROR_PREFIX):]


# ================================================================================== inspecting


@dataclass(frozen=True)
class FileState:
    sha256: str
    size: int
    mtime_ns: int
    mode: int


def snapshot(*roots: Path | str) -> dict[str, FileState]:
    """Content hash, size, mtime and mode of every file under the given files/directories."""
    out: dict[str, FileState] = {}
    for root in roots:
        root = Path(root)
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for p in files:
            st = p.stat()
            out[str(p)] = FileState(hashlib.sha256(p.read_bytes()).hexdigest(), st.st_size, st.st_mtime_ns, st.st_mode)
    return out


def lineage_runs(db: Path) -> list[dict]:
    if not db.exists():
        return []
    with sqlite3.connect(db) as con:
        con.row_factory = sqlite3.Row
        try:
            runs = [dict(r) for r in con.execute("select id, status, error, output_dir from runs order by started_at")]
        except sqlite3.OperationalError:  # no schema yet
            return []
        for r in runs:
            r["outputs"] = [tuple(e) for e in con.execute(
                "select role, rank, path from events where run_id = ? and direction = 'output' order by id", (r["id"],))]
    return runs


def assert_nothing_recorded(out_dir: Path, db: Path, message: str | None = None) -> None:
    """No manifest, no file under a final output name, no completed lineage run, no output events."""
    assert not (out_dir / "manifest.json").exists()
    finals = [p for p in out_dir.glob("rank_*/*") if p.is_file() and not p.name.startswith(".")]
    assert finals == [], finals
    temps = [p for p in out_dir.rglob(".*.tmp")] if out_dir.exists() else []
    assert temps == [], temps
    for run in lineage_runs(db):
        assert run["status"] != "completed", run
        assert run["outputs"] == [], run
        if message is not None and run["status"] == "failed":
            assert run["error"] == message, run


def tensors_sha256(path: Path) -> dict[str, str]:
    from reshard_job.formats.ckpt import CheckpointReader

    out = {}
    with CheckpointReader(path) as r:
        for name in r.names():
            h = hashlib.sha256()
            for block in r.iter_content(name):
                h.update(block)
            out[name] = h.hexdigest()
    return out


# ================================================================================== sources


def copy_s1(dst: Path) -> tuple[Path, Path, Path]:
    """A writable copy of golden scenario S1 (8 -> 4 ranks): (checkpoints, src strategy, dst strategy)."""
    dst.mkdir(parents=True, exist_ok=True)
    ckpts = dst / "ckpts"
    shutil.copytree(S1 / "src_checkpoints", ckpts)
    shutil.copy(S1 / "src_strategy.ckpt", dst / "src_strategy.ckpt")
    shutil.copy(S1 / "dst_strategy.ckpt", dst / "dst_strategy.ckpt")
    return ckpts, dst / "src_strategy.ckpt", dst / "dst_strategy.ckpt"


def s1_args(ckpts: Path, src: Path, dst: Path, out: Path) -> list[str]:
    return [f"source.checkpoints={ckpts}", f"source.strategy={src}", "target=strategy", f"target.strategy={dst}",
            f"output.dir={out}"]


def rewrite_ckpt(path: Path, *, drop: set[str] = frozenset(), change: dict | None = None) -> None:
    """Rewrite a `.ckpt` without some entries, or with some arrays changed by `change[name](array, dtype)`."""
    from reshard_job.formats.ckpt import CheckpointReader, CheckpointWriter

    with CheckpointReader(path) as r:
        items = [(n, r.read(n), r.entries[n].dtype) for n in r.names()]
    path.unlink()
    with CheckpointWriter(path, mode=0o644) as w:
        for name, array, dtype in items:
            if name in drop:
                continue
            if change and name in change:
                array, dtype = change[name](array, dtype)
            w.add(name, array, dtype)


@dataclass(frozen=True)
class BigSource:
    """A synthetic 2-rank source (column split) of `n_tensors` float32 [rows, cols] tensors, with a
    4-rank row-split target strategy: each target file needs both source files."""

    root: Path
    checkpoints: Path
    src_strategy: Path
    dst_strategy: Path

    def args(self, out: Path, *extra: str) -> list[str]:
        return [f"source.checkpoints={self.checkpoints}", f"source.strategy={self.src_strategy}", "target=strategy",
                f"target.strategy={self.dst_strategy}", f"output.dir={out}", *extra]


def make_big_source(root: Path, *, n_tensors: int = 8, rows: int = 1024, cols: int = 4096) -> BigSource:
    from reshard_job.formats.ckpt import CheckpointWriter
    from reshard_job.formats.strategy import write_strategy
    from reshard_job.core.strategy_model import ParamLayout, StrategyFile, StrategyItem

    root.mkdir(parents=True, exist_ok=True)
    names = [f"block{i}.weight" for i in range(n_tensors)]
    item = [StrategyItem("MatMul-op0", 0, ())]
    src = StrategyFile({n: ParamLayout((2,), (-1, 0)) for n in names}, item)
    dst = StrategyFile({n: ParamLayout((4,), (0, -1)) for n in names}, item)
    write_strategy(src, root / "src_strategy.ckpt", mode=0o644)
    write_strategy(dst, root / "dst_strategy.ckpt", mode=0o644)
    rng = np.random.default_rng(7)
    writers = [CheckpointWriter(root / "ckpts" / f"rank_{r}" / f"checkpoint_{r}.ckpt", mode=0o644) for r in range(2)]
    try:
        for name in names:
            g = np.frombuffer(rng.bytes(rows * cols * 4), dtype=np.uint32).reshape(rows, cols)
            g = (g & np.uint32(0x3FFFFFFF)).view(np.float32)  # finite floats, whatever the bytes
            for r, w in enumerate(writers):
                w.add(name, np.ascontiguousarray(g[:, r * cols // 2:(r + 1) * cols // 2]))
        for w in writers:
            w.commit()
    except BaseException:
        for w in writers:
            w.abort()
        raise
    return BigSource(root, root / "ckpts", root / "src_strategy.ckpt", root / "dst_strategy.ckpt")


# ================================================================================== in-process runs


def compose_config(*overrides: str) -> dict:
    """The resolved job configuration for these overrides, as the Hydra app hands it to run_job."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import reshard_job.job.config.schema as schema

    schema.register()
    with initialize_config_dir(config_dir=str(TESTS.parent / "reshard_job" / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)


def run_in_process(launch_dir: Path, *overrides: str):
    """run_job in this process (so a test can patch what it calls); job.workers=1 keeps writes here too."""
    from reshard_job.job.runner import run_job
    from reshard_job.job.config.settle import settle
    from reshard_job.job.config.spec import JobContext

    cfg = compose_config(*overrides, "job.workers=1")
    return run_job(settle(cfg, JobContext(launch_dir=str(launch_dir), run_dir=str(launch_dir / "run"))))


# ================================================================================== privileges


def without_dac_override():
    """A preexec_fn for a child that obeys file permission bits even as root.

    Root bypasses permission bits through CAP_DAC_OVERRIDE (and CAP_DAC_READ_SEARCH); dropping them
    from the bounding set before exec leaves root an ordinary owner: a 0555 directory is read-only
    to it, while the interpreter (root's, possibly under 0700 /root) and the sources stay readable.
    Returns None when not running as root (permission bits apply anyway).
    """
    if os.geteuid() != 0:
        return None
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def drop() -> None:
        for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
            if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")

    return drop


def can_drop_dac_override() -> bool:
    fn = without_dac_override()
    if fn is None:
        return True
    try:
        return subprocess.run([sys.executable, "-c", "pass"], preexec_fn=fn).returncode == 0
    except (subprocess.SubprocessError, OSError):
        return False


def file_size_limit(limit: int):
    """A preexec_fn: writes beyond `limit` bytes fail with EFBIG (SIGXFSZ ignored) - a disk that fills up."""
    import resource
    import signal

    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def temp_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob(".*.tmp")) if root.exists() else []
