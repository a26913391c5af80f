"""Where the job may write, and what a failed write leaves behind.

The job refuses to write into a source directory, over a source file, or into a non-empty
directory it did not produce (unless ``output.overwrite=true``); a second job writing the same
directory is refused by the lock; an unwritable directory or a disk that fills up ends the run with
one line, no partial file under a final name, no temporary file, no manifest, and a failed lineage
run without outputs.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from reliability_helpers import (app_command, app_env, assert_nothing_recorded, can_drop_dac_override, copy_s1,
                                 file_size_limit, lineage_runs, run_app, run_in_process, s1_args, snapshot,
                                 temp_files, the_error, without_dac_override)

from reshard_job.errors import OutputError
from reshard_job.storage import atomic


@pytest.fixture
def s1(tmp_path):
    """A copy of golden scenario S1; whatever the test does, its files are unchanged afterwards."""
    ckpts, src, dst = copy_s1(tmp_path / "src")
    before = snapshot(tmp_path / "src")
    yield ckpts, src, dst
    assert snapshot(tmp_path / "src") == before, "source files changed"


def _db(cwd: Path) -> Path:
    return cwd / "runs" / "lineage.db"


# ================================================================================== refusals



def assert_refusal_recorded(db: Path, error: str) -> None:
    """A refused conversion is in the lineage database as a failed run with the refusal, and no outputs."""
    runs = lineage_runs(db)
    assert [r["status"] for r in runs] == ["failed"], runs
    assert runs[0]["error"] == error and runs[0]["outputs"] == []


@pytest.mark.parametrize("where", ["source_dir", "inside_source_dir", "source_file", "strategy_file"])
def test_refuses_to_write_among_the_sources(tmp_path, s1, app, where):
    ckpts, src, dst = s1
    out = {"source_dir": ckpts, "inside_source_dir": ckpts / "rank_0" / "converted",
           "source_file": ckpts / "rank_0" / "checkpoint_0.ckpt", "strategy_file": src}[where]
    before = snapshot(tmp_path / "src")
    error = the_error(app(tmp_path, *s1_args(ckpts, src, dst, out)))
    if where in ("source_dir", "inside_source_dir"):
        assert error == (f"output.dir {out} is inside the source directory {ckpts}; outputs must not be written among "
                         "the sources (choose a directory outside it)")
    else:
        assert error == f"output.dir {out} is a source file; choose a new directory"
    assert snapshot(tmp_path / "src") == before
    assert_refusal_recorded(_db(tmp_path), error)


def test_never_replaces_a_source_file_even_with_overwrite(tmp_path, s1, app):
    """A source strategy kept as strategy.ckpt in the output directory: the target strategy would replace it."""
    ckpts, src, dst = s1
    out = tmp_path / "shared"
    out.mkdir()
    kept = out / "strategy.ckpt"
    shutil.copy(src, kept)
    before = snapshot(tmp_path / "src", out)
    for overwrite in ("false", "true"):
        error = the_error(app(tmp_path, *s1_args(ckpts, kept, dst, out), f"output.overwrite={overwrite}"))
        assert error == (f"output.dir {out}: writing strategy.ckpt would replace the source file {kept}; choose "
                         "another output.dir")
    assert snapshot(tmp_path / "src", out) == before
    assert sorted(os.listdir(out)) == ["strategy.ckpt"]


def _bind_mount_possible() -> str | None:
    """None when this process may bind-mount in a mount namespace of its own; else why not."""
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("mount") is None:
        return "needs root and the unshare and mount programs (util-linux)"
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", "mount --bind / /mnt"],
                           capture_output=True, text=True)
    return None if probe.returncode == 0 else f"cannot bind-mount here: {probe.stderr.strip()[-200:]}"


@pytest.mark.parametrize("alias", ["same_folder", "folder_above", "rank_folder"])
def test_a_bind_mount_of_the_sources_is_refused_even_with_overwrite(tmp_path, s1, alias):
    """output.dir is the source folder (or one above it, or a rank folder) under another path: no path
    comparison sees it; devices and inodes do. Nothing is written, not even the lock."""
    why = _bind_mount_possible()
    if why:
        pytest.skip(why)
    ckpts, src, dst = s1
    mounted = tmp_path / "view"
    mounted.mkdir()
    bound = {"same_folder": ckpts, "folder_above": ckpts.parent, "rank_folder": ckpts / "rank_0"}[alias]
    out = {"same_folder": mounted, "folder_above": mounted / "ckpts" / "converted", "rank_folder": mounted}[alias]
    before = snapshot(tmp_path / "src")
    args = s1_args(ckpts, src, dst, out) + ["output.overwrite=true"]
    script = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
    res = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "bind", str(bound),
                          str(mounted), *app_command(*args)], cwd=tmp_path, env=app_env(), capture_output=True,
                         text=True, timeout=180)
    error = the_error(res)
    folder = ckpts if alias == "folder_above" else bound
    assert error == (f"output.dir {out} is inside the source directory {folder} (the same folder under another "
                     "path); outputs must not be written among the sources (choose a directory outside it)")
    assert snapshot(tmp_path / "src") == before
    assert not (ckpts / ".reshard_job").exists() and not (ckpts / "strategy.ckpt").exists()


@pytest.mark.parametrize("prefix", ["checkpoint_", "converted_"])
def test_never_writes_into_a_source_dir_through_a_symlink(tmp_path, s1, app, prefix):
    """output.dir/rank_0 links to a source rank folder: with the default prefix the output would replace
    the source file, with another it would land among the sources; both are refused, overwrite or not."""
    ckpts, src, dst = s1
    out = tmp_path / "view"
    out.mkdir()
    (out / "rank_0").symlink_to(ckpts / "rank_0")
    before = snapshot(tmp_path / "src")
    error = the_error(app(tmp_path, *s1_args(ckpts, src, dst, out), "output.overwrite=true", f"target.prefix={prefix}"))
    if prefix == "checkpoint_":
        assert error == (f"output.dir {out}: writing rank_0/checkpoint_0.ckpt would replace the source file "
                         f"{ckpts / 'rank_0' / 'checkpoint_0.ckpt'}; choose another output.dir")
    else:
        assert error == (f"output.dir {out}: rank_0/converted_0.ckpt would be written into the source directory "
                         f"{ckpts} (through a symbolic link); choose another output.dir")
    assert snapshot(tmp_path / "src") == before
    assert sorted(os.listdir(ckpts / "rank_0")) == ["checkpoint_0.ckpt"]


@pytest.mark.parametrize("into", ["source rank folder", "another folder"])
def test_never_writes_or_cleans_through_a_link_in_the_state_folder(tmp_path, s1, app, into):
    """output.dir/.reshard_job/tensors links to a source rank folder (or anywhere else): the
    per-rank tensor records would be written there, and a file there named as the tool names its
    temporary files removed as one of its own; refused before either, overwrite or not."""
    ckpts, src, dst = s1
    out = tmp_path / "out"
    (out / ".reshard_job").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    users = elsewhere / ".mine.ckpt.0123456789ab.tmp"
    users.write_bytes(b"a user's file")
    target = ckpts / "rank_0" if into == "source rank folder" else elsewhere
    (out / ".reshard_job" / "tensors").symlink_to(target)
    error = the_error(app(tmp_path, *s1_args(ckpts, src, dst, out), "output.overwrite=true"))
    record = ".reshard_job/tensors/rank_0.json"
    if into == "source rank folder":
        assert error == (f"output.dir {out}: {record} would be written into the source directory {ckpts} "
                         "(through a symbolic link); choose another output.dir")
        assert sorted(os.listdir(ckpts / "rank_0")) == ["checkpoint_0.ckpt"]
    else:
        assert error.startswith(f"output.dir {out}: {record} would be written to {elsewhere / 'rank_0.json'}, "
                                "outside output.dir")
    assert users.read_bytes() == b"a user's file" and sorted(os.listdir(elsewhere)) == [users.name]


def test_a_source_file_whose_name_is_not_utf8_is_refused_before_anything_is_written(tmp_path, s1):
    """A rank file named with a byte that is not UTF-8 converted, then failed with an encoding
    traceback writing the manifest (no manifest, exit 1): refused in one line naming it, and the
    lineage database says so too."""
    ckpts, src, dst = s1
    odd = os.fsdecode(bytes(ckpts / "rank_1") + b"/checkpoint_1\xff.ckpt")
    os.rename(ckpts / "rank_1" / "checkpoint_1.ckpt", odd)
    try:
        error = the_error(run_app(tmp_path, *s1_args(ckpts, src, dst, tmp_path / "out")))
    finally:
        os.rename(odd, ckpts / "rank_1" / "checkpoint_1.ckpt")
    assert error == (f"{ckpts}/rank_1/checkpoint_1\\xff.ckpt: the name is not valid UTF-8, and files are recorded "
                     "by name (manifest.json, the lineage database); rename it")
    assert not (tmp_path / "out").exists()
    assert_refusal_recorded(_db(tmp_path), error)


def test_prefix_cannot_escape_the_output_dir(tmp_path, s1, app):
    ckpts, src, dst = s1
    error = the_error(app(tmp_path, *s1_args(ckpts, src, dst, tmp_path / "out"), "target.prefix=../../src/ckpts/rank_0/x_"))
    assert error == "target.prefix must be the start of a file name (no '/'), got '../../src/ckpts/rank_0/x_'"
    assert not (tmp_path / "out").exists()


def test_foreign_non_empty_dir_is_refused_unless_overwrite(tmp_path, s1, app):
    ckpts, src, dst = s1
    out = tmp_path / "home"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    (out / ".draft.tmp").write_text("also mine\n")  # looks like a temp file; must survive the cleanup too
    (out / "rank_0").mkdir()
    (out / "rank_0" / "keep.txt").write_text("mine too\n")
    foreign = snapshot(out)
    error = the_error(app(tmp_path, *s1_args(ckpts, src, dst, out)))
    assert error == (f"output.dir {out} holds files this tool did not produce (.draft.tmp, notes.txt, rank_0); choose "
                     "another output.dir or set output.overwrite=true")
    assert snapshot(out) == foreign
    assert_refusal_recorded(_db(tmp_path), error)

    res = app(tmp_path, *s1_args(ckpts, src, dst, out), "output.overwrite=true")
    assert res.returncode == 0, res.stderr
    assert (out / "manifest.json").exists()
    assert {p: s for p, s in snapshot(out).items() if p in foreign} == foreign  # the user's files are untouched


def test_outputs_of_another_conversion_are_refused_unless_overwrite(tmp_path, s1, app):
    ckpts, src, dst = s1
    out = tmp_path / "out"
    assert app(tmp_path, *s1_args(ckpts, src, dst, out)).returncode == 0
    run_id = json.loads((out / "manifest.json").read_text())["run_id"]
    single = [f"source.checkpoints={ckpts}", f"source.strategy={src}", "target=single", f"output.dir={out}"]
    error = the_error(app(tmp_path, *single))
    assert error == (f"output.dir {out} holds the outputs of a different conversion (run {run_id}); choose another "
                     "output.dir or set output.overwrite=true")
    res = app(tmp_path, *single, "output.overwrite=true")
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in out.glob("rank_*/*")) == ["checkpoint_0.ckpt"]  # the 4-rank files were removed
    assert json.loads((out / "manifest.json").read_text())["target"]["devices"] == 1


# ================================================================================== lock


def test_a_locked_output_is_refused_before_any_source_is_read(tmp_path, app):
    """A conversion reads (and, in a bucket, hashes) every source before it writes; another job
    holding output.dir's lock is reported first, not after that read."""
    from reshard_job.storage.local import LocalStorage

    ckpts, src, dst = copy_s1(tmp_path / "bad")
    rank_3 = ckpts / "rank_3" / "checkpoint_3.ckpt"
    rank_3.write_bytes(b"\x0b" + rank_3.read_bytes()[1:])  # what reading the sources would trip over
    out = tmp_path / "out"
    out.mkdir()
    held = LocalStorage().lock(str(out), "pid 4242 on elsewhere")
    try:
        error = the_error(app(tmp_path, *s1_args(ckpts, src, dst, out)))
        assert error == (f"output.dir {out} is being written by another job (pid 4242 on elsewhere); wait for it to "
                         "finish or choose another output.dir")
    finally:
        held.release()
    error = the_error(app(tmp_path, *s1_args(ckpts, src, dst, out)))  # free: the sources are read
    assert error.startswith(f"{rank_3}: wrong magic"), error


