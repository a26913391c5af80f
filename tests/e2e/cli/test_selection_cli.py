"""target.include / target.exclude / target.rename through the CLI, on golden S2 (MindSpore 2.10).

A renamed, filtered conversion is proven (fingerprints of sources and outputs compared under the
new names) and recorded: manifest.json's ``selection``, the plan in lineage, the run's config.
Refusals are one line, exit 2.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from reshard_job.formats.ckpt import CheckpointReader
from reshard_job.formats.strategy import read_strategy, write_strategy

S2 = Path(__file__).parents[2] / "golden" / "S2_block_mp4dp2opt_to_mp4"
REPO = Path(__file__).parents[3]


@pytest.fixture
def run_app(app):
    """``python -m reshard_job`` as its own process (forked by the e2e `app` launcher), this checkout first on its path."""
    def run(cwd: Path, *args: str) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "RESHARD_JOB_FULL_ERROR")}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        return app(cwd, *args, timeout=180, env=env)

    return run


def s2_args(dst_strategy: Path, *more: str) -> list[str]:
    return ["source=checkpoints", f"source.checkpoints={S2 / 'src_checkpoints'}",
            f"source.strategy={S2 / 'src_strategy.ckpt'}", "target=strategy", f"target.strategy={dst_strategy}", *more]


def renamed_strategy(path: Path) -> Path:
    """S2's target strategy with ``layers.`` renamed ``blk.``, as a renamed network's would be."""
    sf = read_strategy(S2 / "dst_strategy.ckpt")
    write_strategy(replace(sf, layouts={re.sub(r"^(adam_m\.|adam_v\.)?layers\.", r"\1blk.", n): lay
                                        for n, lay in sf.layouts.items()}), path)
    return path


def test_renamed_filtered_conversion_is_proven_and_recorded(tmp_path, run_app):
    out = tmp_path / "out"
    res = run_app(tmp_path, *s2_args(renamed_strategy(tmp_path / "dst.ckpt"), "target.include=weights",
                                     "target.exclude=[head.*,nothing.*]", "target.rename={layers.: blk.}",
                                     f"output.dir={out}"))
    assert res.returncode == 0, res.stderr
    assert "pattern 'nothing.*' matches no parameter of the source" in res.stderr
    with CheckpointReader(out / "rank_0" / "checkpoint_0.ckpt") as r:
        names = r.names()
    assert any(n.startswith("blk.") for n in names) and "embedding_table" in names
    assert not any(n.startswith(("layers.", "adam_", "head.")) for n in names) and "global_step" not in names
    manifest = json.loads((out / "manifest.json").read_text())
    selection = manifest["selection"]
    assert (selection["include"], selection["exclude"], selection["rename"]) == \
        ("weights", ["head.*", "nothing.*"], [["layers.", "blk."]])
    assert selection["left_out"] == 37 and selection["renamed"] == 13
    assert "every converted parameter has the same fingerprint in the outputs as in the sources" in manifest["checks"]
    with sqlite3.connect(tmp_path / "runs" / "lineage.db") as db:
        plan_selection, = db.execute("select json_extract(plan, '$.selection') from run_plans").fetchone()
        config_rename, = db.execute("select json_extract(config, '$.target.rename') from runs").fetchone()
    assert json.loads(plan_selection)["left_out"] == 37
    assert json.loads(config_rename) == {"layers.": "blk."}


def test_refusals_are_one_line_exit_2(tmp_path, run_app):
    dst = S2 / "dst_strategy.ckpt"
    cases = {
        "target.rename={adam_m.: adam_v.}": "parameters 'adam_v.embedding_table' and 'adam_m.embedding_table' "
                                            "would both be named 'adam_v.embedding_table'",
        "target.include=[nothing.*]": "target.include/target.exclude leave none of the 53 source parameter(s)",
        "target.include=weights_only": "target.include must be weights or all, or a list of name patterns",
    }
    for override, message in cases.items():
        res = run_app(tmp_path, *s2_args(dst, override, "job.mode=plan"))
        assert res.returncode == 2, (override, res.stderr)
        assert res.stderr.count("\n") == 1 and message in res.stderr, res.stderr
