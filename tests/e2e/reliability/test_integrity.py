"""Never a silent wrong checkpoint: inputs that disagree are refused, changes under the job's feet
are caught, nothing escapes output.dir, no secret is written down.

Each case starts from golden scenario S1 (MindSpore 2.10, 8 -> 4 ranks) and ends either in a
non-zero exit with one line naming the file, rank or parameter, or in a correct, re-verified
output.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import pytest

from reliability_helpers import (S1, assert_nothing_recorded, copy_s1, lineage_runs, log_lines, run_in_process,
                                 s1_args, snapshot, tensors_sha256, the_error)

from reshard_job.storage import SourceChangedError


@pytest.fixture
def s1(tmp_path):
    ckpts, src, dst = copy_s1(tmp_path / "src")
    before = snapshot(tmp_path / "src")
    yield ckpts, src, dst
    assert snapshot(tmp_path / "src") == before, "source files changed"


def _db(cwd: Path) -> Path:
    return cwd / "runs" / "lineage.db"


def _expected(rank: int) -> dict[str, str]:
    manifest = json.loads((S1 / "manifest.json").read_text())
    return {name: info["sha256"] for name, info in manifest["expected"][str(rank)].items()}


def _flip_byte(path: Path, offset: int) -> None:
    mode = path.stat().st_mode
    path.chmod(mode | stat.S_IWUSR)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    path.chmod(mode)


# ============================================================================= sources that disagree
def test_sharded_rank_folders_without_a_strategy_are_refused(tmp_path, s1, app):
    ckpts, src, dst = s1
    out = tmp_path / "out"
    error = the_error(app(tmp_path, f"source.checkpoints={ckpts}", "target=single", f"output.dir={out}"))
    assert error.startswith(f"{ckpts}: source.strategy is not set, but the 8 rank folders hold different tensors (e.g. ")
    assert error.endswith("they look like shards of one model; set source.strategy to the strategy file saved with "
                          "them, or source.unsharded=true if each rank folder is a whole copy")
    assert_nothing_recorded(out, _db(tmp_path), error)
    # the user says they are whole copies: compared by content, they are not
    error = the_error(app(tmp_path, f"source.checkpoints={ckpts}", "source.unsharded=true", "target=single",
                          f"output.dir={out}"))
    assert "source.unsharded=true says each rank folder is a copy of rank_0's whole model, but" in error
    # and told not to compare: rank 0 is the model, as asked
    res = app(tmp_path, f"source.checkpoints={ckpts}", "source.unsharded=true", "source.verify_replicas=false",
              "target=single", f"output.dir={out}")
    assert res.returncode == 0, res.stderr


def test_identical_rank_folders_without_a_strategy_are_copies(tmp_path, app):
    """Pure data parallel training writes no strategy and the same checkpoint on every rank: fine."""
    ckpts = tmp_path / "dp"
    for r in range(4):
        (ckpts / f"rank_{r}").mkdir(parents=True)
        (ckpts / f"rank_{r}" / "checkpoint.ckpt").write_bytes((S1 / "expected" / "rank_0" / "checkpoint_0.ckpt").read_bytes())
    res = app(tmp_path, f"source.checkpoints={ckpts}", "target=single", f"output.dir={tmp_path / 'out'}")
    assert res.returncode == 0, res.stderr


def _safetensors_sources(tmp_path: Path) -> tuple[Path, list[str]]:
    """S1's source ranks as MindSpore-flavoured safetensors files with crc_num."""
    from reshard_job.formats.ckpt import CheckpointReader
    from reshard_job.formats.safetensors import save_file

    out = tmp_path / "st"
    for rank in range(8):
        with CheckpointReader(S1 / "src_checkpoints" / f"rank_{rank}" / f"checkpoint_{rank}.ckpt") as r:
            tensors = {n: r.read(n) for n in r.names()}
            dtypes = {n: r.entries[n].dtype for n in r.names()}
        save_file(out / f"rank_{rank}" / f"checkpoint_{rank}.safetensors", tensors, crc=True, dtype_overrides=dtypes,
                  mode=0o644)
    return out, [f"source.strategy={S1 / 'src_strategy.ckpt'}", "target=strategy",
                 f"target.strategy={S1 / 'dst_strategy.ckpt'}"]


