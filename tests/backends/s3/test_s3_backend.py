"""What only the object-store back end has: request counts, killed uploads, leases, store errors.

All against the SeaweedFS server of ``conftest.py``; requests are counted by the reader itself
(``ObjectReader.requests``), which counts the GETs it really sends.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from reshard_job.formats import wire
from reshard_job.storage import LockedError, SourceChangedError, StorageError, StorageOptions, storage_for
from reshard_job.storage.local import LocalFile
from reshard_job.storage.remote import S3Storage, split_url
from reshard_job.storage.s3lock import LOCK_NAME, LeaseRecord

GOLDEN_CKPT = Path(__file__).parents[2] / "golden" / "S1_mlp_tutorial_8to4" / "src_checkpoints" / "rank_0" / \
    "checkpoint_0.ckpt"
FAST_FAIL = {"retries": {"max_attempts": 1, "mode": "standard"}, "connect_timeout": 2, "read_timeout": 5}


def one_line(err: BaseException, *needles: str, forbidden: tuple[str, ...] = ()) -> str:
    text = str(err)
    assert "\n" not in text and len(text) < 400, text
    for needle in needles:
        assert needle in text, (needle, text)
    for secret in forbidden:
        assert secret not in text, text
    return text


def put(store: S3Storage, url: str, data: bytes) -> None:
    _, bucket, key = split_url(url)
    store.call_raw("put_object", Bucket=bucket, Key=key, Body=data)


def multipart_uploads(store: S3Storage, url: str) -> list[str]:
    _, bucket, key = split_url(url)
    return [u["Key"] for u in store.call_raw("list_multipart_uploads", Bucket=bucket, Prefix=key).get("Uploads") or ()]


# ---------------------------------------------------------------------------------- reads


def test_many_small_ranges_become_few_requests(s3_store, s3_prefix):
    data = os.urandom(20 * 1024 * 1024)
    url = f"{s3_prefix}/big.bin"
    put(s3_store, url, data)
    ranges = [(i * 2000, 100) for i in range(1000)]  # 1000 ranges within 2 MB
    ranges += [(15_000_000 + i * 4096, 4096) for i in range(200)]
    with s3_store.open_read(url) as f:
        got = f.read_ranges(ranges)
        assert got == [data[o:o + n] for o, n in ranges]
        assert f.requests <= 3, f.requests
        assert f.bytes_fetched < 4 * 1024 * 1024  # gaps of a few KiB read, the 13 MB between groups not


def test_large_range_is_split_into_parallel_requests(s3_store, s3_prefix):
    data = os.urandom(20 * 1024 * 1024 + 3)
    url = f"{s3_prefix}/big.bin"
    put(s3_store, url, data)
    with s3_store.open_read(url) as f:
        buf = bytearray(len(data) - 1)
        assert f.pread_into(1, memoryview(buf)) == len(data) - 1
        assert bytes(buf) == data[1:]
        assert f.requests == 3  # 8 + 8 + 4 MiB
        assert f.bytes_fetched == len(data) - 1


def test_sequential_small_reads_use_a_growing_window(s3_store, s3_prefix):
    data = os.urandom(2 * 1024 * 1024)
    url = f"{s3_prefix}/walk.bin"
    put(s3_store, url, data)
    with s3_store.open_read(url) as f:
        pos = 0
        while pos < len(data):  # 16-byte reads every 200 bytes: like walking small records
            buf = bytearray(16)
            n = f.pread_into(pos, memoryview(buf))
            assert bytes(buf[:n]) == data[pos:pos + n]
            pos += 200
        # 10486 reads; window 64 KiB, 128 KiB, ... 1 MiB, then 4 MiB
        assert f.requests <= 6, f.requests


def test_header_walk_over_large_records_reads_no_record_bodies(s3_store, s3_prefix):
    record = 3 * 1024 * 1024
    data = os.urandom(20 * record)
    url = f"{s3_prefix}/records.bin"
    put(s3_store, url, data)
    with s3_store.open_read(url) as f:
        for i in range(20):
            buf = bytearray(32)
            f.pread_into(i * record, memoryview(buf))
            assert bytes(buf) == data[i * record:i * record + 32]
        assert f.requests == 20
        assert f.bytes_fetched <= 20 * 64 * 1024  # never the 60 MiB of bodies


def _walk_records(f, limit: int) -> list[tuple[int, int, int]]:
    """(offset, key, length) of each top-level record of a .ckpt: 16-byte header reads only."""
    out, pos = [], 0
    while pos < f.size and len(out) < limit:
        head = bytearray(16)
        n = f.pread_into(pos, memoryview(head))
        if n < 2 or head[0] != 0x0A:  # the CRC trailer, if any
            break
        length, after = wire.decode_varint(head, 1, n)
        out.append((pos, head[0], length))
        pos += after + length
    return out


def test_golden_checkpoint_read_through_the_object_store_matches_the_file(s3_store, s3_prefix):
    data = GOLDEN_CKPT.read_bytes()
    url = f"{s3_prefix}/rank_0/checkpoint_0.ckpt"
    assert s3_store.write_bytes(url, data) == (len(data), hashlib.sha256(data).hexdigest())
    local = LocalFile(str(GOLDEN_CKPT))
    with s3_store.open_read(url) as remote, local:
        assert remote.size == local.size
        records = _walk_records(remote, 10_000)
        assert records == _walk_records(local, 10_000)
        assert len(records) > 5
        assert remote.requests < len(records)  # the index walk does not cost a GET per record
        ranges = [(offset, length + 4) for offset, _, length in records]
        ranges += [(0, local.size), (local.size - 17, 17), (123, 4567)]
        assert remote.read_ranges(ranges) == local.read_ranges(ranges)


def test_object_replaced_after_open_is_detected(s3_store, s3_prefix):
    url = f"{s3_prefix}/src.ckpt"
    put(s3_store, url, b"A" * 300_000)
    with s3_store.open_read(url) as f:
        buf = bytearray(10)
        f.pread_into(0, memoryview(buf))  # window now holds the first 64 KiB
        put(s3_store, url, b"B" * 300_000)  # same size, new content
        f.pread_into(100, memoryview(buf))  # served from the window: the bytes of the version opened
        assert bytes(buf) == b"A" * 10
        with pytest.raises(SourceChangedError) as err:
            f.pread_into(200_000, memoryview(buf))
        one_line(err.value, url, "changed")
        with pytest.raises(SourceChangedError):
            f.read_ranges([(0, 10)])
    assert s3_store.info(url).identity != f.identity


def test_object_deleted_after_open_is_detected(s3_store, s3_prefix):
    url = f"{s3_prefix}/src.ckpt"
    put(s3_store, url, b"A" * 1000)
    with s3_store.open_read(url) as f:
        s3_store.remove(url)
        with pytest.raises(SourceChangedError) as err:
            f.read_ranges([(0, 10)])
    one_line(err.value, url, "deleted")


# ---------------------------------------------------------------------------------- writes


CHILD_UPLOAD = textwrap.dedent("""
    import os, sys, time
    from reshard_job.storage.remote import S3Storage
    store = S3Storage(endpoint_url=os.environ["T_ENDPOINT"],
                      options={"key": os.environ["T_KEY"], "secret": os.environ["T_SECRET"]},
                      part_size=5 * 1024 * 1024)
    w = store.create(sys.argv[1], large=True)
    w.write(os.urandom(11 * 1024 * 1024))  # two parts sent, a third being filled
    w._wait(0)
    print("uploading", flush=True)
    time.sleep(120)
