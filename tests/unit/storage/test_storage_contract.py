"""The same tests for every ``Storage`` back end: local files and a real S3 server behave alike.

Each test gets a ``Backend``: a storage, a fresh root folder on it, and a way to put and read
bytes that does not go through the method under test (plain files locally, raw S3 calls
remotely), so a bug in a method cannot hide behind the same bug in its counterpart.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from reshard_job.storage import KIND_DIR, KIND_FILE, LockedError, SourceChangedError, StorageError, storage_for
from reshard_job.storage.local import LocalStorage


@dataclass
class Backend:
    name: str
    storage: object
    root: str
    put: Callable[[str, bytes], None]  # write a file by relative path, bypassing the storage
    get: Callable[[str], bytes | None]  # read a file by relative path (None when absent), bypassing it

    def path(self, *parts: str) -> str:
        return self.storage.join(self.root, *parts)


def _local_backend(tmp_path: Path) -> Backend:
    root = tmp_path / "root"
    root.mkdir()

    def put(rel: str, data: bytes) -> None:
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)

    def get(rel: str) -> bytes | None:
        target = root / rel
        return target.read_bytes() if target.is_file() else None

    return Backend("local", LocalStorage(), str(root), put, get)


def _s3_backend(store, root: str) -> Backend:
    bucket, prefix = root[len("s3://"):].split("/", 1)

    def put(rel: str, data: bytes) -> None:
        store.call_raw("put_object", Bucket=bucket, Key=f"{prefix}/{rel}", Body=data)

    def get(rel: str) -> bytes | None:
        try:
            answer = store.call_raw("get_object", Bucket=bucket, Key=f"{prefix}/{rel}")
        except Exception as e:  # noqa: BLE001
            if "NoSuchKey" in repr(e) or "404" in repr(e):
                return None
            raise

        async def body():
            try:
                return await answer["Body"].read()
            finally:
                answer["Body"].close()

        return store.run(body)

    return Backend("s3", store, root, put, get)


@pytest.fixture(params=["local", "s3"])
def backend(request, tmp_path) -> Backend:
    if request.param == "local":
        return _local_backend(tmp_path)
    return _s3_backend(request.getfixturevalue("s3_store"), request.getfixturevalue("s3_prefix"))


def assert_one_line(err: BaseException, *needles: str) -> None:
    text = str(err)
    assert "\n" not in text and len(text) < 400, text
    for needle in needles:
        assert needle in text, (needle, text)


DATA = bytes(range(256)) * 64 + b"tail"  # 16388 bytes, every offset distinguishable


# ---------------------------------------------------------------------------------- naming


def test_join_parent_basename_round_trip(backend):
    s = backend.storage
    f = s.join(backend.root, "rank_0", "checkpoint_0.ckpt")
    assert f.endswith("rank_0/checkpoint_0.ckpt")
    assert s.basename(f) == "checkpoint_0.ckpt"
    assert s.parent(f) == s.join(backend.root, "rank_0")
    assert s.parent(s.parent(f)) == backend.root
    assert s.basename(backend.root + "/") == s.basename(backend.root)
    assert s.display(f) == f


# ---------------------------------------------------------------------------------- looking


def test_info_of_file_folder_and_nothing(backend):
    backend.put("rank_0/a.ckpt", DATA)
    s = backend.storage
    file_info = s.info(backend.path("rank_0", "a.ckpt"))
    assert file_info.kind == KIND_FILE and file_info.is_file
    assert file_info.size == len(DATA) and file_info.name == "a.ckpt"
    assert file_info.identity and file_info.identity == s.info(backend.path("rank_0", "a.ckpt")).identity
    folder = s.info(backend.path("rank_0"))
    assert folder.kind == KIND_DIR and folder.is_dir and folder.name == "rank_0"
    assert s.info(backend.path("rank_0") + "/").is_dir  # a trailing slash is the same folder
    assert s.info(backend.path("rank_9")) is None
    assert s.info(backend.path("rank_0", "b.ckpt")) is None
    assert s.info(backend.path("rank_0", "a.ckpt", "deeper")) is None


def test_identity_changes_when_content_changes(backend):
    backend.put("x.bin", DATA)
    s = backend.storage
    before = s.info(backend.path("x.bin")).identity
    backend.put("x.bin", DATA[:-1] + b"!")
    after = s.info(backend.path("x.bin")).identity
    assert before != after


def test_listdir_sorted_with_files_and_folders(backend):
    backend.put("b.txt", b"b")
    backend.put("a.txt", b"aa")
    backend.put("rank_1/f", b"1")
    backend.put("rank_0/sub/g", b"0")
    s = backend.storage
    entries = s.listdir(backend.root)
    assert [e.name for e in entries] == ["a.txt", "b.txt", "rank_0", "rank_1"]
    assert [e.kind for e in entries] == [KIND_FILE, KIND_FILE, KIND_DIR, KIND_DIR]
    assert entries[0].size == 2 and entries[0].path == backend.path("a.txt")
    assert entries[2].path == backend.path("rank_0")
    # identities seen in a listing equal those of info and of an opened reader: the job compares them
    assert entries[0].identity == s.info(backend.path("a.txt")).identity
    with s.open_read(backend.path("a.txt")) as f:
        assert f.identity == entries[0].identity
    assert [e.name for e in s.listdir(backend.root + "/")] == [e.name for e in entries]
    assert [e.name for e in s.listdir(backend.path("rank_0"))] == ["sub"]


def test_listdir_of_nothing_and_of_a_file(backend):
    backend.put("a.txt", b"a")
    with pytest.raises(FileNotFoundError):
        backend.storage.listdir(backend.path("missing"))
    with pytest.raises(StorageError) as err:
        backend.storage.listdir(backend.path("a.txt"))
    assert_one_line(err.value, "a.txt")


# ---------------------------------------------------------------------------------- reading


def test_pread_into_reads_exact_bytes_and_short_at_end(backend):
    backend.put("f.bin", DATA)
    with backend.storage.open_read(backend.path("f.bin")) as f:
        assert f.size == len(DATA) and f.path == backend.path("f.bin")
        for offset, length in [(0, 1), (1, 300), (5000, 4096), (len(DATA) - 10, 10), (100, 0)]:
            buf = bytearray(length)
            assert f.pread_into(offset, memoryview(buf)) == length
            assert bytes(buf) == DATA[offset:offset + length]
        buf = bytearray(100)
        assert f.pread_into(len(DATA) - 4, memoryview(buf)) == 4
        assert bytes(buf[:4]) == b"tail"
        assert f.pread_into(len(DATA), memoryview(buf)) == 0
        assert f.pread_into(len(DATA) + 1000, memoryview(buf)) == 0


def test_read_ranges_any_order_overlapping_and_past_the_end(backend):
    backend.put("f.bin", DATA)
    ranges = [(9000, 100), (0, 16), (8, 16), (9000, 100), (len(DATA) - 2, 50), (len(DATA) + 5, 10), (3, 0)]
    with backend.storage.open_read(backend.path("f.bin")) as f:
        got = f.read_ranges(ranges)
    assert got == [DATA[o:o + n] for o, n in ranges]


def test_open_read_of_nothing_and_of_a_folder(backend):
    backend.put("rank_0/a", b"a")
    with pytest.raises(FileNotFoundError):
        backend.storage.open_read(backend.path("nothing.ckpt"))
    with pytest.raises(StorageError) as err:
        backend.storage.open_read(backend.path("rank_0"))
    assert_one_line(err.value, "rank_0")


def test_read_bytes_limit_and_absence(backend):
    backend.put("small.json", b'{"a": 1}')
    s = backend.storage
    assert s.read_bytes(backend.path("small.json"), 100) == b'{"a": 1}'
    assert s.read_bytes(backend.path("small.json"), 8) == b'{"a": 1}'
    with pytest.raises(StorageError) as err:
        s.read_bytes(backend.path("small.json"), 7)
    assert_one_line(err.value, "small.json", "8 bytes")
    with pytest.raises(FileNotFoundError):
        s.read_bytes(backend.path("absent.json"), 100)


def test_empty_file(backend):
    backend.put("empty", b"")
    s = backend.storage
    assert s.info(backend.path("empty")).size == 0
    assert s.read_bytes(backend.path("empty"), 10) == b""
    with s.open_read(backend.path("empty")) as f:
        assert f.pread_into(0, memoryview(bytearray(4))) == 0
        assert f.read_ranges([(0, 4)]) == [b""]


# ---------------------------------------------------------------------------------- writing


@pytest.mark.parametrize("large", [False, True])
def test_create_is_invisible_until_commit(backend, large):
    s = backend.storage
    target = backend.path("rank_0", "out.ckpt")
    s.makedirs(s.parent(target))
    payload = os.urandom(12 * 1024 * 1024 + 17) if large else DATA
    w = s.create(target, large=large)
    for i in range(0, len(payload), 1 << 20):
        w.write(memoryview(payload)[i:i + (1 << 20)])
    assert w.size == len(payload)
    assert backend.get("rank_0/out.ckpt") is None
    assert s.info(target) is None
    size, digest = w.commit()
    assert (size, digest) == (len(payload), hashlib.sha256(payload).hexdigest())
    assert backend.get("rank_0/out.ckpt") == payload
    assert s.info(target).size == len(payload)


def test_abort_leaves_the_old_file(backend):
    backend.put("out.ckpt", b"old contents")
    s = backend.storage
    w = s.create(backend.path("out.ckpt"))
    w.write(b"new contents that never land")
    w.abort()
    w.abort()  # idempotent
    assert backend.get("out.ckpt") == b"old contents"
    assert [e.name for e in s.listdir(backend.root)] == ["out.ckpt"]


def test_commit_replaces_and_write_bytes_round_trips(backend):
    backend.put("m.json", b"old")
    s = backend.storage
    assert s.write_bytes(backend.path("m.json"), b"new!") == (4, hashlib.sha256(b"new!").hexdigest())
    assert backend.get("m.json") == b"new!"
    assert s.write_bytes(backend.path("deep", "er", "x.json"), b"{}")[0] == 2
    assert backend.get("deep/er/x.json") == b"{}"


def test_remove(backend):
    backend.put("a", b"a")
    s = backend.storage
    assert s.remove(backend.path("a")) is True
    assert backend.get("a") is None
    assert s.remove(backend.path("a")) is False


def test_remove_incomplete_clears_what_a_dead_writer_left(backend):
    s = backend.storage
    backend.put("keep.txt", b"mine")
    backend.put(".notes.tmp", b"a user's file that looks temporary")
    size = 12 * 1024 * 1024  # several parts remotely, so an upload is really under way
    dangling = [s.create(backend.path("rank_0", "x.ckpt"), large=True), s.create(backend.path("y.ckpt"))]
    for w in dangling:
        w.write(os.urandom(size))
    # the writers are dropped without commit or abort, as by a killed process
    removed = s.remove_incomplete(backend.root, ["rank_0"])
    assert removed == 2
    assert s.remove_incomplete(backend.root, ["rank_0"]) == 0
    assert [e.name for e in s.listdir(backend.root) if e.is_file] == [".notes.tmp", "keep.txt"]
    assert backend.get("rank_0/x.ckpt") is None and backend.get("y.ckpt") is None


def test_remove_incomplete_leaves_other_folders_alone(backend):
    s = backend.storage
    w = s.create(backend.path("other", "z.ckpt"), large=True)
    w.write(os.urandom(6 * 1024 * 1024))
    assert s.remove_incomplete(backend.root, ["rank_0"]) == 0
    assert s.remove_incomplete(backend.root, ["other"]) == 1
    w.abort()


def test_remove_incomplete_never_cleans_through_a_symbolic_link(tmp_path):
    """A folder to clean reached through a link (``.reshard_job/tensors`` -> a source folder) is
    someone else's: a file there named as the tool names its temporary files is left alone."""
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "deeper").mkdir(parents=True)
    users = [elsewhere / ".mine.ckpt.0123456789ab.tmp", elsewhere / "deeper" / ".mine.ckpt.0123456789ab.tmp"]
    for f in users:
        f.write_bytes(b"a user's file")
    out = tmp_path / "out"
    (out / "state").mkdir(parents=True)
    (out / "state" / "tensors").symlink_to(elsewhere)
    (out / "linked").symlink_to(elsewhere)
    folders = ["state/tensors", "linked/deeper", "link*"]
    assert LocalStorage().remove_incomplete(str(out), folders) == 0
    assert all(f.read_bytes() == b"a user's file" for f in users)


