"""Helpers for the job-level object-storage tests: putting trees into a bucket, running the job and
the audit as users do, looking at what a run left in the bucket, and a throttling proxy.

Everything talks to the real SeaweedFS server of ``tests/conftest.py``. The job runs in a
subprocess with the credentials given the way a test chooses (the standard environment variables,
or ``storage.*`` on the command line); the parent's own AWS settings never leak into it.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import re
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

from job_launcher import Launcher

TESTS = Path(__file__).parents[2]
GOLDEN = TESTS / "golden"
LOG_LINE = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+\]\[[^\]]*\]\[[A-Z]+\] - ")
ERROR_PREFIX = "reshard_job: error: "
AWS_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL",
                 "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_DEFAULT_REGION", "AWS_REGION",
                 "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE")


# ================================================================================== the bucket


@dataclass
class Bucket:
    """Raw access to one prefix of the test server, bypassing the code under test where it matters."""

    store: object  # S3Storage as administrator
    bucket: str
    prefix: str

    def url(self, *parts: str) -> str:
        return "/".join([f"s3://{self.bucket}/{self.prefix}", *parts])

    def key(self, url: str) -> str:
        assert url.startswith(f"s3://{self.bucket}/"), url
        return url[len(f"s3://{self.bucket}/"):]

    def put(self, url: str, data: bytes) -> None:
        self.store.call_raw("put_object", Bucket=self.bucket, Key=self.key(url), Body=data)

    def put_tree(self, local: Path, url: str) -> str:
        """Every file under `local` at the same relative place under `url` (as ``aws s3 cp --recursive``)."""
        for path in sorted(p for p in Path(local).rglob("*") if p.is_file()):
            self.put(f"{url}/{path.relative_to(local).as_posix()}", path.read_bytes())
        return url

    def get(self, url: str) -> bytes | None:
        try:
            answer = self.store.call_raw("get_object", Bucket=self.bucket, Key=self.key(url))
        except Exception as e:  # noqa: BLE001
            if "NoSuchKey" in repr(e) or "404" in repr(e):
                return None
            raise

        async def body():
            try:
                return await answer["Body"].read()
            finally:
                answer["Body"].close()

        return self.store.run(body)

    def keys(self, url: str) -> list[str]:
        """Every object key below `url`, relative to it."""
        prefix = self.key(url).rstrip("/") + "/"
        out, token = [], None
        while True:
            params = {"Bucket": self.bucket, "Prefix": prefix, **({"ContinuationToken": token} if token else {})}
            page = self.store.call_raw("list_objects_v2", **params)
            out += [o["Key"][len(prefix):] for o in page.get("Contents") or ()]
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return sorted(out)

    def uploads(self, url: str) -> list[str]:
        """Keys of the unfinished multipart uploads below `url`."""
        page = self.store.call_raw("list_multipart_uploads", Bucket=self.bucket, Prefix=self.key(url))
        return sorted(u["Key"] for u in page.get("Uploads") or ())


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ================================================================================== running


@dataclass
class Runner:
    """Runs ``python -m reshard_job`` / ``python -m reshard_job.audit`` from `cwd` with a clean AWS environment."""

    cwd: Path
    env: dict[str, str] = field(default_factory=dict)  # AWS variables the runs see (credentials, endpoint)
    launcher: Launcher | None = None  # job runs forked from a pre-imported interpreter instead of started afresh

    def environment(self) -> dict[str, str]:
        keep = {k: v for k, v in os.environ.items()
                if k not in AWS_VARIABLES and k not in ("HYDRA_FULL_ERROR", "RESHARD_JOB_FULL_ERROR")}
        # no ~/.aws of the machine running the tests, no digest cache shared with other tests
        keep.update(AWS_SHARED_CREDENTIALS_FILE=str(self.cwd / "no-aws-credentials"),
                    AWS_CONFIG_FILE=str(self.cwd / "no-aws-config"), AWS_EC2_METADATA_DISABLED="true",
                    RESHARD_JOB_CACHE_DIR=str(self.cwd / "digest-cache"))
        return {**keep, **self.env}

    def command(self, module: str, *args: str) -> list[str]:
        return [sys.executable, "-m", module, *args]

    def job(self, *args: str, timeout: int = 240) -> subprocess.CompletedProcess:
        if self.launcher is not None:
            return self.launcher.run(self.cwd, list(args), timeout, self.environment())
        return subprocess.run(self.command("reshard_job", *args), cwd=self.cwd, env=self.environment(),
                              capture_output=True, text=True, timeout=timeout)

    def start_job(self, *args: str, log: Path) -> subprocess.Popen:
        """The job in the background, in its own process group (so a test can kill it and its workers)."""
        handle = open(log, "w")
        try:
            return subprocess.Popen(self.command("reshard_job", *args), cwd=self.cwd, env=self.environment(),
                                    stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            handle.close()

    def audit(self, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
        db = f"sqlite:///{self.cwd / 'runs' / 'lineage.db'}"
        return subprocess.run(self.command("reshard_job.audit", "--db", db, *args), cwd=self.cwd,
                              env=self.environment(), capture_output=True, text=True, timeout=timeout)


def the_error(res: subprocess.CompletedProcess) -> str:
    """The one error line of a failed run (without its prefix); fails unless there is exactly one."""
    assert res.returncode == 2, f"expected exit 2, got {res.returncode}\n{res.stdout}\n{res.stderr}"
    assert "Traceback" not in res.stderr, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip() and not LOG_LINE.match(ln)]
    assert len(lines) == 1, f"expected one error line, got:\n{res.stderr}"
    assert lines[0].startswith(ERROR_PREFIX), lines[0]
    return lines[0][len(ERROR_PREFIX):]


def completed(res: subprocess.CompletedProcess) -> str:
    """The output location a successful run reports."""
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout}\n{res.stderr}"
    for line in res.stdout.splitlines():
        if line.startswith("completed") and "outputs in" in line:
            return line.split("outputs in", 1)[1].strip()
    raise AssertionError(f"no output location in:\n{res.stdout}")


# ================================================================================== throttling


SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}


class ThrottlingProxy:
    """An HTTP proxy in front of the S3 server, on loopback, that answers ``503 SlowDown`` to the
    requests `throttle(method, path)` picks and forwards every other one unchanged (the Host
    header included, so request signatures still verify). ``throttled`` counts the refusals,
    ``served`` the body bytes of the GETs it relayed."""

    def __init__(self, upstream: str, throttle: Callable[[str, str], bool]):
        self.upstream = urlsplit(upstream)
        self.throttle = throttle
        self.throttled = 0
        self.served = 0
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> "ThrottlingProxy":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _refuse(self, method: str, path: str) -> bool:
        if not self.throttle(method, path):
            return False
        with self._lock:
            self.throttled += 1
        return True

    def _handler(self):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _any(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if proxy._refuse(self.command, self.path):
                    self._answer(503, [("Content-Type", "application/xml")], SLOW_DOWN)
                    return
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                    conn.request(self.command, self.path, body=body, headers=headers)
                    answer = conn.getresponse()
                    data = answer.read()
                    self._answer(answer.status, [(k, v) for k, v in answer.getheaders()
                                                 if k.lower() not in HOP_BY_HOP], data)
                finally:
                    conn.close()

            def _answer(self, status: int, headers, data: bytes) -> None:
                """Relay an answer; a body is sent whole, with its length (a HEAD keeps the object's)."""
                self.send_response(status)
                for k, v in headers:
                    if self.command == "HEAD" or k.lower() != "content-length":
                        self.send_header(k, v)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(data)))
                if self.command == "GET":
                    with proxy._lock:
                        proxy.served += len(data)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _any

        return Handler


