"""metadata.json without ``rank_group``: what MindFormers' ``save_metadata`` of some versions writes
(``storage_data`` entries of ``file_name`` and ``storage_rank`` only) and its own test
``test_checkpoint.py::test_get_metadata_of_checkpoint`` loads. MindFormers' loader reads only
those two keys; the holders of a shard are then the ranks the layout gives it, which is what the
files that do carry ``rank_group`` say, so stripping it from them must change nothing."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from reshard_job.formats.mindformers_metadata import MindFormersFormatError, parse_metadata
from reshard_job.sources.mindformers_save import load_mindformers

from mf_save import dedup_params, dedup_writer, write_mf_save

M1A = Path(__file__).resolve().parents[2] / "golden" / "M1a_mf_llama_dp2mp2os_bf16_to_mp4" / "src_mindformers"


def mindformers_test_document() -> dict:
    """The document of MindFormers' test_get_metadata_of_checkpoint, as written there."""
    return {
        "state_dict_metadata": {
            "decoder.final_layernorm.weight": {
                "properties": {"dtype": "Float32", "replica_id": [0, 1, 2, 3], "allow_shape_mismatch": False,
                               "allow_to_save": True},
                "global_shape": [896],
                "axis_fragmentations": [1],
                "layout": {"device_matrix": [1, 1, 4], "tensor_map": [-1], "interleaved_parallel": False,
                           "alias_name": ["a", "b", "c"], "rank_list": [0, 1, 2, 3]},
                "chunk": [{"global_offset": [0], "local_shape": [896]}],
            }
        },
        "storage_data": {
            "('decoder.final_layernorm.weight', (0,))": [
                {"file_name": "deepseekv3-model-0000003-0000004.safetensors", "storage_rank": 3}
            ]
        },
    }


def test_mindformers_own_test_document_is_accepted():
    params = parse_metadata(json.dumps(mindformers_test_document()).encode(), "metadata.json")
    p = params["decoder.final_layernorm.weight"]
    (loc,) = p.locations[0]
    assert (loc.file_name, loc.storage_rank) == ("deepseekv3-model-0000003-0000004.safetensors", 3)
    assert loc.rank_group == (0, 1, 2, 3)  # replicated on the layout's four ranks, stored by one
    assert p.holders(0) == (3,) and p.dtype == "Float32"


def test_a_rank_absent_from_the_layout_is_still_refused():
    doc = mindformers_test_document()
    doc["storage_data"]["('decoder.final_layernorm.weight', (0,))"][0]["storage_rank"] = 7
    with pytest.raises(MindFormersFormatError, match="rank 7 is not in the layout's rank_list"):
        parse_metadata(json.dumps(doc).encode(), "metadata.json")


def _strip_rank_groups(folder: Path) -> None:
    meta = next(folder.glob("iteration_*/metadata.json"))
    doc = json.loads(meta.read_text())
    for entries in doc["storage_data"].values():
        for e in entries:
            del e["rank_group"]
    os.chmod(meta, 0o644)
    meta.write_text(json.dumps(doc))


def _groups(src) -> dict:
    return {(name, k): [(loc.storage_rank, loc.rank_group) for loc in locs]
            for name, p in src.params.items() for k, locs in enumerate(p.locations)}


def test_golden_save_without_rank_group_reads_as_with_it(tmp_path):
    copy = tmp_path / "mf"
    shutil.copytree(M1A, copy)
    _strip_rank_groups(copy)
    want, got = load_mindformers(M1A), load_mindformers(copy)
    assert _groups(got) == _groups(want)
    assert got.deduplicated is want.deduplicated is False
    assert got.index() == want.index() and got.strategy.layouts == want.strategy.layouts


def test_redundancy_removed_save_without_rank_group_is_still_seen_as_deduplicated(tmp_path):
    write_mf_save(tmp_path / "with", dedup_params(), stored_by=dedup_writer, world=4)
    shutil.copytree(tmp_path / "with", tmp_path / "without")
    _strip_rank_groups(tmp_path / "without")
    want, got = load_mindformers(tmp_path / "with"), load_mindformers(tmp_path / "without")
    assert got.deduplicated and _groups(got) == _groups(want)
    assert got.params["model.wo.weight"].locations[0][0].rank_group == (0, 2)
