"""Hostile inputs and configurations: each ends in one line (exit 2) quickly and in bounded memory.

Every case runs the job in a child process under an address-space limit, so a regression that
would allocate gigabytes fails the test instead of taking the machine down, and under a timeout,
so a hang fails too. The child's own peak RSS (``wait4``) is checked against the 512 MiB bound.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from reliability_helpers import (ERROR_PREFIX, S1, app_command, app_env, can_drop_dac_override, copy_s1, message_lines,
                                 s1_args, without_dac_override)

MEMORY_BOUND_MIB = 512
ADDRESS_SPACE = 6 << 30  # a safety net well above what threads and arenas reserve
TIMEOUT_S = 120  # generous for a loaded CI machine; the bound that matters is memory and "no hang"


MEASURE_CHILD = Path(__file__).parents[3] / "benchmarks" / "measure_child.py"


def run_bounded(cwd: Path, *args: str, drop_dac: bool = False) -> tuple[int, str, float, float]:
    """(exit status, stderr, peak RSS MiB, seconds) of the job as a child under the limits.

    The job is started by ``benchmarks/measure_child.py`` (a small interpreter without site
    packages) and its peak RSS is the one that process reads from ``wait4``: a child forked straight
    from this test process would report at least this process's own size (Linux keeps the
    high-water mark across exec), and a long test session grows past the bound by itself."""
    dac = without_dac_override() if drop_dac else None

    def limits() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))
        if dac is not None:
            dac()

    started = time.monotonic()
    stamp = time.monotonic_ns()
    err_path, result_path = cwd / f"stderr.{stamp}", cwd / f"measured.{stamp}.json"
    command = [sys.executable, "-S", str(MEASURE_CHILD), str(result_path), "--", *app_command(*args)]
    with open(err_path, "w") as err:
        proc = subprocess.Popen(command, cwd=cwd, env=app_env(), stdout=subprocess.DEVNULL, stderr=err,
                                preexec_fn=limits, start_new_session=True)
        try:
            proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the job too, not only the process measuring it
            proc.wait()
            pytest.fail(f"the job hung (> {TIMEOUT_S} s): {args}")
    measured = json.loads(result_path.read_text())
    return measured["rc"], err_path.read_text(), measured["maxrss_kib"] / 1024, time.monotonic() - started


def one_error(code: int, stderr: str, rss: float) -> str:
    assert code == 2, stderr
    assert "Traceback" not in stderr, stderr
    lines = message_lines(stderr)
    assert len(lines) == 1 and lines[0].startswith(ERROR_PREFIX), stderr
    assert len(lines[0]) <= 2100, len(lines[0])
    assert rss <= MEMORY_BOUND_MIB, f"peak RSS {rss:.0f} MiB"
    return lines[0][len(ERROR_PREFIX):]


@pytest.fixture
def s1(tmp_path):
    return copy_s1(tmp_path / "src")


def test_a_fifo_strategy_file_is_refused_not_waited_on(tmp_path, s1):
    ckpts, src, dst = s1
    fifo = tmp_path / "strategy.ckpt"
    os.mkfifo(fifo)
    error = one_error(*run_bounded(tmp_path, *s1_args(ckpts, fifo, dst, tmp_path / "out"))[:3])
    assert error == f"{fifo}: is a FIFO (named pipe), expected a regular file"


def test_a_fifo_inside_a_pipeline_strategy_directory_is_refused(tmp_path, s1):
    ckpts, src, dst = s1
    stages = tmp_path / "stages"
    stages.mkdir()
    (stages / "stage0.ckpt").write_bytes(src.read_bytes())
    os.mkfifo(stages / "stage1.ckpt")
    error = one_error(*run_bounded(tmp_path, *s1_args(ckpts, stages, dst, tmp_path / "out"))[:3])
    assert error.startswith(f"{stages / 'stage1.ckpt'}: is not a regular file")


@pytest.mark.parametrize("device,key", [("/dev/zero", "source.strategy"), ("/dev/urandom", "target.strategy")])
def test_devices_as_strategy_files_are_refused(tmp_path, s1, device, key):
    ckpts, src, dst = s1
    args = s1_args(ckpts, device if key == "source.strategy" else src, device if key == "target.strategy" else dst,
                   tmp_path / "out")
    error = one_error(*run_bounded(tmp_path, *args)[:3])
    assert error == f"{device}: is a device, expected a regular file"


def test_a_device_as_a_rank_file_is_skipped_and_named(tmp_path, s1):
    ckpts, src, dst = s1
    (ckpts / "rank_3" / "checkpoint_3.ckpt").unlink()
    os.symlink("/dev/zero", ckpts / "rank_3" / "checkpoint_3.ckpt")
    error = one_error(*run_bounded(tmp_path, *s1_args(ckpts, src, dst, tmp_path / "out"))[:3])
    assert error == f"{ckpts}: no checkpoint file in rank directory rank_3"


def test_a_megabyte_parameter_name_gives_a_short_error_line(tmp_path, s1):
    from reshard_job.formats.ckpt import CheckpointWriter
    import numpy as np

    ckpts, src, dst = s1
    huge = "p" * (1 << 20)
    with CheckpointWriter(tmp_path / "extra.ckpt", mode=0o644) as w:
        w.add(huge, np.zeros(2, np.float32))
    rank8 = ckpts / "rank_8"
    rank8.mkdir()
    os.replace(tmp_path / "extra.ckpt", rank8 / "checkpoint_8.ckpt")
    error = one_error(*run_bounded(tmp_path, *s1_args(ckpts, src, dst, tmp_path / "out"))[:3])
    assert "holds 1 parameter(s) that no rank within it holds (e.g. 'ppp" in error and "…" in error


def test_a_record_with_millions_of_dims_is_refused(tmp_path, s1):
    from reshard_job.formats import wire
    from reshard_job.formats.ckpt.records import tensor_header

    ckpts, src, dst = s1
    dims = [1] * 2_000_000
    tensor = tensor_header(dims, "Float32", 4) + b"\0\0\0\0"
    tag = b"w"
    value = wire.len_field(1, len(tag)) + tag + wire.len_field(2, len(tensor)) + tensor
    victim = ckpts / "rank_1" / "checkpoint_1.ckpt"
    victim.write_bytes(wire.len_field(1, len(value)) + value)
    error = one_error(*run_bounded(tmp_path, *s1_args(ckpts, src, dst, tmp_path / "out"))[:3])
    assert error.startswith(f"{victim}: record at offset 0: more than 64 dims")


@pytest.mark.skipif(not can_drop_dac_override(), reason="cannot drop root's permission override to test as a user")
@pytest.mark.parametrize("which", ["root", "rank"])
def test_unreadable_source_folders_are_one_line(tmp_path, s1, which):
    ckpts, src, dst = s1
    target = ckpts if which == "root" else ckpts / "rank_2"
    target.chmod(0o000)
    try:
        error = one_error(*run_bounded(tmp_path, *s1_args(ckpts, src, dst, tmp_path / "out"), drop_dac=True)[:3])
    finally:
        target.chmod(0o755)
    assert error == f"{target}: permission denied (list it)"


@pytest.mark.parametrize("override,message", [
    ("job.max_memory=inf", "job.max_memory: not a finite size: 'inf'"),
    ("job.max_memory=0", "job.max_memory must lie between 1KiB and 1TiB"),
    ("job.workers=-3", "job.workers must be an integer from 1 to 1024"),
    ("target.prefix=" + "x" * 300, "target.prefix has 300 characters"),
])
def test_absurd_values_fail_before_anything_is_written(tmp_path, s1, override, message):
    ckpts, src, dst = s1
    out = tmp_path / "out"
    error = one_error(*run_bounded(tmp_path, *s1_args(ckpts, src, dst, out), override)[:3])
    assert message in error
    assert not out.exists()


def test_the_bounded_runner_sees_a_real_conversion_within_bounds(tmp_path, s1):
    """The harness itself: a normal conversion passes under the same limits (so the limits are not what fails)."""
    ckpts, src, dst = s1
    code, stderr, rss, seconds = run_bounded(tmp_path, *s1_args(ckpts, src, dst, tmp_path / "out"))
    assert code == 0, stderr
    assert rss <= MEMORY_BOUND_MIB
    assert (tmp_path / "out" / "manifest.json").exists() and S1.exists()


def test_a_tensor_of_many_chunk_records_in_every_file_is_refused_quickly(tmp_path, s1):
    """One tensor stored as 50,000 same-name records in each of the 8 files (1,000,000 in
    benchmarks/hostile_cases.py): refused at the first record past what MindSpore can write, not
    indexed record by record for minutes."""
    import shutil

    from reshard_job.formats.ckpt import CheckpointWriter

    ckpts, src, dst = s1
    count = 50_000
    chunked = tmp_path / "chunked.ckpt"
    with CheckpointWriter(chunked, mode=0o644) as w:
        w.add_bytes("chunked", "Float32", (count,), np.zeros(count, np.float32), chunk_sizes=[4] * count)
    for r in range(8):
        path = ckpts / f"rank_{r}" / f"checkpoint_{r}.ckpt"
        path.unlink()
        shutil.copy(chunked, path)
    code, stderr, rss, seconds = run_bounded(tmp_path, *s1_args(ckpts, src, dst, tmp_path / "out"))
    error = one_error(code, stderr, rss)
    assert error.endswith("parameter 'chunked': stored in more than 4096 consecutive records "
                          "(MindSpore writes one per 512 MiB of a tensor)"), error
    assert "/checkpoint_" in error


def test_a_target_strategy_declaring_a_million_devices_is_refused_before_planning(tmp_path, s1):
    """dev_matrix (1024, 1024), all maps -1: a million target ranks each holding the whole model. One
    job writes at most 65536 rank files; planning a million of them took minutes and a gigabyte."""
    from reshard_job.core.strategy_model import ParamLayout, StrategyFile
    from reshard_job.formats.strategy import read_strategy, write_strategy

    ckpts, src, dst = s1
    sf = read_strategy(dst)
    huge = {n: ParamLayout((1024, 1024), tuple(-1 for _ in lay.tensor_map)) for n, lay in sf.layouts.items()}
    dst.unlink()
    write_strategy(StrategyFile(huge, sf.items), dst, mode=0o644)
    out = tmp_path / "out"
    error = one_error(*run_bounded(tmp_path, *s1_args(ckpts, src, dst, out))[:3])
    assert error == (f"target.strategy {dst} lays out 1048576 devices: more target ranks than the 65536 one job "
                     "writes (one file each)")
    assert not out.exists()