def test_safetensors_crc_num_is_checked(tmp_path, app):
    st, args = _safetensors_sources(tmp_path)
    res = app(tmp_path, f"source.checkpoints={st}", *args, f"output.dir={tmp_path / 'ok'}")
    assert res.returncode == 0, res.stderr  # intact files convert
    victim = st / "rank_2" / "checkpoint_2.safetensors"
    _flip_byte(victim, victim.stat().st_size - 3)  # one data byte of the last tensor
    second = tmp_path / "second"  # its own lineage database
    second.mkdir()
    error = the_error(app(second, f"source.checkpoints={st}", *args, f"output.dir={tmp_path / 'flipped'}"))
    assert error.startswith(f"{victim}: CRC32 mismatch: metadata crc_num says ") and error.endswith("(file corrupted)")
    assert_nothing_recorded(tmp_path / "flipped", _db(second), error)


def _mindspore_crc_num(arrays: dict) -> int:
    """MindSpore's safetensors crc_num: sorted names, each name then bytes(array) (for a 0-d integer
    array holding n, numpy's bytes() gives n zero bytes)."""
    import zlib

    crc = 0
    for name in sorted(arrays):
        crc = zlib.crc32(bytes(arrays[name]), zlib.crc32(name.encode("utf-8"), crc))
    return crc


def test_mindspore_crc_num_with_step_counters_converts_and_is_written_as_mindspore_checks_it(tmp_path, app):
    """Training saves carry 0-d int64 epoch_num/step_num; MindSpore's crc_num hashes them as their
    value in zero bytes. Such files, made by the safetensors library as MindSpore's save does, are
    accepted, and the crc_num of our outputs is what MindSpore's load(crc_check=True) recomputes."""
    import numpy as np
    import safetensors.numpy as stnp

    from reshard_job.formats.ckpt import CheckpointReader

    st = tmp_path / "st"
    for rank in range(8):
        with CheckpointReader(S1 / "src_checkpoints" / f"rank_{rank}" / f"checkpoint_{rank}.ckpt") as r:
            arrays = {n: r.read(n) for n in r.names() if r.entries[n].dtype != "BFloat16"}
        arrays.update(epoch_num=np.array(2, np.int64), step_num=np.array(1000, np.int64))
        (st / f"rank_{rank}").mkdir(parents=True)
        stnp.save_file(arrays, str(st / f"rank_{rank}" / f"checkpoint_{rank}.safetensors"),
                       metadata={"format": "ms", "crc_num": str(_mindspore_crc_num(arrays))})
    out = tmp_path / "out"
    res = app(tmp_path, f"source.checkpoints={st}", f"source.strategy={S1 / 'src_strategy.ckpt'}", "target=strategy",
              f"target.strategy={S1 / 'dst_strategy.ckpt'}", "target.format=safetensors", "target.crc=true",
              f"output.dir={out}")
    assert res.returncode == 0, res.stderr
    outputs = sorted(out.glob("rank_*/*.safetensors"))
    assert len(outputs) == 4
    for path in outputs:
        back = stnp.load_file(str(path))
        assert back["step_num"] == 1000
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            meta = json.loads(f.read(n))["__metadata__"]
        assert int(meta["crc_num"]) == _mindspore_crc_num(back)


def test_a_garbled_crc_num_is_refused(tmp_path, app):
    st, args = _safetensors_sources(tmp_path)
    victim = st / "rank_1" / "checkpoint_1.safetensors"  # a rank the plan reads
    data = victim.read_bytes()
    at = data.index(b'"crc_num":"') + len(b'"crc_num":"')
    victim.chmod(0o644)
    victim.write_bytes(data[:at] + b"x" + data[at + 1:])
    error = the_error(app(tmp_path, f"source.checkpoints={st}", *args, f"output.dir={tmp_path / 'out'}"))
    assert error.startswith(f"{victim}: metadata crc_num ") and "is not a CRC32 value" in error