""")


def _child(code: str, *args: str, server) -> subprocess.Popen:
    key, secret = server.credentials["admin"]
    env = {**os.environ, "T_ENDPOINT": server.endpoint, "T_KEY": key, "T_SECRET": secret,
           "PYTHONPATH": str(Path(__file__).parents[3])}
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True, env=env)


def _kill(child: subprocess.Popen) -> None:
    if child.poll() is None:
        child.kill()
    child.wait(timeout=30)


def test_kill_9_mid_upload_leaves_no_object_and_the_upload_is_aborted(s3_server, s3_store, s3_prefix):
    url = f"{s3_prefix}/rank_0/checkpoint_0.ckpt"
    child = _child(CHILD_UPLOAD, url, server=s3_server)
    try:
        assert child.stdout.readline().strip() == "uploading"
        os.kill(child.pid, 9)
    finally:
        _kill(child)
    assert s3_store.info(url) is None
    assert s3_store.info(f"{s3_prefix}/rank_0") is None  # nothing visible under the prefix at all
    assert multipart_uploads(s3_store, s3_prefix) == [split_url(url)[2]]
    assert s3_store.remove_incomplete(s3_prefix, ["rank_0"]) == 1
    assert multipart_uploads(s3_store, s3_prefix) == []
    # a rerun writes the object as if nothing had happened
    assert s3_store.write_bytes(url, b"done")[0] == 4
    assert s3_store.read_bytes(url, 10) == b"done"


def test_part_sizes_grow_so_huge_objects_fit_in_10000_parts(s3_store, s3_prefix):
    from reshard_job.storage import s3upload

    w = S3Storage().create(f"{s3_prefix}/never.ckpt", large=True)  # the default part size; nothing is sent
    base = w._part_size()
    assert base == s3upload.PART_SIZE
    w._parts = [{}] * (s3upload.PARTS_PER_DOUBLING * 3)
    assert w._part_size() == base * 8
    total = sum(base << (n // s3upload.PARTS_PER_DOUBLING) for n in range(10_000))
    assert total > 1024 ** 4 * 7  # about 8 TiB with 8 MiB first parts
    w._parts = []
    w.abort()


def test_part_buffers_are_filled_again_and_the_object_is_exact(s3_store, s3_prefix, monkeypatch):
    """Parts of two sizes (doubling after four), writes that straddle parts, a short last part:
    the buffers of sent parts are filled again, and the object is the bytes written, in order."""
    from reshard_job.storage import s3upload

    monkeypatch.setattr(s3upload, "PARTS_PER_DOUBLING", 4)
    data = os.urandom(23 * 1024 * 1024 + 12345)  # four parts of 5 MiB and a short last one (of 10)
    url = f"{s3_prefix}/parts.ckpt"
    w = s3_store.create(url, large=True)
    allocated = []
    real_new = w._new_buffer
    monkeypatch.setattr(w, "_new_buffer", lambda size: allocated.append(buf := real_new(size)) or buf)
    pos, step = 0, 777_777
    while pos < len(data):
        w.write(data[pos:pos + step])
        pos += step
        assert len(w._spare) <= w._max_in_flight
    assert w.commit() == (len(data), hashlib.sha256(data).hexdigest())
    assert len(w._parts) == 5
    # one part filled while two are sent: the fourth is filled in the first one's buffer (sent by
    # then); the last part needs a buffer of 10 MiB
    assert len(allocated) == 5 and allocated[3] is allocated[0]
    assert len({id(b) for b in allocated}) == 4 and len(allocated[4]) == 10 * 1024 * 1024
    assert s3_store.read_bytes(url, len(data)) == data


def test_failed_upload_is_aborted_and_reported_in_one_line(s3_server, s3_prefix):
    reader = S3Storage(endpoint_url=s3_server.endpoint, options=s3_server.options("reader"),
                       part_size=5 * 1024 * 1024)
    w = reader.create(f"{s3_prefix}/out.ckpt", large=True)
    with pytest.raises(StorageError) as err:
        w.write(os.urandom(6 * 1024 * 1024))
    one_line(err.value, f"{s3_prefix}/out.ckpt", "access denied", forbidden=(s3_server.credentials["reader"][1],))
    w.abort()  # already aborted: nothing more to do


# ---------------------------------------------------------------------------------- lock


def test_the_store_supports_conditional_puts(s3_store, s3_prefix):
    _, bucket, key = split_url(s3_prefix)
    assert s3_store.conditional_put(bucket, key, s3_prefix) is True
    assert s3_store.listdir(s3_prefix.rsplit("/", 1)[0]) is not None
    assert s3_store.info(f"{s3_prefix}/.reshard_job") is None  # the probe object was removed


CHILD_LOCK = textwrap.dedent("""
    import os, sys, time
    from reshard_job.storage.remote import S3Storage
    store = S3Storage(endpoint_url=os.environ["T_ENDPOINT"],
                      options={"key": os.environ["T_KEY"], "secret": os.environ["T_SECRET"]})
    lock = store.lock(sys.argv[1], f"pid {os.getpid()} on the child")
    print("locked", flush=True)
    time.sleep(120)
