"""Source ranks made of several files (a MindFormers rank's model and opt files) through
``execute.SourceFiles`` and ``run_rank_task``: opened as one rank, each file's identity checked, a
changed file named in one line, and writer metadata passed through to the output."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from reshard_job.sources.open_files import SourceFiles, current_identity

from reshard_job.execute.rank_task import run_rank_task
from reshard_job.sources.mindformers_save import load_mindformers
from reshard_job.formats.multifile import MultiFileReader
from reshard_job.formats.safetensors import SafetensorsReader
from reshard_job.plan.planner import Planner
from reshard_job.sources.mindformers import discover_mindformers
from reshard_job.storage import SourceChangedError
from reshard_job.execute.tasks import RankTask, WriteOptions

M1A = Path(__file__).resolve().parents[2] / "golden" / "M1a_mf_llama_dp2mp2os_bf16_to_mp4"


@pytest.fixture
def m1a(tmp_path) -> Path:
    root = tmp_path / "mf"
    shutil.copytree(M1A / "src_mindformers", root)
    for dirpath, _, filenames in os.walk(root):
        for n in filenames:
            os.chmod(os.path.join(dirpath, n), 0o644)
    return root


def test_a_tuple_of_files_is_one_rank_with_one_identity_per_file(m1a):
    found, save = discover_mindformers(str(m1a))
    assert found.files == save.rank_files and all(len(ids) == 2 for ids in found.identities.values())
    with SourceFiles(found.files, identities=found.identities) as sources:
        reader = sources.reader(1)
        assert isinstance(reader, MultiFileReader) and reader.paths == save.rank_files[1]
        assert sources.index()[1] == save.index()[1]
        assert reader.identity == found.identities[1] == current_identity(found.files[1])
        sources.check_unchanged()
        opt = found.files[1][1]
        with open(opt, "r+b") as f:  # same size, new bytes and times: a changed file
            f.seek(100)
            f.write(b"\0")
        with pytest.raises(SourceChangedError) as err:
            sources.check_unchanged()
        assert str(err.value).startswith(f"{opt}: source file of rank 1 changed") and "\n" not in str(err.value)
    with SourceFiles(found.files, identities=found.identities) as sources, pytest.raises(SourceChangedError):
        sources.reader(1)  # refused before the first read


def test_rank_task_reads_a_tuple_and_writes_the_metadata_it_is_given(m1a, tmp_path):
    save = load_mindformers(m1a)
    (rp,) = Planner(save.topology, None, save.index()).plan().ranks
    task = RankTask(0, rp, {r: save.rank_files[r] for r in rp.source_ranks}, str(tmp_path / "full.safetensors"),
                    WriteOptions("safetensors", metadata={"format": "pt"}), part=3)
    result = run_rank_task(task)
    assert (result.part, result.target_rank) == (3, 0)
    with SafetensorsReader(result.path) as r:
        assert r.metadata == {"format": "pt"} and set(r.names()) == set(result.tensors)