# ============================================================================= changes under the job
def test_a_source_changed_after_hashing_fails_the_run(tmp_path, s1, monkeypatch):
    """The bytes a job reads must be the bytes it named: a source replaced between hashing and reading
    is caught, nothing is recorded as output, the run is failed with the file's name."""
    import reshard_job.job.runner as runner

    ckpts, src, dst = s1
    victim = ckpts / "rank_3" / "checkpoint_3.ckpt"
    st = victim.stat()
    real = runner.hash_sources

    def hash_then_change(prepared, **kw):
        digests = real(prepared, **kw)
        _flip_byte(victim, 40)  # the same size; only its identity (ctime) tells
        return digests

    monkeypatch.setattr(runner, "hash_sources", hash_then_change)
    out = tmp_path / "out"
    with pytest.raises(SourceChangedError, match=rf"^{victim}: source file of rank 3 changed while the job was running"):
        run_in_process(tmp_path, *s1_args(ckpts, src, dst, out))
    _flip_byte(victim, 40)  # restore for the fixture's check (the change time moved on anyway)
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert not (out / "manifest.json").exists()
    assert [r["status"] for r in lineage_runs(_db(tmp_path))] == ["failed"]


def test_an_output_changed_after_completion_is_redone_on_rerun(tmp_path, s1, app):
    ckpts, src, dst = s1
    out = tmp_path / "out"
    assert app(tmp_path, *s1_args(ckpts, src, dst, out)).returncode == 0
    victim = out / "rank_1" / "checkpoint_1.ckpt"
    _flip_byte(victim, victim.stat().st_size // 2)  # same size, one byte
    res = app(tmp_path, *s1_args(ckpts, src, dst, out))
    assert res.returncode == 0, res.stderr
    assert "completed:" in res.stdout and "already done" not in res.stdout
    assert any("listed in its manifest are missing or changed (rank_1/checkpoint_1.ckpt); redoing what does not "
               "verify" in ln
               for ln in log_lines(res.stderr, "WARNING"))
    assert tensors_sha256(victim) == _expected(1)
    manifest = json.loads((out / "manifest.json").read_text())
    recorded = next(f for f in manifest["target"]["files"] if f["rank"] == 1)
    assert recorded["sha256"] == hashlib.sha256(victim.read_bytes()).hexdigest()


def test_a_rerun_of_an_intact_output_rereads_nothing_it_can_trust(tmp_path, s1, app):
    ckpts, src, dst = s1
    out = tmp_path / "out"
    assert app(tmp_path, *s1_args(ckpts, src, dst, out)).returncode == 0
    outputs = [p for p in out.iterdir() if p.name != ".reshard_job"]  # (the lock file names its holder)
    before = snapshot(*outputs)
    res = app(tmp_path, *s1_args(ckpts, src, dst, out))
    assert res.returncode == 0 and "completed (already done)" in res.stdout
    assert snapshot(*outputs) == before


# ============================================================================= nothing outside output.dir
def test_a_planted_symlink_cannot_lead_writes_out_of_output_dir(tmp_path, s1, app):
    ckpts, src, dst = s1
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "checkpoint_0.ckpt").write_bytes(b"someone else's file")
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(elsewhere, out / "rank_0")
    for extra in ([], ["output.overwrite=true"]):
        error = the_error(app(tmp_path, *s1_args(ckpts, src, dst, out), *extra))
        assert error.startswith(f"output.dir {out}: rank_0/checkpoint_0.ckpt would be written to "
                                f"{elsewhere}/checkpoint_0.ckpt, outside output.dir")
    assert (elsewhere / "checkpoint_0.ckpt").read_bytes() == b"someone else's file"


def test_files_are_never_world_writable_whatever_the_umask(tmp_path, s1):
    ckpts, src, dst = s1
    out = tmp_path / "out"
    old = os.umask(0)
    try:
        run_in_process(tmp_path, *s1_args(ckpts, src, dst, out))
    finally:
        os.umask(old)
    written = [p for p in out.rglob("*")]
    assert written and all(not p.stat().st_mode & stat.S_IWOTH for p in written), \
        [p for p in written if p.stat().st_mode & stat.S_IWOTH]
