"""Cache files: private, replaced whole (never a torn file under the final name, even when the
write fails), and trimmed least recently used first."""

from __future__ import annotations

import os
import stat

import pytest

from reshard_job.storage import cache_files
from reshard_job.storage.cache_files import mark_used, remove_least_recently_used, write_cache_file


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_a_cache_file_and_its_folder_are_private(tmp_path, umask_022):
    path = tmp_path / "cache" / "digests.json"
    assert write_cache_file(str(path), b"{}")
    assert path.read_bytes() == b"{}"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert os.listdir(path.parent) == ["digests.json"]  # no temporary file left


def test_a_failed_replace_keeps_the_old_file_whole_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "digests.json"
    assert write_cache_file(str(path), b"old")

    def refuse(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cache_files.os, "replace", refuse)
    assert write_cache_file(str(path), b"new content") is False  # a cache never fails a job
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["digests.json"]


def test_an_unwritable_folder_is_a_false_not_an_error(tmp_path):
    (tmp_path / "blocked").write_bytes(b"a file where the folder should be")
    assert write_cache_file(str(tmp_path / "blocked" / "digests.json"), b"{}") is False


def test_the_least_recently_used_files_go_first(tmp_path):
    for i in range(5):
        (tmp_path / f"{i}.json.z").write_bytes(b"x" * 10)
        os.utime(tmp_path / f"{i}.json.z", ns=(i * 10**9, i * 10**9))
    (tmp_path / "other.txt").write_bytes(b"not a cache document")
    os.utime(tmp_path / "other.txt", ns=(0, 0))
    mark_used(str(tmp_path / "0.json.z"))  # the oldest, just used: now the newest
    remove_least_recently_used(str(tmp_path), ".json.z", max_files=3, max_bytes=1000)
    assert sorted(os.listdir(tmp_path)) == ["0.json.z", "3.json.z", "4.json.z", "other.txt"]
    remove_least_recently_used(str(tmp_path), ".json.z", max_files=10, max_bytes=25)
    assert sorted(os.listdir(tmp_path)) == ["0.json.z", "4.json.z", "other.txt"]


def test_trimming_a_missing_folder_does_nothing(tmp_path):
    remove_least_recently_used(str(tmp_path / "none"), ".json.z", max_files=0, max_bytes=0)
    with pytest.raises(OSError):
        mark_used(str(tmp_path / "none" / "gone.json.z"))
