"""The built-in demo set: built once per user in the cache folder, reused while intact, rebuilt when not."""

from __future__ import annotations

import os

import pytest

from reshard_job.sources.demo import DEMO_NAME, demo_folder, ensure_demo


def test_the_demo_lives_in_the_cache_folder_the_digests_use(tmp_path, monkeypatch):
    monkeypatch.setenv("RESHARD_JOB_CACHE_DIR", str(tmp_path / "cache"))
    assert demo_folder() == str(tmp_path / "cache" / "demo")
    monkeypatch.delenv("RESHARD_JOB_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert demo_folder() == str(tmp_path / "xdg" / "reshard_job" / "demo")


def _files(ckpt_dir: str) -> dict[str, int]:
    return {os.path.relpath(os.path.join(d, f), ckpt_dir): os.stat(os.path.join(d, f)).st_ino
            for d, _, names in os.walk(ckpt_dir) for f in names}


def test_an_intact_set_is_reused_without_writing(tmp_path):
    ckpt_dir, strategy = ensure_demo(str(tmp_path))
    assert ckpt_dir == str(tmp_path / DEMO_NAME) and os.path.isfile(strategy)
    assert (tmp_path / f"{DEMO_NAME}.files.json").is_file()
    first = _files(ckpt_dir)
    assert len(first) == 8
    assert ensure_demo(str(tmp_path)) == (ckpt_dir, strategy)
    assert _files(ckpt_dir) == first  # the same files (inodes): nothing was written again


@pytest.mark.parametrize("damage", ["truncate", "remove", "no_listing"])
def test_a_damaged_set_is_written_again(tmp_path, damage):
    ckpt_dir, _ = ensure_demo(str(tmp_path))
    victim = os.path.join(ckpt_dir, "rank_5", "checkpoint_5.ckpt")
    size = os.path.getsize(victim)
    if damage == "truncate":
        os.truncate(victim, size // 2)
    elif damage == "remove":
        os.unlink(victim)
    else:
        os.unlink(tmp_path / f"{DEMO_NAME}.files.json")
    before = _files(ckpt_dir)
    ensure_demo(str(tmp_path))
    assert os.path.getsize(victim) == size
    after = _files(ckpt_dir)
    assert len(after) == 8 and not set(after.items()) & set(before.items())  # every file written afresh
