"""What ``load_rank`` verifies: a corrupted byte in a range the rank reads is refused, in one line
naming the file, by the format's CRC (a ``.ckpt`` trailer, safetensors' ``crc_num``) with
``verify="full"`` and whenever the load is recorded in lineage; replicas that disagree are refused
with ``verify="full"``; a file changed during the load is refused after the last read. The default
reads only the rank's ranges (module docstring of ``reshard_job.loading``)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

import reshard_job
from reshard_job.errors import ConfigError, FormatError, PlanError
from reshard_job.formats.ckpt import CheckpointReader
from reshard_job.formats.rewrite import copy_checkpoint
from reshard_job.formats.safetensors import SafetensorsReader, SafetensorsWriter
from reshard_job.storage import SourceChangedError

S1 = Path(__file__).resolve().parents[2] / "golden" / "S1_mlp_tutorial_8to4"
SRC_STRATEGY, DST_STRATEGY = S1 / "src_strategy.ckpt", S1 / "dst_strategy.ckpt"
RANK = 3  # target rank 3 of S1 reads source ranks 1 and 3, which hold replicas of several tensors


def _with_crcs(root: Path, fmt: str) -> Path:
    """S1's source ranks rewritten with their format's CRC (trailer, or crc_num)."""
    for rank in range(8):
        src = S1 / "src_checkpoints" / f"rank_{rank}" / f"checkpoint_{rank}.ckpt"
        out = root / f"rank_{rank}" / f"checkpoint_{rank}.{fmt}"
        out.parent.mkdir(parents=True)
        with CheckpointReader(src) as r:
            if fmt == "ckpt":
                copy_checkpoint(r, out, crc=True)
                continue
            w = SafetensorsWriter(str(out), crc=True)
            for name in r.names():
                if r[name].kind == "tensor":
                    w.add_bytes(name, r[name].dtype, r[name].shape, r.read_raw(name))
            w.commit()
    return root


def _content_spans(path: Path) -> list[tuple[str, int, int]]:
    """(tensor, file offset, length) of every tensor's bytes in a file."""
    opener = CheckpointReader if path.suffix == ".ckpt" else SafetensorsReader
    with opener(path) as r:
        return [(n, e.pieces[0][0], e.pieces[0][1]) for n, e in r.entries.items()
                if getattr(e, "kind", "tensor") == "tensor" and e.pieces and e.pieces[0][1] >= 4]