""")


def test_lock_held_by_another_process_then_taken_over_after_kill_9(s3_server, s3_store, s3_prefix):
    child = _child(CHILD_LOCK, s3_prefix, server=s3_server)
    try:
        assert child.stdout.readline().strip() == "locked"
        with pytest.raises(LockedError) as err:
            s3_store.lock(s3_prefix, "the parent")
        one_line(err.value, s3_prefix, f"pid {child.pid} on the child")
        os.kill(child.pid, 9)
        child.wait(timeout=30)
        # same host, holder process gone: no need to wait for the lease to run out
        lock = s3_store.lock(s3_prefix, "the parent")
    finally:
        _kill(child)
    lock.release()
    assert s3_store.info(f"{s3_prefix}/{LOCK_NAME}") is None


def test_lease_is_renewed_while_held(s3_server, s3_prefix):
    store = S3Storage(endpoint_url=s3_server.endpoint, options=s3_server.options(), lease_seconds=1.0)
    lock = store.lock(s3_prefix, "long job")
    try:
        time.sleep(3.5)  # more than the lease plus its grace: only renewal keeps the lock
        with pytest.raises(LockedError):
            store.lock(s3_prefix, "second job")
        assert not lock.lost
    finally:
        lock.release()


def test_expired_lease_of_another_host_is_taken_over(s3_store, s3_prefix):
    _, bucket, key = split_url(s3_prefix)
    stale = LeaseRecord("pid 4242 on elsewhere", "elsewhere", 4242, uuid.uuid4().hex, 1.0)
    s3_store.call_raw("put_object", Bucket=bucket, Key=f"{key}/{LOCK_NAME}", Body=stale.to_bytes())
    with pytest.raises(LockedError) as err:
        s3_store.lock(s3_prefix, "new job")
    one_line(err.value, "pid 4242 on elsewhere")
    time.sleep(3.2)  # the lease (1 s) and its grace (1 s) pass by the store's clock, in whole seconds
    lock = s3_store.lock(s3_prefix, "new job")
    held = json.loads(s3_store.read_bytes(f"{s3_prefix}/{LOCK_NAME}", 10_000))
    assert held["holder"] == "new job" and held["token"] == lock.record.token
    lock.release()


def test_release_after_a_takeover_leaves_the_new_holders_lock(s3_server, s3_prefix):
    store = S3Storage(endpoint_url=s3_server.endpoint, options=s3_server.options(), lease_seconds=1.0)
    stalled = store.lock(s3_prefix, "stalled job")
    stalled._stop_renewing()  # as if its machine froze
    time.sleep(3.2)
    fresh = store.lock(s3_prefix, "fresh job")
    stalled.release()
    with pytest.raises(LockedError) as err:
        store.lock(s3_prefix, "third job")
    one_line(err.value, "fresh job")
    fresh.release()


def test_lease_fallback_without_conditional_puts(s3_server, s3_prefix):
    store = S3Storage(endpoint_url=s3_server.endpoint, options=s3_server.options(), conditional_writes=False,
                      settle_seconds=0.2, lease_seconds=1.0)
    first = store.lock(s3_prefix, "first")
    with pytest.raises(LockedError) as err:
        store.lock(s3_prefix, "second")
    one_line(err.value, "first")
    first._stop_renewing()
    time.sleep(3.2)
    second = store.lock(s3_prefix, "second")
    first.release()  # not its lock any more: must not delete it
    with pytest.raises(LockedError):
        store.lock(s3_prefix, "third")
    second.release()
    store.lock(s3_prefix, "third").release()


# ---------------------------------------------------------------------------------- errors


def test_wrong_credentials(s3_server, s3_store, s3_prefix):
    put(s3_store, f"{s3_prefix}/a.ckpt", b"x")
    bad = S3Storage(endpoint_url=s3_server.endpoint, options=s3_server.options(secret="not-the-secret"))
    actions = {
        "info": lambda: bad.info(f"{s3_prefix}/a.ckpt"),
        "listdir": lambda: bad.listdir(s3_prefix),
        "open_read": lambda: bad.open_read(f"{s3_prefix}/a.ckpt"),
        "write_bytes": lambda: bad.write_bytes(f"{s3_prefix}/b", b"y"),
        "lock": lambda: bad.lock(s3_prefix, "me"),
    }
    for name, action in actions.items():
        with pytest.raises(StorageError) as err:
            action()
        one_line(err.value, s3_prefix, "rejected the credentials", forbidden=("not-the-secret",))


def test_no_permission_to_write(s3_server, s3_store, s3_prefix):
    put(s3_store, f"{s3_prefix}/a.ckpt", b"x")
    reader = S3Storage(endpoint_url=s3_server.endpoint, options=s3_server.options("reader"))
    assert reader.read_bytes(f"{s3_prefix}/a.ckpt", 10) == b"x"  # reading is allowed
    for action in (lambda: reader.write_bytes(f"{s3_prefix}/b", b"y"), lambda: reader.lock(s3_prefix, "me")):
        with pytest.raises(StorageError) as err:
            action()
        one_line(err.value, s3_prefix, "access denied", forbidden=(s3_server.credentials["reader"][1],))


def test_missing_bucket(s3_store):
    url = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/run7/ckpt"
    bucket = split_url(url)[1]
    actions = [lambda: s3_store.info(url), lambda: s3_store.listdir(url), lambda: s3_store.open_read(url + "/x"),
               lambda: s3_store.write_bytes(url + "/x", b"1"), lambda: s3_store.lock(url, "me"),
               lambda: s3_store.remove_incomplete(url), lambda: s3_store.info(f"s3://{bucket}")]
    for action in actions:
        with pytest.raises(StorageError) as err:
            action()
        one_line(err.value, f"s3://{bucket}", f"bucket '{bucket}' does not exist")


def test_unreachable_endpoint_fails_fast_in_one_line():
    import socket

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = S3Storage(endpoint_url=f"http://127.0.0.1:{port}",
                      options={"key": "k", "secret": "s3cr3t-value", "config_kwargs": dict(FAST_FAIL)})
    started = time.monotonic()
    for action in (lambda: store.info("s3://bucket/x"), lambda: store.write_bytes("s3://bucket/x", b"1")):
        with pytest.raises(StorageError) as err:
            action()
        one_line(err.value, "s3://bucket/x", "cannot reach the object store", f"127.0.0.1:{port}",
                 "connection refused", forbidden=("s3cr3t-value",))
    assert time.monotonic() - started < 30


def test_credentials_from_the_standard_environment(s3_server, s3_store, s3_prefix, monkeypatch, tmp_path):
    put(s3_store, f"{s3_prefix}/a", b"hello")
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    key, secret = s3_server.credentials["admin"]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    store = S3Storage()  # no endpoint, no options: the environment says it all
    assert store.read_bytes(f"{s3_prefix}/a", 10) == b"hello"
    assert store.endpoint == s3_server.endpoint


def test_urls_never_show_credentials(s3_store, s3_prefix):
    secret_url = s3_prefix.replace("s3://", "s3://AKIDEXAMPLE:wJalrXUtnFEMI@") + "/missing.ckpt"
    assert "wJalr" not in s3_store.display(secret_url) and s3_store.display(secret_url).startswith("s3://")
    with pytest.raises(FileNotFoundError) as err:
        s3_store.open_read(secret_url)
    assert "wJalr" not in str(err.value)
    options = StorageOptions(endpoint_url="http://127.0.0.1:1", options={"secret": "wJalrXUtnFEMI"})
    assert "wJalr" not in repr(storage_for("s3://b/x", options))


def test_unsupported_scheme_is_one_line():
    with pytest.raises(StorageError) as err:
        storage_for("gs://bucket/x")
    one_line(err.value, "gs://bucket/x", "not supported")


def test_urls_holding_credentials_are_refused_without_showing_them():
    with pytest.raises(StorageError) as err:
        storage_for("s3://AKIDEXAMPLE:wJalrXUtnFEMI@bucket/run7/ckpt")
    one_line(err.value, "s3://bucket/run7/ckpt", "holds credentials", "storage.options", forbidden=("wJalr", "AKID"))


# ---------------------------------------------------------------------------------- processes


async def _collect_garbage() -> None:
    import gc

    gc.collect()


def test_a_forked_child_leaves_the_parents_connections_alone(s3_server, s3_prefix):
    """The child's copy of the parent's client shares the parent's sockets and epoll instance:
    closing it there (s3fs's finaliser does, when the collector frees it on the child's event
    loop thread) would leave the parent waiting for answers until its read timeout."""
    store = S3Storage(endpoint_url=s3_server.endpoint, options=s3_server.options(config_kwargs=FAST_FAIL))
    url = f"{s3_prefix}/object"
    put(store, url, b"payload")
    assert store.read_bytes(url, 100) == b"payload"  # the parent's connections are open and pooled
    pid = os.fork()
    if pid == 0:  # the child: its own client; then the collector runs on its event loop thread
        code = 1
        try:
            code = 0 if store.read_bytes(url, 100) == b"payload" and store.info(url).size == 7 else 3
            store.run(_collect_garbage)
            time.sleep(0.5)  # whatever the collection scheduled on the loop runs now
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    started = time.monotonic()
    for _ in range(5):
        assert store.read_bytes(url, 100) == b"payload"
        assert store.info(url).size == 7
    assert time.monotonic() - started < FAST_FAIL["read_timeout"]


# ---------------------------------------------------------------------------------- the journal's log


def test_append_rewrites_the_log_and_keeps_what_others_wrote(s3_store, s3_prefix):
    url = f"{s3_prefix}/.reshard_job/journal.jsonl"
    s3_store.append(url, b"one\n")
    s3_store.append(url, b"two\n")
    assert s3_store.read_bytes(url, 100) == b"one\ntwo\n"
    put(s3_store, url, b"rewritten by someone else\n")  # not through this store: its memory is stale
    s3_store.append(url, b"three\n")
    assert s3_store.read_bytes(url, 100) == b"rewritten by someone else\nthree\n"
    s3_store.write_bytes(url, b"fresh\n")
    s3_store.append(url, b"four\n")
    assert s3_store.read_bytes(url, 100) == b"fresh\nfour\n"
    other = S3Storage(endpoint_url=s3_store._endpoint_url, options=dict(s3_store._options), conditional_writes=False)
    other.append(url, b"five\n")  # a store without conditional writes compares the ETag first
    other.append(url, b"six\n")
    assert other.read_bytes(url, 100) == b"fresh\nfour\nfive\nsix\n"


def test_announced_reads_are_fetched_in_few_requests_and_only_where_announced(s3_store, s3_prefix):
    data = os.urandom(24 * 1024 * 1024)
    url = f"{s3_prefix}/announced.bin"
    put(s3_store, url, data)
    # what a rank task reads from a file: tiny tensors scattered through its first 2 MiB, and one
    # large slice at the end; nothing from the 20 MiB between
    tiny = [(i * 40_000, 120) for i in range(50)]
    large = [(22 * 1024 * 1024, 1024 * 1024)]
    with s3_store.open_read(url) as f:
        f.expect(tiny + large, 4 * 1024 * 1024)
        for offset, length in tiny + large:
            view = memoryview(bytearray(length))
            assert f.pread_into(offset, view) == length and bytes(view) == data[offset:offset + length]
        assert f.requests <= 3, f.requests
        assert f.bytes_fetched < 4 * 1024 * 1024, f.bytes_fetched
        requests = f.requests
        view = memoryview(bytearray(100))  # a read nobody announced still works, by itself
        assert f.pread_into(10 * 1024 * 1024, view) == 100 and bytes(view) == data[10 * 1024 * 1024:][:100]
        assert f.requests == requests + 1


def test_remote_sources_are_indexed_together_and_the_first_bad_rank_is_named(s3_store, s3_prefix, s3_storage_options,
                                                                             monkeypatch):
    from reshard_job.errors import FormatError
    from reshard_job.sources.open_files import SourceFiles
    from reshard_job.formats.ckpt.reader import CheckpointReader

    golden = GOLDEN_CKPT.parents[1]
    urls, local = {}, {}
    for rank in range(8):
        path = golden / f"rank_{rank}" / f"checkpoint_{rank}.ckpt"
        urls[rank] = f"{s3_prefix}/ok/rank_{rank}/checkpoint_{rank}.ckpt"
        local[rank] = str(path)
        s3_store.write_bytes(urls[rank], path.read_bytes())
    threads = set()
    real_init = CheckpointReader.__init__

    def noting_thread(self, *args, **kwargs):
        import threading

        threads.add(threading.current_thread().name)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(CheckpointReader, "__init__", noting_thread)
    with SourceFiles(urls, verify_crc=False, storage=s3_storage_options) as remote:
        index = remote.index()
        assert len(threads) > 1 and all(name.startswith("index") for name in threads), threads
        with SourceFiles(local, verify_crc=False) as files:
            assert index == files.index()
            assert "MainThread" in threads  # local files: walked in order, by the caller

    bad = dict(urls)
    for rank in (5, 2):  # two broken files: the lower rank is the one named, as a walk in order would
        bad[rank] = f"{s3_prefix}/bad/rank_{rank}/checkpoint_{rank}.ckpt"
        s3_store.write_bytes(bad[rank], b"\x0b" + Path(local[rank]).read_bytes()[1:])
    with SourceFiles(bad, verify_crc=False, storage=s3_storage_options) as remote:
        with pytest.raises(FormatError) as err:
            remote.index()
    one_line(err.value, bad[2], "wrong magic")


def test_remote_sources_are_hashed_in_the_read_that_indexes_them(s3_store, s3_prefix, s3_storage_options):
    from reshard_job.sources.open_files import SourceFiles
    from reshard_job.formats.ckpt import CRC_TRAILER_LEN
    from reshard_job.sources.file_digests import DigestingReader, HashRequest, digest_file, usable_digest

    golden = GOLDEN_CKPT.parents[1]
    urls = {}
    for rank in range(8):
        urls[rank] = f"{s3_prefix}/hashed/rank_{rank}/checkpoint_{rank}.ckpt"
        s3_store.write_bytes(urls[rank], (golden / f"rank_{rank}" / f"checkpoint_{rank}.ckpt").read_bytes())
    with SourceFiles(urls, verify_crc=False, storage=s3_storage_options, digest_ranks={1, 2, 6}) as remote:
        index = remote.index()
        assert sorted(remote.digests) == sorted(urls[r] for r in (1, 2, 6))
        for rank in (1, 2, 6):
            reader = remote.reader(rank)
            data = (golden / f"rank_{rank}" / f"checkpoint_{rank}.ckpt").read_bytes()
            assert reader._file.bytes_fetched == len(data)  # the walk and the hash: one read of the object
            pieces = tuple(p for e in reader.entries.values() for p in e.pieces)
            segments = ((0, len(data) - CRC_TRAILER_LEN), *pieces) if reader.has_crc else pieces
            request = HashRequest(urls[rank], segments, tuple(reader.identity))
            want = digest_file(urls[rank], segments=segments, storage_options=s3_storage_options)
            assert usable_digest(remote.digests[urls[rank]], request) == want
            assert want.sha256 == hashlib.sha256(data).hexdigest()
        assert not isinstance(remote.reader(0)._file, DigestingReader)  # not asked for: the walk alone
        with SourceFiles({r: str(golden / f"rank_{r}" / f"checkpoint_{r}.ckpt") for r in urls}, verify_crc=False,
                         digest_ranks=set(urls)) as files:
            assert index == files.index() and not files.digests  # local files: left to the hash pass


@pytest.mark.parametrize("digest", [False, True], ids=["walk", "hashed"])
def test_small_tensors_met_while_indexing_are_read_again_without_a_request(s3_store, s3_prefix, s3_storage_options,
                                                                            digest, tmp_path):
    import numpy as np

    from reshard_job.sources.open_files import SourceFiles
    from reshard_job.formats.ckpt import CheckpointWriter
    from reshard_job.storage.s3file import SMALL_CONTENT

    rng = np.random.default_rng(5)
    local = tmp_path / "m.ckpt"
    with CheckpointWriter(local) as w:  # small norms between weights larger than a walk's window
        for layer in range(4):
            w.add(f"l{layer}.norm", rng.standard_normal(126).astype(np.float16))
            w.add(f"l{layer}.w", rng.standard_normal((1100, 1000)).astype(np.float32))
    data = local.read_bytes()
    url = f"{s3_prefix}/kept_{digest}/rank_0/checkpoint_0.ckpt"
    s3_store.write_bytes(url, data)
    with SourceFiles({0: url}, verify_crc=False, storage=s3_storage_options,
                     digest_ranks={0} if digest else ()) as files:
        reader = files.reader(0)
        small = [n for n in reader.names() if reader.entries[n].nbytes <= SMALL_CONTENT]
        large = [n for n in reader.names() if reader.entries[n].nbytes > SMALL_CONTENT]
        assert len(small) == 4 and len(large) == 4
        raw = reader._file
        before = raw.requests
        reader.expect_reads([reader.entries[n].pieces[0] for n in small], 1 << 20)  # announced: all kept
        for name in small:
            offset, length = reader.entries[name].pieces[0]
            assert reader.read(name).tobytes() == data[offset:offset + length]
        assert raw.requests == before  # answered from memory
        offset, length = reader.entries[large[1]].pieces[0]
        assert reader.read(large[1]).tobytes() == data[offset:offset + length]
        assert raw.requests > before  # a large tensor is fetched, not kept


def test_remote_sources_give_their_fingerprints_in_the_read_that_indexes_and_hashes_them(s3_store, s3_prefix,
                                                                                          s3_storage_options):
    """A conversion from a bucket reads each source object once for its index, its sha256 and the
    converted parameters' fingerprints: no object is read again for them (``proof.stream_taps``)."""
    from types import SimpleNamespace

    from reshard_job.job.config.spec import SourceSpec, TargetSpec
    from reshard_job.job.stages.integrity import hash_sources
    from reshard_job.job.stages.prepare import HashWhileIndexing, prepare
    from reshard_job.job.stages.proof import checkpoint_fingerprints, converted_names, source_taps

    s2 = Path(__file__).parents[2] / "golden" / "S2_block_mp4dp2opt_to_mp4"
    src = f"{s3_prefix}/streamed"
    for path in sorted((s2 / "src_checkpoints").glob("rank_*/*.ckpt")):
        s3_store.write_bytes(f"{src}/{path.parent.name}/{path.name}", path.read_bytes())
    source = SourceSpec(src, str(s2 / "src_strategy.ckpt"))
    target = TargetSpec(strategy=str(s2 / "dst_strategy.ckpt"))
    job = SimpleNamespace(run=SimpleNamespace(fingerprints=True), storage=s3_storage_options)
    with prepare(source, target, storage=s3_storage_options, one_device=True,
                 hashing=HashWhileIndexing(use_cache=False, progress=False)) as prepared:
        objects = {r: prepared.readers.raw_reader(r)._file for r in prepared.plan.source_ranks}
        digests = hash_sources(prepared, use_cache=False, progress=False, storage=s3_storage_options,
                               make_taps=lambda: source_taps(job, prepared)).settled()
        assert all(f.bytes_fetched == f.size for f in objects.values())  # one read each, nothing after it
        taps = digests.fingerprints
        assert taps.read_back == 0
        fingerprints, residual = taps.digests()
        assert residual == set()
        local = SourceSpec(str(s2 / "src_checkpoints"), str(s2 / "src_strategy.ckpt"))
        assert dict(fingerprints) == checkpoint_fingerprints(local, wanted=converted_names(prepared)).digests