def test_remove_incomplete_takes_folder_patterns(backend):
    """A killed writer's only trace may be an unfinished upload, in a folder no listing shows."""
    s = backend.storage
    w = s.create(backend.path("rank_7", "x.ckpt"), large=True)
    w.write(os.urandom(6 * 1024 * 1024))
    deeper = s.create(backend.path("rank_7", "sub", "y.ckpt"), large=True)
    deeper.write(os.urandom(6 * 1024 * 1024))
    assert s.remove_incomplete(backend.root, ["other_*"]) == 0
    assert s.remove_incomplete(backend.root, ["rank_*"]) == 1  # '*' stays within one folder level
    assert s.remove_incomplete(backend.root, ["rank_*/sub"]) == 1
    for writer in (w, deeper):
        writer.abort()


# ---------------------------------------------------------------------------------- lock


def test_lock_is_exclusive_and_released(backend):
    s = backend.storage
    s.makedirs(backend.root)
    first = s.lock(backend.root, "pid 1 on host-a")
    with pytest.raises(LockedError) as err:
        s.lock(backend.root, "pid 2 on host-b")
    assert_one_line(err.value, "pid 1 on host-a")
    assert isinstance(err.value, StorageError)
    first.release()
    second = s.lock(backend.root, "pid 3 on host-c")
    second.release()
    second.release()  # idempotent


