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


@pytest.mark.parametrize("files", [2, 3, 7])  # asked in turn, and (more than four) one dict of names
def test_files_read_as_one_rank_each_tensor_found_in_its_file_and_a_name_in_two_refused(tmp_path, files):
    import numpy as np

    from reshard_job.errors import FormatError
    from safetensors.numpy import save_file

    paths = []
    for i in range(files):
        paths.append(str(tmp_path / f"f{i}.safetensors"))
        save_file({f"t{i}.{j}": np.full(j + 1, i, np.float32) for j in range(3)}, paths[-1])
    with MultiFileReader(paths) as reader:
        assert list(reader) == [f"t{i}.{j}" for i in range(files) for j in range(3)] and len(reader) == 3 * files
        for i in range(files):
            assert reader.file_of(f"t{i}.2") == paths[i] and reader.read(f"t{i}.1").tolist() == [i, i]
        assert "t0.9" not in reader and reader.whole_span("t0.9") is None
    save_file({"x": np.zeros(1, np.float32), "t0.1": np.zeros(2, np.float32)}, paths[-1])  # t0.1 twice
    with pytest.raises(FormatError) as e:
        MultiFileReader(paths)
    assert str(e.value).startswith(paths[-1]) and f"'t0.1' is also in {paths[0]}" in str(e.value)


def test_the_jobs_readers_take_the_headers_the_save_parsed_and_parse_any_other_file(m1a, tmp_path, monkeypatch):
    import numpy as np
    from safetensors.numpy import save_file

    from reshard_job.job.config.spec import SourceSpec, TargetSpec
    from reshard_job.job.stages.prepare import prepare

    parsed = []
    index = SafetensorsReader._index
    monkeypatch.setattr(SafetensorsReader, "_index",
                        lambda self, *twins: parsed.append(self.path) or index(self, *twins))
    with prepare(SourceSpec(str(m1a)), TargetSpec(devices=1)) as prepared:
        files = [f for rank_files in prepared.readers.paths.values() for f in rank_files]
        assert sorted(parsed) == sorted(files) == sorted(prepared.mindformers.parsed)  # each once, by the save
        for rank in prepared.readers.paths:
            assert prepared.readers.raw_reader(rank).names()  # opened: nothing parsed again
        assert len(parsed) == len(files)
    a, b = str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")
    save_file({"x": np.arange(3, dtype=np.float32)}, a)
    save_file({"y": np.arange(4, dtype=np.int8), "z": np.zeros(1, np.float32)}, b)
    with SafetensorsReader(a) as first:
        pass
    with SafetensorsReader(b, parsed=first) as other:  # another file: its own header
        assert sorted(other.entries) == ["y", "z"] and other.read("y").tolist() == [0, 1, 2, 3]
    with SafetensorsReader(a, parsed=first) as same:
        assert list(same.entries) == ["x"] and same.read("x").tolist() == [0, 1, 2]
    assert parsed.count(a) == 1 and parsed.count(b) == 1  # a's header taken the second time, b's parsed


def test_replica_ranks_with_byte_identical_safetensors_headers_are_parsed_once(tmp_path, monkeypatch):
    """Data parallel replicas (or ranks holding equal slices) write byte-identical headers: the
    second such file takes the columns of the first, and still serves its own bytes; a header that
    differs (another tensor, or another crc_num), or the same header in a file of another size, is
    parsed."""
    import numpy as np

    from reshard_job.errors import SafetensorsFormatError
    from reshard_job.formats.safetensors import save_file

    parsed = []
    real = SafetensorsReader._read_header
    monkeypatch.setattr(SafetensorsReader, "_read_header", lambda self, stream: (parsed.append(self.path),
                                                                                 real(self, stream))[1])
    paths = {}
    for rank, (w, b) in enumerate([(1, 2), (3, 4), (5, 6)]):
        names = ("w", "b") if rank < 2 else ("w", "c")
        paths[rank] = str(tmp_path / f"checkpoint_{rank}.safetensors")
        save_file(paths[rank], {names[0]: np.full((2, 3), w, np.float32), names[1]: np.full(4, b, np.float16)})
    with SourceFiles(paths) as sources:
        got = {r: sources.reader(r).read("w") for r in paths}
        assert [int(got[r][0, 0]) for r in paths] == [1, 3, 5]
        assert int(sources.reader(1).read("b")[0]) == 4 and "c" in sources.reader(2).entries
    assert sorted(parsed) == sorted([paths[0], paths[2]])

    # the same header in front of a shorter data section is this file's own (and refused)
    with open(paths[1], "r+b") as f:
        f.truncate(os.path.getsize(paths[1]) - 4)
    with SourceFiles(paths) as sources:
        sources.reader(0)
        with pytest.raises(SafetensorsFormatError, match="checkpoint_1.safetensors: tensor 'b'"):
            sources.reader(1)
    # with MindSpore's crc_num the headers differ: each is parsed
    for rank in (0, 1):
        save_file(paths[rank], {"w": np.full((2, 3), rank, np.float32), "b": np.ones(4, np.float16)}, crc=True)
    parsed.clear()
    with SourceFiles(paths) as sources:
        assert int(sources.reader(1).read("w")[0, 0]) == 1 and sources.reader(0).has_crc
    assert sorted(parsed) == sorted([paths[0], paths[1]])
