"""Connecting to the lineage database: URLs, engines, and riding out write contention.

Any SQLAlchemy URL works; two backends are first-class:

* SQLite (the default, ``runs/lineage.db`` under the launch directory). Many sweep jobs on one
  machine write to the same file, so every connection gets ``foreign_keys=ON`` (off by default
  in SQLite), WAL (readers never block the single writer) and a busy timeout. Write
  transactions start with ``BEGIN IMMEDIATE``: a deferred transaction that reads first and then
  writes can fail at once with "database is locked" when another writer committed in between,
  without waiting for the busy timeout; taking the write lock up front makes writers queue
  instead. Reads keep plain deferred ``BEGIN`` so audits never block jobs.
* PostgreSQL through psycopg 3 (``postgresql+psycopg://``), for sweeps spread over machines.

Transactions are kept short (one store call each) and retried with jittered exponential backoff
on the transient failures both backends report under contention: SQLite's "database is
locked"/"busy", PostgreSQL's deadlock and serialization failures. SQLite's busy timeout is a
slice (``waiting.BUSY_SLICE_SECONDS``), not the whole wait: a database held by another process is
waited for from Python, attempt after attempt, within a budget and stoppable by a signal
(``waiting``), since a wait inside SQLite's busy handler could be neither bounded nor interrupted.
"""

from __future__ import annotations

import json
import os
import random
import time
import warnings
from typing import Callable, TypeVar

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError, OperationalError

from reshard_job.lineage.urls import (  # noqa: F401 - where callers found them
    DEFAULT_SQLITE_PATH, LEGACY_URL_ENV_VAR, URL_ENV_VAR, default_url, sqlite_url, url_from_environment)
from reshard_job.lineage.waiting import BUSY_SLICE_SECONDS, LockWait
from reshard_job.storage.local_files import make_folder

SQLITE_BUSY_TIMEOUT_S = 30.0  # readers (the audit): a WAL database never makes them wait for a writer
POSTGRES_CONNECT_TIMEOUT_S = 10
# Options on a connection that will write; read by the "begin" hook below.
WRITE_OPTION = "reshard_lineage_write"

_T = TypeVar("_T")


def normalize_url(url: str | URL) -> URL:
    """Parse `url`; a relative SQLite path becomes absolute (relative to the current directory).

    A bare ``postgresql://`` URL means psycopg 3, the driver this project installs (SQLAlchemy
    2.0 would otherwise pick psycopg2).
    """
    try:
        parsed = make_url(url)
    except ArgumentError:
        from reshard_job.lineage.errors import LineageError
        from reshard_job.secrets import mask_url

        raise LineageError(f"lineage database URL {mask_url(str(url))!r:.200} is not a database URL (sqlite:///PATH, "
                           f"postgresql+psycopg://USER@HOST/DB)") from None
    if parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database
        if database and database != ":memory:" and not database.startswith("file:"):
            parsed = parsed.set(database=os.path.abspath(database))
    return parsed


def sqlite_file(url: URL) -> str | None:
    """The database file of an SQLite URL, or None for other backends and in-memory databases."""
    if url.get_backend_name() != "sqlite":
        return None
    database = url.database
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    return database


SQLITE_MAGIC = b"SQLite format 3\x00"


