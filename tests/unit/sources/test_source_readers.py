"""The ``SourceReader`` protocol (``sources.base``): each kind of source is detected from the path
itself, in order (single file, MindFormers save, export folder, rank folders), and a folder of no kind is
refused by rank-folder discovery with the line it always had."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from reshard_job import api
from reshard_job.errors import ConfigError, FormatError
from reshard_job.job.config.spec import SourceSpec, TargetSpec
from reshard_job.job.stages.prepare import prepare
from reshard_job.sources.base import READERS, SourceReader, reader_for, reader_for_files
from reshard_job.sources.export_folder import ExportFolder
from reshard_job.sources.mindformers import MindFormersFolder
from reshard_job.sources.rank_folders import RankFolders, load_strategy
from reshard_job.sources.single_file import SingleFile

GOLDEN = Path(__file__).resolve().parents[2] / "golden"
M1A = GOLDEN / "M1a_mf_llama_dp2mp2os_bf16_to_mp4"
S1 = GOLDEN / "S1_mlp_tutorial_8to4"
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def export_folder(tmp_path_factory) -> Path:
    """S1's model exported for inference in several shards."""
    out = tmp_path_factory.mktemp("export") / "exp"
    api.transform_checkpoints(S1 / "src_checkpoints", out, "", S1 / "src_strategy.ckpt",
                              output_format="safetensors_index", max_shard_size="20KB")
    assert len(list(out.glob("model-*.safetensors"))) > 1
    return out


def kind_of(path) -> type:
    return type(reader_for(SourceSpec(str(path))))


def test_every_kind_implements_the_protocol_and_they_are_tried_in_order():
    assert READERS == (SingleFile, MindFormersFolder, ExportFolder, RankFolders)
    methods = {n for n in vars(SourceReader) if not n.startswith("_") and callable(getattr(SourceReader, n))}
    assert methods == {"detect", "check", "discover", "layouts", "verify"}
    for kind in READERS:
        assert all(callable(getattr(kind, m)) for m in methods), kind


def test_each_kind_is_detected_from_its_folder(export_folder, tmp_path):
    assert kind_of(M1A / "src_mindformers") is MindFormersFolder
    assert kind_of(M1A / "src_mindformers" / "iteration_00000020") is MindFormersFolder
    assert kind_of(export_folder) is ExportFolder
    assert kind_of(S1 / "src_checkpoints") is RankFolders
    # a folder of rank_<r>/ directories is MindSpore's layout, whatever else it holds
    mixed = tmp_path / "mixed"
    (mixed / "rank_0").mkdir(parents=True)
    (mixed / "metadata.json").write_text("{}")
    assert kind_of(mixed) is RankFolders


def test_a_folder_of_no_kind_is_refused_as_rank_folders(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("x")
    for folder, what in ((empty, "is empty"), (other, "has no rank_<r>/ directories")):
        assert kind_of(folder) is RankFolders
        with pytest.raises(ConfigError) as err:
            prepare(SourceSpec(str(folder)), TargetSpec())
        assert str(err.value) == (f"source checkpoint directory {folder} {what}; "
                                  "expected rank_0/, rank_1/, ... each with a .ckpt file")
    with pytest.raises(ConfigError, match="source checkpoint directory not found"):
        prepare(SourceSpec(str(tmp_path / "absent")), TargetSpec())


def test_each_kind_refuses_the_settings_that_do_not_apply(export_folder):
    with pytest.raises(ConfigError) as err:
        prepare(SourceSpec(str(export_folder), str(S1 / "src_strategy.ckpt")), TargetSpec())
    assert str(err.value) == (f"{export_folder} holds {INDEX}: an export of the full model, which has no source "
                              f"strategy; set source.strategy=null (got {S1 / 'src_strategy.ckpt'})")
    for folder in (export_folder, S1 / "src_checkpoints"):
        with pytest.raises(ConfigError) as err:
            prepare(SourceSpec(str(folder), iteration=7), TargetSpec())
        assert str(err.value) == (f"source.iteration=7 picks an iteration of a MindFormers checkpoint folder, but "
                                  f"{folder} holds no MindFormers save (set source.iteration=null)")


def test_an_export_folder_is_one_rank_checked_against_its_index(export_folder, tmp_path):
    with prepare(SourceSpec(str(export_folder)), TargetSpec()) as prepared:
        assert list(prepared.source_paths) == [0]
        assert sorted(Path(f).name for f in prepared.source_files()) == \
            sorted(p.name for p in export_folder.glob("model-*.safetensors"))
        assert f"every tensor is in the shard {INDEX} names" in prepared.checks
    # an index that misplaces a tensor is refused once the shards are open
    moved = tmp_path / "moved"
    shutil.copytree(export_folder, moved)
    doc = json.loads((moved / INDEX).read_text())
    name, shard = next(iter(doc["weight_map"].items()))
    doc["weight_map"][name] = next(s for s in sorted(set(doc["weight_map"].values())) if s != shard)
    (moved / INDEX).write_text(json.dumps(doc))
    with pytest.raises(FormatError, match=f"{INDEX}: .*tensor {name!r}"):
        prepare(SourceSpec(str(moved)), TargetSpec())


def test_layouts_come_from_the_strategy_or_the_source_itself():
    strategy = str(S1 / "src_strategy.ckpt")
    got = RankFolders(str(S1 / "src_checkpoints")).layouts(strategy)
    assert got.topology.devices == load_strategy(strategy).topology.devices == 8 and got.files == (strategy,)
    mf = MindFormersFolder(str(M1A / "src_mindformers")).layouts()
    assert mf.topology.devices == 4 and mf.files[0].endswith("metadata.json")


def test_files_given_by_rank_are_a_mindformers_saves_or_single_files():
    files = {r: tuple(f) for r, f in api.mindformers_rank_files(M1A / "src_mindformers").items()}
    reader = reader_for_files(files, None)
    assert isinstance(reader, MindFormersFolder)
    found = reader.discover(SourceSpec(reader.root))
    assert found.files == files
    single = {r: (str(S1 / "src_checkpoints" / f"rank_{r}" / f"checkpoint_{r}.ckpt"),) for r in range(2)}
    reader = reader_for_files(single, None)
    assert isinstance(reader, RankFolders) and reader.root == str(S1 / "src_checkpoints")
    found = reader.discover(SourceSpec(None))
    assert found.files == {r: p[0] for r, p in single.items()} and found.format == "ckpt"