def test_second_writer_is_refused_while_the_first_runs(tmp_path, big_source, app):
    out = tmp_path / "out"
    # 16 KiB pieces make the first job hold the lock for seconds, whatever the machine (same conversion)
    first = subprocess.Popen(app_command(*big_source.args(out, "job.workers=1", "job.max_memory=16KiB")),
                             cwd=tmp_path, env=app_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lock = out / ".reshard_job" / "lock"
        deadline = time.monotonic() + 60
        while not (lock.exists() and lock.read_text().startswith("pid")):
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.01)
        second = app(tmp_path, *big_source.args(out, "job.workers=1"))
        assert first.poll() is None, "the first job ended before the second was refused; use a larger source"
        error = the_error(second)
        assert error.startswith(f"output.dir {out} is being written by another job (pid {first.pid} on ")
        assert error.endswith("); wait for it to finish or choose another output.dir")
        stdout, stderr = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0, stderr
    assert (out / "manifest.json").exists()
    # the first job completed; the refused one is recorded as failed with the refusal, and no outputs
    runs = lineage_runs(_db(tmp_path))
    assert sorted(r["status"] for r in runs) == ["completed", "failed"]
    refused = next(r for r in runs if r["status"] == "failed")
    assert refused["error"] == error and refused["outputs"] == []


