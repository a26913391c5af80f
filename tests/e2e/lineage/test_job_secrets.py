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
