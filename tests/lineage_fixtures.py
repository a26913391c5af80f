"""Fixtures of the lineage tests: a fresh database per test on SQLite and on a real PostgreSQL.

PostgreSQL is not mocked: one server per test session is started from the server binaries
(``initdb``, ``pg_ctl``, found on PATH or in ``/usr/lib/postgresql/*/bin``) in a private temp
directory, listening only on a unix socket inside it (no TCP port to collide with anything),
with fsync off because the data is thrown away. Each test gets its own database, dropped after.

initdb refuses to run as root, and tests often run as root (CI does), so the server is then run
as the ``postgres`` OS user (created by Debian's package) through ``runuser``, with its
directories chowned to that user. The PostgreSQL tests are skipped only when the server
binaries are absent, and then loudly: the skip reason and the end-of-run summary name what is
missing. Any other failure to start the server is an error, not a skip.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

PG_BIN_GLOBS = ("/usr/lib/postgresql/*/bin", "/usr/local/pgsql/bin", "/usr/pgsql-*/bin")
SERVER_USER_CANDIDATES = ("postgres",)

_pg_skip_reason: list[str] = []


# -- PostgreSQL server -------------------------------------------------------------------------

def find_postgres_binaries() -> dict[str, str] | None:
    """Paths of initdb and pg_ctl, from PATH or the usual install directories (newest first)."""
    on_path = {name: shutil.which(name) for name in ("initdb", "pg_ctl")}
    if all(on_path.values()):
        return on_path  # type: ignore[return-value]

    def version_key(directory: str):
        digits = "".join(c if c.isdigit() else " " for c in directory).split()
        return [int(d) for d in digits]

    for pattern in PG_BIN_GLOBS:
        for directory in sorted(glob.glob(pattern), key=version_key, reverse=True):
            found = {name: os.path.join(directory, name) for name in ("initdb", "pg_ctl")}
            if all(os.access(p, os.X_OK) for p in found.values()):
                return found
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PostgresServer:
    binaries: dict[str, str]
    root: Path
    run_as: str | None
    port: int = field(default_factory=_free_port)

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def socket_dir(self) -> Path:
        return self.root / "socket"

    @property
    def log_file(self) -> Path:
        return self.root / "server.log"

    def _command(self, *args: str) -> list[str]:
        if self.run_as is None:
            return list(args)
        if shutil.which("runuser"):
            return ["runuser", "-u", self.run_as, "--", *args]
        import shlex

        return ["su", "-s", "/bin/sh", self.run_as, "-c", shlex.join(args)]

    def _run(self, *args: str, timeout: float = 120) -> None:
        env = {**os.environ, "LC_ALL": "C", "LANG": "C"}
        result = subprocess.run(self._command(*args), capture_output=True, text=True, timeout=timeout,
                                env=env, cwd=self.root)
        if result.returncode != 0:
            log = self.log_file.read_text(errors="replace")[-2000:] if self.log_file.exists() else ""
            raise RuntimeError(f"{' '.join(args[:2])} failed ({result.returncode}):\n"
                               f"{result.stdout}\n{result.stderr}\n{log}")

    def start(self) -> None:
        self.socket_dir.mkdir(parents=True)
        if self.run_as is not None:
            user = pwd.getpwnam(self.run_as)
            for path in (self.root, self.socket_dir):
                os.chown(path, user.pw_uid, user.pw_gid)
        self._run(self.binaries["initdb"], "-D", str(self.data_dir), "-U", "postgres", "--auth=trust",
                  "--encoding=UTF8", "--locale=C", "--no-sync", "--no-instructions")
        options = f"-k {self.socket_dir} -c listen_addresses='' -p {self.port} -F -c full_page_writes=off"
        self._run(self.binaries["pg_ctl"], "-D", str(self.data_dir), "-l", str(self.log_file),
                  "-o", options, "-w", "-t", "60", "start")

    def stop(self) -> None:
        try:
            self._run(self.binaries["pg_ctl"], "-D", str(self.data_dir), "-m", "immediate", "-w", "stop", timeout=60)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@/{database}?host={self.socket_dir}&port={self.port}"

    def admin_connection(self):
        import psycopg

        return psycopg.connect(host=str(self.socket_dir), port=self.port, user="postgres", dbname="postgres",
                               autocommit=True)

    def create_database(self, template: str = "template0") -> str:
        name = f"lineage_{uuid.uuid4().hex[:12]}"
        with self.admin_connection() as admin:
            # FILE_COPY (PostgreSQL 15+) clones a small template in half the time of WAL_LOG.
            strategy = " STRATEGY FILE_COPY" if admin.info.server_version >= 150000 else ""
            admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"{strategy}')
        return name

    def drop_database(self, name: str) -> None:
        with self.admin_connection() as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _server_user() -> str | None:
    if os.geteuid() != 0:
        return None
    for name in SERVER_USER_CANDIDATES:
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    raise RuntimeError("tests run as root, and initdb refuses root, but there is no 'postgres' OS user "
                       "to run the PostgreSQL server as (install the postgresql package, which creates it)")


@pytest.fixture(scope="session")
def postgres_server():
    binaries = find_postgres_binaries()
    if binaries is None:
        reason = ("PostgreSQL server binaries (initdb, pg_ctl) not found on PATH or in "
                  f"{', '.join(PG_BIN_GLOBS)}: the PostgreSQL lineage tests did NOT run "
                  "(install the postgresql server package)")
        _pg_skip_reason.append(reason)
        warnings.warn(reason, stacklevel=1)
        pytest.skip(reason)
    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.fail("psycopg (3) is not installed; install the project with its 'postgres' or 'dev' extra")
    root = Path(tempfile.mkdtemp(prefix="reshard-pg-"))
    server = PostgresServer(binaries=binaries, root=root, run_as=_server_user())
    try:
        server.start()
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    yield server
    server.stop()


@pytest.fixture(scope="session")
def postgres_migrated_template(postgres_server: PostgresServer) -> str:
    """A database at the migration head, cloned for tests that start from a ready schema."""
    from reshard_job.lineage import LineageStore

    name = postgres_server.create_database()
    with LineageStore(postgres_server.url(name)) as lineage:
        lineage.ensure_schema()
    return name


@pytest.fixture
def postgres_url(postgres_server: PostgresServer):
    """A fresh, empty database on the session's server; dropped after the test."""
    name = postgres_server.create_database()
    yield postgres_server.url(name)
    postgres_server.drop_database(name)


