"""``audit verify`` of an output directory fails on files a loader would take that its manifest
does not list: it said "all 6 files intact" with a ``rank_4/`` folder added, or a newer-step
``checkpoint_0-2_1.ckpt`` beside ``checkpoint_0.ckpt`` (MindSpore's newest-step rule loads it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys


def _run(cwd, *argv):
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "RESHARD_JOB_FULL_ERROR",
                                                              "RESHARD_LINEAGE_URL", "RESHARD_JOB_LINEAGE_URL")}
    return subprocess.run([sys.executable, "-m", *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_files_beside_the_listed_ones_that_a_loader_would_take_fail_verify(tmp_path):
    done = _run(tmp_path, "reshard_job", "output.dir=out", "job.progress=false")
    assert done.returncode == 0, done.stderr
    db, out = tmp_path / "runs" / "lineage.db", tmp_path / "out"
    verify = ("reshard_job.audit", "--db", str(db), "verify", str(out))
    (out / "README.txt").write_text("notes beside the checkpoint")  # no loader takes it
    assert _run(tmp_path, *verify).returncode == 0
    shutil.copytree(out / "rank_3", out / "rank_4")
    shutil.copy(out / "rank_0" / "checkpoint_0.ckpt", out / "rank_0" / "checkpoint_0-2_1.ckpt")
    res = _run(tmp_path, *verify)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "2 unlisted" in res.stdout.splitlines()[0]
    unlisted = sorted(line.split()[1] for line in res.stdout.splitlines() if line.strip().startswith("UNLISTED"))
    assert unlisted == [str(out / "rank_0" / "checkpoint_0-2_1.ckpt"), str(out / "rank_4")]
