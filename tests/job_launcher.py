"""``python -m reshard_job`` run many times without paying an interpreter start each time.

A pre-imported interpreter (the "zygote") forks one child per job run. Each child is a fresh process
as far as the job can tell: its own argv, cwd, environment (the caller's at the time of the call),
stdout/stderr files and exit status; the package is merely already imported. A run costs a fork
instead of the second or so that starting Python and importing Hydra and the job take.

Tests whose point is the program's start-up itself (import time, a signal during the imports, the
``python -m`` entry point) start a real interpreter instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

_ZYGOTE = r"""
import json, os, runpy, signal, sys, time
if sys.path and sys.path[0] == "":  # import what `python -m reshard_job` run elsewhere imports, not the launch folder's
    del sys.path[0]
import hydra, hydra._internal.utils, hydra.core.hydra_config, omegaconf  # the imports being shared, all but
import reshard_job.job.runner, reshard_job.job.cli.sweep_summary, reshard_job.lineage  # reshard_job.__main__ itself
import reshard_job.lineage.migrate, alembic.command, reshard_job.formats.safetensors
import importlib
for name in sys.argv[1:]:  # more to share where installed (the object-storage client, for the S3 tests)
    try:
        importlib.import_module(name)
    except ImportError:
        pass
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        try:
            os.environ.clear()
            os.environ.update(req["env"])
            os.chdir(req["cwd"])
            for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
                f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(f, fd)
                os.close(f)
            sys.stdout = open(1, "w", closefd=False)
            sys.stderr = open(2, "w", closefd=False)
            sys.argv = ["reshard_job"] + req["args"]
            code = 0
            try:
                runpy.run_module("reshard_job", run_name="__main__", alter_sys=True)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:
                import traceback
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(locals().get("code", 1))
    deadline = time.monotonic() + req["timeout"]
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            status = -1
            break
        time.sleep(0.005)
    rc = os.waitstatus_to_exitcode(status) if status != -1 else -9
    print(json.dumps({"rc": rc}), flush=True)
"""

USER_ERROR_SWITCHES = ("HYDRA_FULL_ERROR", "RESHARD_JOB_FULL_ERROR")


def job_env() -> dict[str, str]:
    """This process's environment without the switches that turn one-line errors into tracebacks."""
    return {k: v for k, v in os.environ.items() if k not in USER_ERROR_SWITCHES}


def job_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "reshard_job", *args]


class Launcher:
    """Runs ``python -m reshard_job`` many times through a pre-imported interpreter (see _ZYGOTE)."""

    def __init__(self, preload: tuple[str, ...] = ()) -> None:
        """`preload`: more modules the runs share, imported before the first fork where installed."""
        self._proc = subprocess.Popen([sys.executable, "-c", _ZYGOTE, *preload], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, env=job_env(), text=True)

    def run(self, cwd: Path, args: list[str], timeout: int = 300,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """One run in `cwd`; `env` defaults to this process's environment now (as subprocess.run's)."""
        fd, out = tempfile.mkstemp(prefix="job-stdout-")
        os.close(fd)
        fd, err = tempfile.mkstemp(prefix="job-stderr-")
        os.close(fd)
        out, err = Path(out), Path(err)
        req = {"cwd": str(cwd), "args": list(args), "stdout": str(out), "stderr": str(err), "timeout": timeout,
               "env": job_env() if env is None else dict(env)}
        self._proc.stdin.write(json.dumps(req) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError("the job launcher died")
        rc = json.loads(line)["rc"]
        res = subprocess.CompletedProcess(job_command(*args), rc, out.read_text(), err.read_text())
        out.unlink()
        err.unlink()
        return res

    def close(self) -> None:
        self._proc.stdin.close()
        self._proc.wait(timeout=60)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
