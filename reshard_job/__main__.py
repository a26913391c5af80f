"""``python -m reshard_job [overrides]``: the Hydra batch job (thin entry point over job.runner)."""

from __future__ import annotations

import json
import logging
import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from .errors import ReshardError
from .job import schema
from .job.callbacks import FAILED, RESULT_FILE
from .job.runner import STATUS_FAILED, JobContext, JobResult, run_job

schema.register()
log = logging.getLogger("reshard_job")


def _context() -> tuple[JobContext, bool]:
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    overrides = list(hc.overrides.task)
    ctx = JobContext(
        launch_dir=hc.runtime.cwd,
        run_dir=hc.runtime.output_dir,
        overrides=overrides,
        sweep_id=os.path.abspath(os.path.join(hc.runtime.cwd, hc.sweep.dir)) if multirun else None,
        job_num=hc.job.num if multirun else None,
        from_presets=True,
    )
    return ctx, multirun


def _write_result(ctx: JobContext, result: JobResult) -> None:
    doc = result.to_json()
    doc.update(job_num=ctx.job_num, overrides=ctx.overrides)
    os.makedirs(ctx.run_dir, exist_ok=True)
    with open(os.path.join(ctx.run_dir, RESULT_FILE), "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)


# The presets live in the repository's top-level conf/ (the package is installed editable). An
# absolute path makes them found however the app starts: `python -m reshard_job`, the
# `reshard-job` console script, or main() called from other code.
CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def app(cfg: DictConfig) -> None:
    ctx, multirun = _context()
    resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    try:
        result = run_job(resolved, ctx)
    except ReshardError as e:
        # A user-facing error: one line, no traceback (HYDRA_FULL_ERROR=1 shows it).
        if os.environ.get(_USER_FULL_ERROR) == "1":
            raise
        print(f"reshard_job: error: {e}", file=sys.stderr)
        if not multirun:
            sys.exit(e.exit_code)
        _write_result(ctx, JobResult(STATUS_FAILED, error=str(e)))
        FAILED.append(1)
        return
    _write_result(ctx, result)
    if result.output_dir:
        print(f"{result.status}: outputs in {result.output_dir}")
        print(f"  manifest: {os.path.join(result.output_dir, 'manifest.json')} (sha256 {result.manifest_sha256})")
        if result.run_id:
            print(f"  lineage run {result.run_id}: python -m reshard_job.audit show {result.run_id}")


_USER_FULL_ERROR = "RESHARD_JOB_FULL_ERROR"


def one_line(exc: BaseException) -> str:
    """Condense Hydra's and OmegaConf's multi-line configuration errors into one line."""
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(exc, OmegaConfBaseException) and getattr(exc, "msg", None):
        key = getattr(exc, "full_key", None)
        msg = str(exc.msg).strip().splitlines()[0]
        return f"{key}: {msg}" if key and not msg.startswith(f"{key}:") else msg
    lines = [ln.strip() for ln in str(exc).splitlines()]
    head = next((ln for ln in lines if ln), type(exc).__name__)
    options = []
    if "Available options in" in str(exc):
        start = next(i for i, ln in enumerate(lines) if ln.startswith("Available options in"))
        for ln in lines[start + 1:]:
            if not ln or ln.startswith("Config search path"):
                break
            if not ln.endswith("_schema"):  # the structured-config schemas are not presets
                options.append(ln)
    from hydra.errors import OverrideParseException

    if isinstance(exc, OverrideParseException):
        bad = getattr(exc, "override", None)
        return (f"cannot parse override {bad!r}: {head}; quote values that contain characters such as "
                "= ? & , [ ] { } or spaces, e.g. lineage.url='postgresql+psycopg://host/db?sslmode=require'")
    cause = exc.__cause__
    detail = f" ({one_line(cause)})" if cause is not None and cause is not exc and not options else ""
    return head + (f" (available: {', '.join(options)})" if options else "") + detail


def main() -> None:
    """Run the Hydra app; configuration errors (unknown preset, bad override) become one line.

    Hydra prints such errors over several lines itself unless HYDRA_FULL_ERROR=1, in which case it
    re-raises them; we set it to catch them here, and keep the user's own setting, which still
    gives full tracebacks.
    """
    os.environ.setdefault(_USER_FULL_ERROR, os.environ.get("HYDRA_FULL_ERROR", "0"))
    user_full = os.environ[_USER_FULL_ERROR] == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        app()
    except (SystemExit, KeyboardInterrupt):
        raise
    except Exception as e:
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException

        if user_full or not isinstance(e, (HydraException, OmegaConfBaseException)):
            raise
        print(f"reshard_job: error: {one_line(e)}", file=sys.stderr)
        sys.exit(1)
    if FAILED:
        sys.exit(1)


if __name__ == "__main__":
    main()