def _flip(path: Path, offset: int) -> None:
    os.chmod(path, 0o644)
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def _corrupt_a_byte_the_rank_reads(root: Path, fmt: str) -> Path:
    """Flip one byte of a tensor the rank loads (shown by the default load returning it changed);
    the file it is in."""
    clean = {n: a.tobytes() for n, a in reshard_job.load_rank(RANK, root, SRC_STRATEGY, DST_STRATEGY).items()}
    for source in (1, 3):
        path = root / f"rank_{source}" / f"checkpoint_{source}.{fmt}"
        for name, offset, length in _content_spans(path):
            _flip(path, offset + length // 2)
            got = reshard_job.load_rank(RANK, root, SRC_STRATEGY, DST_STRATEGY)
            if any(a.tobytes() != clean[n] for n, a in got.items()):
                return path
            _flip(path, offset + length // 2)  # not read by this rank: put it back
    raise AssertionError("target rank 3 reads no tensor bytes of source ranks 1 and 3")


@pytest.fixture(params=["ckpt", "safetensors"])
def corrupted(request, tmp_path) -> tuple[Path, Path]:
    """(source folder with CRCs, the file in it with one flipped byte the rank reads)."""
    root = _with_crcs(tmp_path / "src", request.param)
    full = reshard_job.load_rank(RANK, root, SRC_STRATEGY, DST_STRATEGY, verify="full")
    plain = reshard_job.load_rank(RANK, S1 / "src_checkpoints", SRC_STRATEGY, DST_STRATEGY)
    assert {n: a.tobytes() for n, a in full.items()} == {n: a.tobytes() for n, a in plain.items()}
    return root, _corrupt_a_byte_the_rank_reads(root, request.param)


def _one_line_naming(err, path: Path) -> None:
    text = str(err.value)
    assert text.startswith(f"{path}: CRC32 mismatch") and "(file corrupted)" in text and "\n" not in text


def test_verify_full_refuses_a_corrupted_byte_naming_the_file(corrupted):
    root, bad = corrupted
    with pytest.raises(FormatError) as err:
        reshard_job.load_rank(RANK, root, SRC_STRATEGY, DST_STRATEGY, verify="full")
    _one_line_naming(err, bad)
    with pytest.raises(FormatError) as err:
        next(reshard_job.iter_rank(RANK, root, SRC_STRATEGY, DST_STRATEGY, verify="full"))  # before any array
    _one_line_naming(err, bad)


def test_a_recorded_load_checks_the_crc_in_the_read_that_hashes_the_files(corrupted, tmp_path, capsys):
    from reshard_job.audit import main as audit

    root, bad = corrupted
    url = f"sqlite:///{tmp_path / 'lineage.db'}"
    reshard_job.load_rank(RANK, S1 / "src_checkpoints", SRC_STRATEGY, DST_STRATEGY, lineage_url=url)
    with pytest.raises(FormatError) as err:
        reshard_job.load_rank(RANK, root, SRC_STRATEGY, DST_STRATEGY, lineage_url=url)
    _one_line_naming(err, bad)
    assert audit(["--db", url, "runs", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 1  # the clean load only: the refused one is not recorded


def test_verify_full_compares_the_replicas_the_rank_does_not_read(tmp_path):
    root = tmp_path / "src"
    shutil.copytree(S1 / "src_checkpoints", root)
    clean = {n: a.tobytes() for n, a in reshard_job.load_rank(RANK, root, SRC_STRATEGY, DST_STRATEGY).items()}
    for source in (3, 1):  # change the copy of layer2.weight the rank does not read
        path = root / f"rank_{source}" / f"checkpoint_{source}.ckpt"
        offset, length = next((o, n) for name, o, n in _content_spans(path) if name == "layer2.weight")
        _flip(path, offset + length // 2)
        got = reshard_job.load_rank(RANK, root, SRC_STRATEGY, DST_STRATEGY)
        if got["layer2.weight"].tobytes() == clean["layer2.weight"]:
            break
        _flip(path, offset + length // 2)
    else:
        raise AssertionError("layer2.weight is read from both ranks")
    with pytest.raises(PlanError, match=r"parameter 'layer2.weight' differs between source ranks 1, 3") as err:
        reshard_job.load_rank(RANK, root, SRC_STRATEGY, DST_STRATEGY, verify="full")
    assert "\n" not in str(err.value)


def test_a_file_changed_during_the_load_is_refused_after_the_last_read(tmp_path):
    root = tmp_path / "src"
    shutil.copytree(S1 / "src_checkpoints", root)
    loading = reshard_job.iter_rank(RANK, root, SRC_STRATEGY, DST_STRATEGY)
    next(loading)
    changed = root / "rank_1" / "checkpoint_1.ckpt"
    os.utime(changed, ns=(1, 1))  # what any write does to a file's identity
    with pytest.raises(SourceChangedError, match=f"{changed}: source file of rank 1 changed"):
        list(loading)


def test_a_verify_level_that_does_not_exist_is_refused():
    with pytest.raises(ConfigError, match=r"verify must be 'read' or 'full', got 'crc'"):
        reshard_job.load_rank(0, S1 / "src_checkpoints", SRC_STRATEGY, DST_STRATEGY, verify="crc")


@pytest.mark.parametrize("unmapped", ["bogus", None, 3])
def test_an_unmapped_choice_that_does_not_exist_is_refused(unmapped):
    with pytest.raises(ConfigError, match=r"unmapped must be 'omit' or 'full' or 'drop', got "):
        reshard_job.load_rank(0, S1 / "src_checkpoints", SRC_STRATEGY, DST_STRATEGY, unmapped=unmapped)