# ================================================================================== not writable


@pytest.mark.skipif(not can_drop_dac_override(), reason="cannot drop CAP_DAC_OVERRIDE here (prctl refused)")
@pytest.mark.parametrize("existing", [True, False], ids=["existing_dir", "parent_dir"])
def test_output_dir_not_writable(tmp_path, s1, existing):
    ckpts, src, dst = s1
    locked = tmp_path / "locked"
    locked.mkdir()
    out = locked if existing else locked / "out"
    locked.chmod(0o555)
    try:
        before = snapshot(tmp_path / "src")
        res = run_app(tmp_path, *s1_args(ckpts, src, dst, out), preexec_fn=without_dac_override())
        assert the_error(res) == f"output.dir {out} is not writable (no write permission on {locked})"
        assert snapshot(tmp_path / "src") == before
        assert os.listdir(locked) == []
        assert_refusal_recorded(_db(tmp_path), the_error(res))
    finally:
        locked.chmod(0o755)


def test_output_dir_where_even_root_cannot_write(tmp_path, s1, app):
    ckpts, src, dst = s1
    error = the_error(app(tmp_path, *s1_args(ckpts, src, dst, Path("/proc/1/reshard_out"))))
    assert error == "output.dir /proc/1/reshard_out is not writable (no write permission on /proc/1)"
    assert_refusal_recorded(_db(tmp_path), error)


