"""A single checkpoint file as the source (``sources.single_file``): one whole model, read as the one
unsharded source rank by the job, the Python API and ``load_rank``, with the same bytes out as the
same file in a ``rank_0/`` folder, the file recorded as the input, and a missing, unfit or garbled
file refused in one line naming it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

import reshard_job
from reshard_job.errors import ConfigError, FormatError, ReshardError
from reshard_job.job.config.spec import SourceSpec
from reshard_job.sources.base import reader_for
from reshard_job.sources.rank_folders import RankFolders
from reshard_job.sources.single_file import SingleFile

GOLDEN = Path(__file__).resolve().parents[2] / "golden"
S5B = GOLDEN / "S5b_split_1to8"  # one whole model (MindSpore's save) split into 8 ranks
FOLDER = S5B / "src_checkpoints"
WHOLE = FOLDER / "rank_0" / "checkpoint_0.ckpt"
DST = str(S5B / "dst_strategy.ckpt")


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.glob("rank_*/*")) if p.is_file()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, bytes]:
    """The 8 ranks written from the rank_0/ folder holding the whole model (the existing path)."""
    out = tmp_path_factory.mktemp("from_folder")
    reshard_job.transform_checkpoints(FOLDER, out, "checkpoint_", None, DST)
    files = _files(out)
    assert len(files) == 8
    return files


@pytest.fixture(scope="module")
def whole_safetensors(tmp_path_factory) -> Path:
    """The same whole model as one .safetensors file."""
    out = tmp_path_factory.mktemp("st")
    reshard_job.transform_checkpoints(FOLDER, out, "model_", None, None, output_format="safetensors")
    return out / "rank_0" / "model_0.safetensors"


def test_a_file_is_a_single_file_source_and_a_folder_is_not(tmp_path):
    assert isinstance(reader_for(SourceSpec(str(WHOLE))), SingleFile)
    assert isinstance(reader_for(SourceSpec(str(tmp_path / "absent.safetensors"))), SingleFile)
    assert isinstance(reader_for(SourceSpec(str(FOLDER))), RankFolders)
    assert isinstance(reader_for(SourceSpec(str(tmp_path / "absent_folder"))), RankFolders)
    folder_named_like_a_file = tmp_path / "model.ckpt"
    (folder_named_like_a_file / "rank_0").mkdir(parents=True)
    assert isinstance(reader_for(SourceSpec(str(folder_named_like_a_file))), RankFolders)


def test_split_into_8_ranks_writes_what_the_rank_0_folder_gives(reference, tmp_path):
    written = reshard_job.transform_checkpoints(WHOLE, tmp_path, "checkpoint_", None, DST)
    assert sorted(written) == list(range(8))
    assert _files(tmp_path) == reference


def test_a_safetensors_file_splits_as_its_rank_0_folder_does(whole_safetensors, tmp_path):
    from_file = reshard_job.transform_checkpoints(whole_safetensors, tmp_path / "f", "checkpoint_", None, DST)
    from_folder = reshard_job.transform_checkpoints(whole_safetensors.parent.parent, tmp_path / "d", "checkpoint_",
                                                    None, DST)
    assert _files(tmp_path / "f") == _files(tmp_path / "d") and len(from_file) == len(from_folder) == 8


def test_load_rank_of_a_file_is_what_the_job_writes_for_each_rank(reference, whole_safetensors):
    from reshard_job.formats.ckpt import CheckpointReader

    for rank in (0, 5):
        loaded = reshard_job.load_rank(rank, WHOLE, None, DST)
        assert [(n, a.tobytes()) for n, a in loaded.items()] == \
               [(n, a.tobytes()) for n, a in reshard_job.load_rank(rank, FOLDER, None, DST).items()]
        st = reshard_job.load_rank(rank, whole_safetensors, None, DST)
        assert {n: a.tobytes() for n, a in st.items()} == {n: a.tobytes() for n, a in loaded.items()}
    with CheckpointReader(WHOLE) as whole:
        unsharded = reshard_job.load_rank(0, WHOLE)
        assert list(unsharded) == [n for n in whole.names() if whole[n].kind == "tensor"]
        assert all(a.tobytes() == whole.read_raw(n) for n, a in unsharded.items())


def test_a_missing_unfit_or_garbled_file_is_refused_in_one_line_naming_it(tmp_path):
    garbled = tmp_path / "garbled.ckpt"
    garbled.write_bytes(b"%PDF-1.4 not a checkpoint" * 8)
    notes = tmp_path / "notes.txt"
    notes.write_text("x")
    fifo = tmp_path / "pipe.ckpt"
    os.mkfifo(fifo)  # never opened: it would block
    cases = [(tmp_path / "missing.ckpt", ConfigError, f"source checkpoint file not found: {tmp_path / 'missing.ckpt'}"),
             (notes, ConfigError, f"source checkpoints {notes} is a file but not a checkpoint"),
             (fifo, ConfigError, f"source checkpoints {fifo} is neither a folder nor a regular file"),
             (garbled, FormatError, f"{garbled}: wrong magic")]
    for path, kind, line in cases:
        for load in (lambda: reshard_job.load_rank(0, path, None, DST),
                     lambda: reshard_job.transform_checkpoints(path, tmp_path / "out", "c_", None, DST)):
            with pytest.raises(kind) as err:
                load()
            assert str(err.value).startswith(line) and "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_a_strategy_of_several_devices_is_refused_for_one_file():
    s1_strategy = GOLDEN / "S1_mlp_tutorial_8to4" / "src_strategy.ckpt"
    with pytest.raises(ConfigError) as err:
        reshard_job.load_rank(0, WHOLE, s1_strategy, DST)
    assert str(err.value) == (
        f"source checkpoints {WHOLE} is a single checkpoint file, one whole model, but source.strategy {s1_strategy} "
        "lays out 8 devices; give the folder holding that save's rank_<r>/ folders, or source.strategy=null for a "
        "whole model")


def test_the_job_splits_a_file_and_records_it_as_the_input(reference, tmp_path, monkeypatch):
    from reshard_job.audit import main as audit
    from reshard_job.job.config import schema
    from reshard_job.job.config.settle import settle
    from reshard_job.job.config.spec import JobContext
    from reshard_job.job.runner import run_job

    url = f"sqlite:///{tmp_path / 'lineage.db'}"
    overrides = [f"source.checkpoints={WHOLE}", f"target.strategy={DST}", f"output.dir={tmp_path / 'out'}",
                 f"lineage.url={url}"]
    schema.register()
    with initialize_config_module("reshard_job.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    result = run_job(settle(cfg, JobContext(str(tmp_path), str(tmp_path / "run"), tuple(overrides),
                                            from_presets=True)), emit=lambda _: None)
    assert result.status == "completed"
    assert _files(tmp_path / "out") == reference
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["source"]["checkpoints"] == str(WHOLE) and manifest["source"]["strategy"] is None
    assert [(f["rank"], f["path"]) for f in manifest["source"]["files"]] == [(0, str(WHOLE))]
    assert audit(["--db", url, "trace", str(WHOLE), "--descendants", "--json"]) == 0


@pytest.mark.slow  # a subprocess: about 5 s
def test_the_command_line_refuses_a_missing_file_in_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "RESHARD_JOB_FULL_ERROR")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[3])  # this checkout's package, wherever run from
    missing = tmp_path / "model.safetensors"
    run = subprocess.run([sys.executable, "-m", "reshard_job", f"source.checkpoints={missing}",
                          f"target.strategy={DST}", f"output.dir={tmp_path / 'out'}", "lineage.url=null"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [f"reshard_job: error: source checkpoint file not found: {missing}"]
    assert not (tmp_path / "out").exists()


def test_a_file_changed_after_it_was_listed_is_refused(tmp_path):
    from reshard_job.job.config.spec import TargetSpec
    from reshard_job.job.stages.prepare import prepare_from
    from reshard_job.storage import SourceChangedError

    copy = tmp_path / "model.ckpt"
    shutil.copy(WHOLE, copy)
    source = SourceSpec(str(copy))
    reader = reader_for(source)
    found = reader.discover(source)
    with copy.open("r+b") as f:  # same size, new bytes: a later identity
        f.seek(100)
        f.write(b"\0")
    os.utime(copy, ns=(1, 1))
    with pytest.raises(SourceChangedError, match=f"{copy}: source file of rank 0 changed"):
        prepare_from(reader, found, source, TargetSpec(strategy=DST))