def check_sqlite_file(database_file: str, shown: str | None = None, hint: str = "") -> None:
    """Refuse, in one line saying what it looks like, a file that is not an SQLite database (a
    checkpoint or a manifest given as the database); SQLite would only say "file is not a database".
    Nothing there, or an empty file (SQLite's empty database), passes. `shown`: the database's URL
    as messages give it; `hint` ends the message."""
    import stat

    from reshard_job.lineage.errors import LineageError

    shown = shown or sqlite_url(database_file)
    if os.path.isdir(database_file):
        raise LineageError(f"lineage database {shown}: is a directory, not a lineage database (give the SQLite "
                           f"file){hint}")
    try:  # O_NONBLOCK: a FIFO given as the database does not block the open
        fd = os.open(database_file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return  # absent (SQLite creates it), no permission: SQLite says what is wrong
    try:
        head = os.read(fd, 64) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
    except OSError:
        head = b""
    finally:
        os.close(fd)
    if not head or head.startswith(SQLITE_MAGIC):
        return
    raise LineageError(f"lineage database {shown}: not a lineage database (it looks like "
                       f"{_looks_like(database_file, head)}, not an SQLite file){hint}")


def _looks_like(name: str, head: bytes) -> str:
    lower = name.lower()
    if lower.endswith(".ckpt") and head[:1] in (b"\x0a", b"\x08", b"\x12"):
        return "a MindSpore checkpoint" if head[:1] == b"\x0a" else "a MindSpore strategy file"
    if len(head) > 8 and head[8:9] == b"{" and lower.endswith(".safetensors"):
        return "a safetensors file"
    if head.lstrip()[:1] in (b"{", b"["):
        return "a JSON file"
    if lower.endswith((".ckpt", ".safetensors")):
        return f"a {lower.rsplit('.', 1)[1]} file"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return "binary data"
    return "a text file" if all(c.isprintable() or c in "\t\r\n" for c in text) else "binary data"


def json_text(value) -> str:
    """How the engine serializes JSON columns: text already made (``store.JSONText``, a plan
    written in pieces) as it is, anything else with ``json.dumps``."""
    if isinstance(value, str) and hasattr(value, "value"):
        return str(value)
    return json.dumps(value)


def _not_a_file(path: str | None) -> str | None:
    """What `path` is when something other than a regular file is there (None: a file, or nothing yet)."""
    import stat

    from reshard_job.storage.local import describe_other

    try:
        mode = os.stat(path).st_mode if path else None
    except OSError:
        return None
    if mode is None or stat.S_ISREG(mode):
        return None
    return "a directory" if stat.S_ISDIR(mode) else describe_other(mode)


def create_lineage_engine(url: str | URL, *, read_only: bool = False, wait: LockWait | None = None) -> Engine:
    """An engine for `url` with the per-backend settings described in the module docstring;
    `read_only` opens an SQLite file without writing to it (see ``_sqlite_read_only``); `wait`: the
    lock-wait budget its connections share (``waiting``)."""
    from reshard_job.lineage.errors import LineageError
    from reshard_job.lineage.urls import IN_MEMORY, in_memory_database

    parsed = normalize_url(url)
    if parsed.get_backend_name() == "sqlite" and in_memory_database(
            parsed.database, "&".join(f"{k}={v}" for k, v in parsed.query.items())):
        raise LineageError(f"lineage database {_shown(parsed)}: {IN_MEMORY}")
    kwargs: dict = {"future": True, "json_serializer": json_text}
    if parsed.get_backend_name() == "sqlite":
        database_file = sqlite_file(parsed)
        odd = _not_a_file(database_file)
        if odd:  # /dev/null, a folder, a FIFO: nothing to keep records in (and no lock file beside it)
            raise LineageError(f"lineage database {_shown(parsed)}: {database_file} is {odd}, not a database file")
        if read_only and database_file is not None:
            return _sqlite_read_only(database_file, kwargs)
        kwargs["connect_args"] = {"timeout": BUSY_SLICE_SECONDS}
    elif parsed.get_backend_name() == "postgresql":
        # A connection that died with its server (restarts, failovers) is replaced silently;
        # an unreachable server is reported after a bounded wait, not the driver's minutes.
        kwargs["pool_pre_ping"] = True
        kwargs["connect_args"] = {"connect_timeout": POSTGRES_CONNECT_TIMEOUT_S}
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            engine = create_engine(parsed, **kwargs)
    except NoSuchModuleError:  # a scheme SQLAlchemy knows no dialect of
        raise LineageError(f"lineage database {_shown(parsed)}: no database of that kind is known; the lineage "
                           f"database is SQLite (sqlite:///PATH) or PostgreSQL (postgresql+psycopg://...)") from None
    except ImportError as e:  # a database kind whose driver is not installed (mysql://: MySQLdb)
        raise LineageError(f"lineage database {_shown(parsed)}: its driver is not installed ({e}); the lineage "
                           f"database is SQLite (sqlite:///PATH) or PostgreSQL (postgresql+psycopg://...)") from None
    ignored = [str(w.message) for w in said if "not accepted" in str(w.message)]
    if ignored:  # SQLAlchemy would ignore them with a warning (sqlite:///x.db?mode=ro written to all the same)
        raise LineageError(f"lineage database {_shown(parsed)}: {ignored[0].rstrip('.')}; give the URL without them")
    if parsed.get_backend_name() == "sqlite":
        _configure_sqlite(engine, wait or LockWait(_shown(engine.url)))
    return engine


def _sqlite_read_only(database_file: str, kwargs: dict) -> Engine:
    """An SQLite file opened for reading only (``mode=ro``; ``immutable=1`` where the file or its
    folder cannot be written, since a WAL database otherwise needs to create its index file).
    No pragma that writes (journal mode) is issued."""
    import sqlite3
    from urllib.parse import quote

    writable = os.access(database_file, os.W_OK) and os.access(os.path.dirname(database_file) or ".", os.W_OK)
    uri = f"file:{quote(os.path.abspath(database_file))}?mode=ro" + ("" if writable else "&immutable=1")
    timeout = SQLITE_BUSY_TIMEOUT_S
    # the URL names the file in messages; the creator is what connects (read-only)
    connect = lambda: sqlite3.connect(uri, uri=True, timeout=timeout, check_same_thread=False)  # noqa: E731
    engine = create_engine(URL.create("sqlite", database=database_file), creator=connect, future=True,
                           json_serializer=json_text)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record):
        dbapi_connection.isolation_level = None
        dbapi_connection.execute(f"PRAGMA busy_timeout = {int(SQLITE_BUSY_TIMEOUT_S * 1000)}")

    @event.listens_for(engine, "begin")
    def _on_begin(connection):
        connection.exec_driver_sql("BEGIN")

    return engine