# ================================================================================== sources


@dataclass(frozen=True)
class BigSource:
    """A synthetic 2-rank source (columns split) whose 2 target ranks (rows split) each need both
    source files: every output is several multipart-upload parts long."""

    root: Path

    @property
    def checkpoints(self) -> Path:
        return self.root / "ckpts"

    def args(self, out: str, *, base: str | None = None) -> list[str]:
        """The job's overrides, reading from `base` (a prefix URL holding a copy of `root`) or from disk."""
        where = base or str(self.root)
        return [f"source.checkpoints={where}/ckpts", f"source.strategy={where}/src_strategy.ckpt", "target=strategy",
                f"target.strategy={where}/dst_strategy.ckpt", f"output.dir={out}"]


def make_big_source(root: Path, *, n_tensors: int = 4, rows: int = 1024, cols: int = 2048) -> BigSource:
    """`n_tensors` float32 [rows, cols] tensors (8 MiB each by default), 2 source ranks, 2 target ranks:
    each output of 16 MiB goes up in two parts."""
    import numpy as np

    from reshard_job.formats.ckpt import CheckpointWriter
    from reshard_job.formats.strategy import write_strategy
    from reshard_job.core.strategy_model import ParamLayout, StrategyFile, StrategyItem

    root.mkdir(parents=True, exist_ok=True)
    names = [f"block{i}.weight" for i in range(n_tensors)]
    item = [StrategyItem("MatMul-op0", 0, ())]
    write_strategy(StrategyFile({n: ParamLayout((2,), (-1, 0)) for n in names}, item), root / "src_strategy.ckpt",
                   mode=0o644)
    write_strategy(StrategyFile({n: ParamLayout((2,), (0, -1)) for n in names}, item), root / "dst_strategy.ckpt",
                   mode=0o644)
    rng = np.random.default_rng(11)
    writers = [CheckpointWriter(root / "ckpts" / f"rank_{r}" / f"checkpoint_{r}.ckpt", mode=0o644) for r in range(2)]
    for name in names:
        g = rng.standard_normal((rows, cols), dtype=np.float32)
        for r, w in enumerate(writers):
            w.add(name, np.ascontiguousarray(g[:, r * cols // 2:(r + 1) * cols // 2]))
    for w in writers:
        w.commit()
    return BigSource(root)
