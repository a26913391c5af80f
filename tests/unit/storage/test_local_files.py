"""Local bookkeeping files: a replaced file or a published folder is never seen half-made under its
final name, even when writing or building fails; the lock makes a second holder wait."""

from __future__ import annotations

import os
import stat
import threading

import pytest

from reshard_job.storage import local_files
from reshard_job.storage.local_files import exclusive_lock, make_folder, publish_folder, replace_file


def test_replace_file_writes_and_replaces_with_the_asked_mode(tmp_path):
    path = tmp_path / "graph.svg"
    old = os.umask(0o022)
    try:
        replace_file(str(path), b"first")
        replace_file(str(path), b"second", mode=0o640)
    finally:
        os.umask(old)
    assert path.read_bytes() == b"second"
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert os.listdir(tmp_path) == ["graph.svg"]


def test_replace_file_needs_its_folder(tmp_path):
    with pytest.raises(FileNotFoundError):
        replace_file(str(tmp_path / "no" / "such" / "graph.svg"), b"x")
    assert os.listdir(tmp_path) == []  # a mistyped folder is reported, not created


def test_a_failed_replace_leaves_the_old_file_and_no_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "graph.svg"
    replace_file(str(path), b"old")

    def refuse(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(local_files.os, "replace", refuse)
    with pytest.raises(OSError):
        replace_file(str(path), b"new")
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["graph.svg"]


def _build(files: dict[str, bytes]):
    def build(folder: str) -> None:
        for name, data in files.items():
            make_folder(os.path.join(folder, os.path.dirname(name)))
            with open(os.path.join(folder, name), "wb") as f:
                f.write(data)
    return build


def test_publish_folder_replaces_an_older_set_whole(tmp_path):
    final = tmp_path / "demo"
    publish_folder(str(final), _build({"rank_0/a": b"old", "rank_1/b": b"old"}))
    publish_folder(str(final), _build({"rank_0/a": b"new"}))
    assert sorted(str(p.relative_to(final)) for p in final.rglob("*") if p.is_file()) == ["rank_0/a"]
    assert (final / "rank_0" / "a").read_bytes() == b"new"
    assert os.listdir(tmp_path) == ["demo"]  # no staged folder left


def test_a_failed_build_leaves_the_published_folder_and_no_staged_one(tmp_path):
    final = tmp_path / "demo"
    publish_folder(str(final), _build({"a": b"complete"}))

    def half_then_fail(folder: str) -> None:
        _build({"a": b"partial"})(folder)
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        publish_folder(str(final), half_then_fail)
    assert (final / "a").read_bytes() == b"complete"
    assert os.listdir(tmp_path) == ["demo"]
    with pytest.raises(RuntimeError):
        publish_folder(str(tmp_path / "new"), half_then_fail)
    assert os.listdir(tmp_path) == ["demo"]  # nothing under the final name of a set never completed


def test_make_folder_creates_parents_and_accepts_an_existing_folder(tmp_path):
    make_folder(str(tmp_path / "a" / "b"))
    make_folder(str(tmp_path / "a" / "b"))
    make_folder("")
    assert (tmp_path / "a" / "b").is_dir()


def test_a_second_holder_of_the_lock_waits(tmp_path):
    lock = str(tmp_path / ".demo.lock")
    taken = threading.Event()

    def second() -> None:
        with exclusive_lock(lock):
            taken.set()

    with exclusive_lock(lock):
        assert os.path.isfile(lock)
        thread = threading.Thread(target=second)
        thread.start()
        assert not taken.wait(0.3)  # held by the first: the second waits
    assert taken.wait(10)
    thread.join()


def test_a_lock_file_that_is_a_fifo_is_refused_not_waited_on(tmp_path):
    """Opening a FIFO for reading waits for a writer: the job hung on such a lock for good."""
    import os
    import signal

    from reshard_job.storage import StorageError
    from reshard_job.storage.local import LOCK_FILE, STATE_DIR, LocalStorage

    os.makedirs(tmp_path / STATE_DIR)
    os.mkfifo(tmp_path / STATE_DIR / LOCK_FILE)
    signal.alarm(20)  # a wait would be ended here, failing the test rather than hanging it
    try:
        for ask in (lambda s: s.held_by(str(tmp_path)), lambda s: s.lock(str(tmp_path), "pid 1")):
            with pytest.raises(StorageError, match="is not a regular file"):
                ask(LocalStorage())
    finally:
        signal.alarm(0)