def test_held_by_names_the_holder_without_taking_or_writing_anything(backend):
    s = backend.storage
    assert s.held_by(backend.path("never_written")) is None  # nothing there: nobody
    assert s.info(backend.path("never_written")) is None  # and asking wrote nothing
    s.makedirs(backend.root)
    assert s.held_by(backend.root) is None
    held = s.lock(backend.root, "pid 1 on host-a")
    assert s.held_by(backend.root) == "pid 1 on host-a"
    assert s.held_by(backend.root) == "pid 1 on host-a"  # asking does not take it
    held.release()
    assert s.held_by(backend.root) is None
    s.lock(backend.root, "pid 2 on host-b").release()  # nor keeps anyone from taking it


# ---------------------------------------------------------------------------------- through storage_for


def test_storage_for_picks_the_back_end(backend, request):
    if backend.name == "local":
        assert storage_for(backend.root) is not None and storage_for(backend.root).scheme == "file"
        return
    s3_options = request.getfixturevalue("s3_storage_options")
    store = storage_for(backend.root, s3_options)
    assert store.scheme == "s3"
    assert storage_for(backend.root, s3_options) is store  # one client per options, reused
    backend.put("a", b"abc")
    assert store.read_bytes(backend.path("a"), 10) == b"abc"


def test_source_changed_error_is_a_storage_error():
    assert issubclass(SourceChangedError, StorageError)
