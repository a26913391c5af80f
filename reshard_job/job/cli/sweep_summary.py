"""Hydra callback that ends a sweep with a summary table (one row per job).

Each job writes ``result.json`` into its own job directory; the summary is read back from there,
so it works whichever launcher ran the jobs (in this process, joblib workers, or a cluster).
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from reshard_job.job.cli.result_file import RESULT_FILE
from reshard_job.text import table

FAILED = []  # job numbers that failed in this process's sweep, for the exit status


class SweepSummary(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = config.hydra.sweep.dir
        rows = []
        failed = 0
        results = []
        for path in glob.glob(os.path.join(glob.escape(sweep_dir), "*", RESULT_FILE)):
            try:
                with open(path, encoding="utf-8") as f:
                    results.append(json.load(f))
            except (OSError, ValueError):
                continue
        results.sort(key=lambda r: (r.get("job_num") is None, r.get("job_num")))
        for r in results:
            if r.get("status") == "failed":
                failed += 1
            rows.append([
                str(r.get("job_num", "-")),
                " ".join(r.get("overrides") or []) or "-",
                str(r.get("target_devices") or "-"),
                r.get("status", "?"),
                r.get("output_dir") or (r.get("error") or "-")[:80],
                (r.get("manifest_sha256") or "-")[:16],
            ])
        print()
        print(f"Sweep summary ({len(rows)} job(s), {failed} failed) in {sweep_dir}")
        print(table(["job", "overrides", "target devices", "status", "output dir / error", "manifest sha256"], rows))
        if failed:
            FAILED.append(failed)