@pytest.fixture
def postgres_migrated_url(postgres_server: PostgresServer, postgres_migrated_template: str):
    """A fresh database already at the migration head; dropped after the test."""
    name = postgres_server.create_database(template=postgres_migrated_template)
    yield postgres_server.url(name)
    postgres_server.drop_database(name)


_missing_program_skips: list[str] = []


@pytest.fixture(scope="session")
def skip_loudly() -> Callable[[str], None]:
    """Skip a test for a missing program, with a warning and a line in the run's summary."""

    def skip(reason: str) -> None:
        _missing_program_skips.append(reason)
        warnings.warn(reason, stacklevel=2)
        pytest.skip(reason)

    return skip


def pytest_terminal_summary(terminalreporter):
    for reason in dict.fromkeys(_pg_skip_reason):
        terminalreporter.write_sep("!", "PostgreSQL tests skipped", yellow=True, bold=True)
        terminalreporter.write_line(reason, yellow=True, bold=True)
    for reason in dict.fromkeys(_missing_program_skips):
        terminalreporter.write_sep("!", "tests skipped for a missing program", yellow=True, bold=True)
        terminalreporter.write_line(reason, yellow=True, bold=True)


# -- databases per backend ---------------------------------------------------------------------

BACKENDS = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def db_url(backend, request, tmp_path) -> str:
    """An empty database (no schema), once on SQLite and once on PostgreSQL."""
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'runs' / 'lineage.db'}"
    return request.getfixturevalue("postgres_url")


@pytest.fixture
def store(backend, request, tmp_path):
    """A store on a database at the migration head, once on SQLite and once on PostgreSQL."""
    from reshard_job.lineage import LineageStore

    if backend == "sqlite":
        url = f"sqlite:///{tmp_path / 'runs' / 'lineage.db'}"
    else:
        url = request.getfixturevalue("postgres_migrated_url")
    lineage = LineageStore(url)
    lineage.ensure_schema()
    yield lineage
    lineage.close()


def recorded_run(store, run_id: str) -> dict | None:
    """Everything recorded about one run as a plain, JSON-serialisable dict (None if unknown),
    read as the audit side reads it: the store only records (it never imports the read side)."""
    from reshard_job.audit.queries import run_details
    from reshard_job.lineage import UnknownRunError

    with store.read_session() as session:
        try:
            return run_details(session, run_id).to_json()
        except UnknownRunError:
            return None


@pytest.fixture(scope="session")
def get_run() -> Callable:
    """``recorded_run(store, run_id)`` for tests (test modules cannot import a conftest)."""
    return recorded_run


# -- synthetic files and runs ------------------------------------------------------------------

@dataclass
class TwoHopLineage:
    """Run A (8→4) and run B (4→2, fed a copy of one of A's outputs), recorded in a store."""

    run_a: str
    run_b: str
    sources: list  # FileRecord of the 8 original source checkpoints
    source_strategy: object
    outputs_a: list  # FileRecord of A's outputs (4 checkpoints, strategy, manifest)
    copied: object  # FileRecord of the copy of A's rank-0 output that B read
    outputs_b: list
    final: object  # FileRecord of B's rank-0 output


def write_file(path: Path, data: bytes, kind: str, rank: int | None = None):
    from reshard_job.lineage import FileRecord

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return FileRecord.from_file(str(path), kind, rank)