# ================================================================================== disk full


def test_disk_full_in_a_child_process(tmp_path, big_source):
    """RLIMIT_FSIZE makes any write past 4 MiB fail (EFBIG), as a full disk would: the 32 MiB target
    files cannot be written, the small strategy copy and lineage database can."""
    out = tmp_path / "out"
    before = snapshot(big_source.checkpoints)
    res = run_app(tmp_path, *big_source.args(out, "job.workers=2"), preexec_fn=file_size_limit(4 << 20))
    error = the_error(res)
    assert error.startswith(f"{out}/rank_"), error
    assert error.endswith(".ckpt: write failed (File too large); the partial file was removed")
    assert_nothing_recorded(out, _db(tmp_path), error)
    assert [r["status"] for r in lineage_runs(_db(tmp_path))] == ["failed"]
    assert snapshot(big_source.checkpoints) == before


class _FullDisk:
    """A file object whose device fills up after `room` bytes: writes (or the final flush) fail with ENOSPC."""

    def __init__(self, f, room: int, at_flush: bool):
        self._f, self._room, self._at_flush = f, room, at_flush

    def write(self, data, *tap):  # tap: the direct sink's per-tensor hasher, passed through
        n = memoryview(data).nbytes
        if not self._at_flush and n > self._room:
            self._f.write(memoryview(data).cast("B")[: self._room], *tap)  # what fitted stays in the temp file
            self._room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._room -= n
        return self._f.write(data, *tap)

    def flush(self):
        if self._at_flush and self._room < 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self._f.flush()

    def __getattr__(self, name):
        return getattr(self._f, name)


