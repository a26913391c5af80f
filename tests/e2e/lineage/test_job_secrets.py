"""A password given in the lineage URL (or a key in storage.options) is used to connect and written
nowhere: not in manifest.json, result.json, Hydra's saved configuration, the log, or the lineage
database's record of the run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from test_job_lineage import S2, _env

PASSWORD = "hunter2-XYZ"
KEY = "AKIAEXAMPLEKEY123"


@pytest.mark.postgres
def test_credentials_never_reach_disk_or_the_database(tmp_path, postgres_url, postgres_server):
    url = postgres_url.replace("postgres@/", f"postgres:{PASSWORD}@/")  # trust auth: accepted, then ignored
    res = subprocess.run(
        [sys.executable, "-m", "reshard_job", f"source.checkpoints={S2 / 'src_checkpoints'}",
         f"source.strategy={S2 / 'src_strategy.ckpt'}", "target=strategy", f"target.strategy={S2 / 'dst_strategy.ckpt'}",
         "output.dir=out", f"lineage.url='{url}'", f"+storage.options.secret={KEY}", "hydra.run.dir=run"],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    everything = res.stdout + res.stderr
    for path in Path(tmp_path).rglob("*"):
        if path.is_file() and path.suffix in (".json", ".yaml", ".log", ".jsonl", ""):
            everything += path.read_text(errors="replace")
    import psycopg

    dsn = dict(host=str(postgres_server.socket_dir), port=postgres_server.port, user="postgres",
               dbname=postgres_url.split("@/", 1)[1].split("?")[0])
    with psycopg.connect(**dsn) as con, con.cursor() as cur:
        cur.execute("SELECT config::text, overrides::text, output_dir FROM runs")
        rows = cur.fetchall()
    assert rows and all(r[0] for r in rows)
    everything += "".join(str(r) for r in rows)
    assert PASSWORD not in everything and KEY not in everything
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["config"]["lineage"]["url"] == url.replace(PASSWORD, "***")
    assert (tmp_path / "run" / ".hydra" / "overrides.yaml").read_text().count("***") == 2


def test_hydra_never_writes_the_configuration_itself_so_a_killed_job_leaves_no_password(tmp_path):
    """Hydra writes ``.hydra/`` before any of the job's code runs: a job killed then (``kill -9``)
    left the command line's passwords there. The job writes those files itself, masked, as it starts;
    here it is stopped by SIGKILL from its first log line on, and they hold no password."""
    import os
    import signal

    proc = subprocess.Popen(
        [sys.executable, "-m", "reshard_job", f"source.checkpoints={S2 / 'src_checkpoints'}",
         f"source.strategy={S2 / 'src_strategy.ckpt'}", "target=strategy", f"target.strategy={S2 / 'dst_strategy.ckpt'}",
         "output.dir=out", "lineage.enabled=false", f"+storage.options.secret={KEY}", "hydra.run.dir=run"],
        cwd=tmp_path, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        proc.stderr.readline()  # the first log line: the job's code runs
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    saved = tmp_path / "run" / ".hydra"
    texts = [(saved / name).read_text() for name in ("config.yaml", "hydra.yaml", "overrides.yaml")]
    assert all("***" in text and KEY not in text for text in texts)
    assert "output_subdir: null" in texts[1]


def test_a_saved_configuration_folder_the_user_names_is_masked_too(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "reshard_job", f"source.checkpoints={S2 / 'src_checkpoints'}",
         f"source.strategy={S2 / 'src_strategy.ckpt'}", "target=strategy", f"target.strategy={S2 / 'dst_strategy.ckpt'}",
         "output.dir=out", "lineage.enabled=false", f"+storage.options.secret={KEY}", "hydra.run.dir=run",
         "hydra.output_subdir=cfg"], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    texts = [(tmp_path / "run" / "cfg" / name).read_text() for name in ("config.yaml", "hydra.yaml", "overrides.yaml")]
    assert all("***" in text and KEY not in text for text in texts)


@pytest.mark.parametrize("chdir", ["false", "true"])
def test_a_sweep_neither_prints_nor_saves_the_passwords_it_is_given(tmp_path, chdir):
    """A sweep (``-m``): Hydra's launcher lists each job's overrides, and its sweeper saves the whole
    configuration as ``multirun.yaml`` before any job runs; both are masked, and the jobs still get
    the real values (the unreachable database's error names its URL masked, after trying it)."""
    url = f"postgresql+psycopg://alice:{PASSWORD}@127.0.0.1:1/db"
    res = subprocess.run(
        [sys.executable, "-m", "reshard_job", "-m", f"source.checkpoints={S2 / 'src_checkpoints'}",
         f"source.strategy={S2 / 'src_strategy.ckpt'}", "target=strategy", f"target.strategy={S2 / 'dst_strategy.ckpt'}",
         "output.dir=out${hydra:job.num}", "target.unmapped=omit,full", f"lineage.url='{url}'",
         f"+storage.options.secret={KEY}", "hydra.sweep.dir=sweep", f"hydra.job.chdir={chdir}"],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr  # each job refused: the database cannot be reached
    everything = res.stdout + res.stderr
    for path in Path(tmp_path).rglob("*"):
        if path.is_file():
            everything += path.read_text(errors="replace")
    assert PASSWORD not in everything and KEY not in everything
    assert everything.count("#1 : ") == 1 and "alice:***@127.0.0.1" in res.stdout
    multirun = tmp_path / "sweep" / "multirun.yaml"
    assert not multirun.is_symlink() and "    secret: ***\n" in multirun.read_text()
    assert res.stderr.count("alice:***@127.0.0.1:1/db: connection failed") == 2  # the real URL was tried
    assert "Traceback" not in res.stderr and "Warning" not in res.stderr, res.stderr
    for job in (0, 1):  # each job's configuration saved, masked (wherever the job runs from)
        assert "***" in (tmp_path / "sweep" / str(job) / ".hydra" / "config.yaml").read_text()