def fake_plan(source_devices: int, target_devices: int) -> dict:
    ratio = source_devices // target_devices
    ranks = []
    for target in range(target_devices):
        sources = list(range(target * ratio, (target + 1) * ratio))
        ranks.append({
            "target_rank": target, "source_ranks": sources, "bytes_read": 100 * len(sources),
            "bytes_written": 100, "largest_slice": 50,
            "params": [{"name": "layer1.weight", "action": "reshard",
                        "copies": [{"source_rank": s, "source_box": [[0, 4], [0, 8]],
                                    "target_box": [[4 * i, 4 * i + 4], [0, 8]]} for i, s in enumerate(sources)]}],
        })
    return {"version": 1,
            "source": {"devices": source_devices, "stage_devices": source_devices, "stages": 1},
            "target": {"devices": target_devices, "stage_devices": target_devices, "stages": 1},
            "ranks": ranks,
            "omitted": [{"name": "accu_grads.layer1.weight", "reason": "optimizer state not requested"}]}


def write_manifest(path: Path, run_id: str, checkpoints: list, strategy) -> object:
    """A manifest.json as the job writes it: the outputs it lists, by absolute path and sha256."""
    import json

    listed = [{"rank": f.rank, "path": f.path, "size": f.size, "sha256": f.sha256} for f in checkpoints]
    manifest = {"manifest_version": 1, "run_id": run_id,
                "target": {"devices": len(checkpoints), "files": listed,
                           "strategy": {"path": strategy.path, "size": strategy.size, "sha256": strategy.sha256}}}
    return write_file(path, json.dumps(manifest, indent=1).encode(), "manifest")


def record_two_hop(store, root: Path) -> TwoHopLineage:
    sources = [write_file(root / "src" / f"rank_{r}" / f"checkpoint_{r}.ckpt", f"source rank {r} ".encode() * 64,
                          "source_checkpoint", r) for r in range(8)]
    source_strategy = write_file(root / "src" / "strategy.ckpt", b"strategy for 8 ranks", "strategy")

    run_a = store.start_run(config={"source": {"checkpoints": str(root / "src")}, "target": {"devices": 4}},
                            overrides=["target.devices=4"], tool_version="0.1.0", output_dir=str(root / "out_a"),
                            source_devices=8, target_devices=4)
    store.record_inputs(run_a, sources + [source_strategy])
    checkpoints_a = [write_file(root / "out_a" / f"rank_{r}" / f"checkpoint_{r}.ckpt",
                                f"hop A output rank {r} ".encode() * 64, "target_checkpoint", r) for r in range(4)]
    strategy_a = write_file(root / "out_a" / "strategy.ckpt", b"strategy for 4 ranks", "strategy")
    manifest_a = write_manifest(root / "out_a" / "manifest.json", run_a, checkpoints_a, strategy_a)
    outputs_a = checkpoints_a + [strategy_a, manifest_a]
    store.complete_run(run_a, outputs=outputs_a, plan=fake_plan(8, 4))

    # One output is copied elsewhere before being converted again: lineage must follow content.
    copy_path = root / "elsewhere" / "copied_checkpoint_0.ckpt"
    copy_path.parent.mkdir(parents=True)
    shutil.copyfile(checkpoints_a[0].path, copy_path)
    from reshard_job.lineage import FileRecord

    copied = FileRecord.from_file(str(copy_path), "source_checkpoint", 0)
    inputs_b = [copied] + [FileRecord.from_file(f.path, "source_checkpoint", f.rank) for f in checkpoints_a[1:]]
    run_b = store.start_run(config={"target": {"devices": 2}}, overrides=["target.devices=2"], tool_version="0.1.0",
                            output_dir=str(root / "out_b"), source_devices=4, target_devices=2,
                            sweep_id="sweep-1", job_num=1)
    store.record_inputs(run_b, inputs_b + [strategy_a])
    checkpoints_b = [write_file(root / "out_b" / f"rank_{r}" / f"checkpoint_{r}.ckpt",
                                f"hop B output rank {r} ".encode() * 64, "target_checkpoint", r) for r in range(2)]
    strategy_b = write_file(root / "out_b" / "strategy.ckpt", b"strategy for 2 ranks", "strategy")
    outputs_b = checkpoints_b + [strategy_b,
                                 write_manifest(root / "out_b" / "manifest.json", run_b, checkpoints_b, strategy_b)]
    store.complete_run(run_b, outputs=outputs_b, plan=fake_plan(4, 2))
    return TwoHopLineage(run_a=run_a, run_b=run_b, sources=sources, source_strategy=source_strategy,
                         outputs_a=outputs_a, copied=copied, outputs_b=outputs_b, final=checkpoints_b[0])


@pytest.fixture(scope="session")
def record_lineage() -> Callable:
    """``record_two_hop`` for fixtures of any scope (test modules cannot import a conftest)."""
    return record_two_hop


@pytest.fixture
def two_hop(store, tmp_path) -> TwoHopLineage:
    return record_two_hop(store, tmp_path / "files")


@pytest.fixture
def make_file() -> Callable:
    return write_file


@pytest.fixture
def make_plan() -> Callable:
    return fake_plan