@pytest.mark.parametrize("at_flush", [False, True], ids=["on_write", "on_flush"])
def test_disk_full_while_writing_then_resume(tmp_path, s1, monkeypatch, at_flush):
    """ENOSPC on the third target file (in-process, so AtomicFile can be patched): the two finished
    files stay, nothing partial or temporary remains, no manifest; a rerun resumes and completes."""
    ckpts, src, dst = s1
    out = tmp_path / "out"
    args = s1_args(ckpts, src, dst, out)
    opened = []
    real_init = atomic.AtomicFile.__init__

    def init(self, path, **kw):
        real_init(self, path, **kw)
        if os.path.basename(path).startswith("checkpoint_"):
            opened.append(path)
            if len(opened) == 3:
                self._f = _FullDisk(self._f, 10_000, at_flush)

    monkeypatch.setattr(atomic.AtomicFile, "__init__", init)
    before = snapshot(tmp_path / "src")
    with pytest.raises(OutputError) as err:
        run_in_process(tmp_path, *args)
    victim = opened[2]
    assert str(err.value) == f"{victim}: no space left on device while writing; the partial file was removed"
    assert not os.path.exists(victim)
    assert temp_files(out) == []
    assert not (out / "manifest.json").exists()
    finished = sorted(str(p) for p in out.glob("rank_*/checkpoint_*.ckpt"))
    assert finished == sorted(opened[:2])
    kept = {p: os.stat(p).st_ino for p in finished}
    runs = lineage_runs(_db(tmp_path))
    assert [(r["status"], r["error"], r["outputs"]) for r in runs] == [("failed", str(err.value), [])]

    monkeypatch.setattr(atomic.AtomicFile, "__init__", real_init)  # space freed
    result = run_in_process(tmp_path, *args)
    assert result.status == "completed"
    assert {p: os.stat(p).st_ino for p in kept} == kept  # the finished files were kept, not rewritten
    assert len(list(out.glob("rank_*/checkpoint_*.ckpt"))) == 4
    assert snapshot(tmp_path / "src") == before


def test_a_failed_write_leaves_an_existing_file_intact(tmp_path):
    """Atomicity of a single file: the old content stays under the final name until the new one is complete."""
    target = tmp_path / "file.bin"
    target.write_bytes(b"old content")
    f = atomic.AtomicFile(target)
    f.write(b"new")
    f._f = _FullDisk(f._f, 0, at_flush=False)
    with pytest.raises(OutputError, match="no space left on device while writing; the partial file was removed"):
        f.write(b"more than fits")
    assert target.read_bytes() == b"old content"
    assert temp_files(tmp_path) == []


def test_an_overwrite_by_fewer_ranks_leaves_no_empty_rank_folder(tmp_path, app):
    """8 ranks overwritten by 4: rank_4/ .. rank_7/ kept nothing, and left behind, empty, they made the
    directory a source of 8 rank folders for a strategy of 4 (refused when converted again)."""
    res = app(tmp_path, "target.devices=8", "output.dir=out", "lineage.enabled=false")
    assert res.returncode == 0, res.stderr
    (tmp_path / "out" / "rank_7" / "notes.txt").write_text("the user's")  # a folder holding more stays
    res = app(tmp_path, "target.devices=4", "output.dir=out", "output.overwrite=true", "lineage.enabled=false")
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in (tmp_path / "out").glob("rank_*")) == [f"rank_{r}" for r in (0, 1, 2, 3, 7)]
    assert [p.name for p in (tmp_path / "out" / "rank_7").iterdir()] == ["notes.txt"]
    (tmp_path / "out" / "rank_7" / "notes.txt").unlink()
    (tmp_path / "out" / "rank_7").rmdir()
    res = app(tmp_path, "source=checkpoints", f"source.checkpoints={tmp_path / 'out'}",
              f"source.strategy={tmp_path / 'out' / 'strategy.ckpt'}", "target=single", "output.dir=merged",
              "lineage.enabled=false")
    assert res.returncode == 0, res.stderr  # the overwritten directory is a source of its 4 ranks