def writer(engine: Engine) -> Engine:
    """A view of `engine` whose transactions take the write lock up front (on SQLite)."""
    return engine.execution_options(**{WRITE_OPTION: True})


def _configure_sqlite(engine: Engine, wait: LockWait) -> None:
    database_file = sqlite_file(engine.url)

    @event.listens_for(engine, "do_connect")
    def _create_directory(_dialect, _record, _cargs, _cparams):
        # The default database lives in runs/, which a fresh checkout or launch directory may
        # not have yet; SQLite creates the file but not its directory.
        if database_file is not None:
            make_folder(os.path.dirname(database_file))

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record):
        # Let SQLAlchemy, not the sqlite3 module, decide when transactions begin (see "begin").
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {int(BUSY_SLICE_SECONDS * 1000)}")
            cursor.execute("PRAGMA foreign_keys = ON")
            if database_file is not None:
                # Switching to WAL needs a moment of exclusive access; the setting is stored in
                # the file, so only the first connection ever really changes anything.
                _retry_sqlite_pragma(cursor, "PRAGMA journal_mode = WAL", wait)
                cursor.execute("PRAGMA synchronous = NORMAL")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection):
        immediate = connection.get_execution_options().get(WRITE_OPTION, False)
        connection.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


def _retry_sqlite_pragma(cursor, statement: str, wait: LockWait) -> None:
    for attempt in range(1 << 30):
        started = time.monotonic()
        try:
            cursor.execute(statement)
            return
        except Exception as exc:  # sqlite3.OperationalError; the module is not imported here
            if not _is_sqlite_busy_message(str(exc)):
                raise
            wait.pause(time.monotonic() - started, attempt)


def _shown(url: URL) -> str:
    return url.render_as_string(hide_password=True)


def _is_sqlite_busy_message(message: str) -> bool:
    message = message.lower()
    return "database is locked" in message or "database is busy" in message or "database table is locked" in message


# SQLSTATEs PostgreSQL uses for "try the transaction again": serialization failure, deadlock.
_RETRYABLE_SQLSTATES = {"40001", "40P01"}


def is_transient(exc: BaseException) -> bool:
    """Whether `exc` is contention that a retry of the whole transaction can resolve."""
    if isinstance(exc, OperationalError) and _is_sqlite_busy_message(str(exc.orig)):
        return True
    if isinstance(exc, DBAPIError):
        sqlstate = getattr(exc.orig, "sqlstate", None) or getattr(exc.orig, "pgcode", None)
        return sqlstate in _RETRYABLE_SQLSTATES
    return False


def retry_transient(operation: Callable[[], _T], *, attempts: int = 10, base_delay: float = 0.05,
                    max_delay: float = 2.0, wait: LockWait | None = None) -> _T:
    """Run `operation` (one whole transaction), retrying on transient contention with backoff.

    SQLite's "database is locked" is retried as long as `wait` allows (its budget, a stop request:
    ``waiting``); other transient failures (PostgreSQL's deadlocks) up to `attempts` times. Jitter
    keeps jobs that collided once from colliding again in lockstep.
    """
    wait = wait or LockWait("(SQLite)")
    tries = 0
    for attempt in range(1 << 30):
        started = time.monotonic()
        try:
            return operation()
        except DBAPIError as exc:
            if not is_transient(exc):
                raise
            if _is_sqlite_busy_message(str(exc.orig)):
                wait.pause(time.monotonic() - started, attempt)
                continue
            tries += 1
            if tries == attempts:
                raise
            time.sleep(min(base_delay * 2 ** (tries - 1), max_delay) * random.uniform(0.5, 1.0))
    raise AssertionError("unreachable")
