"""``reshard_job.load_rank``: every target rank of every golden scenario, loaded straight from the
sources, holds exactly the tensors the conversion writes for that rank, byte for byte."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import reshard_job
from reshard_job.errors import ReshardError
from reshard_job.formats.ckpt import CheckpointReader


def _written(path) -> dict[str, bytes]:
    with CheckpointReader(path) as r:
        return {n: r.read_raw(n) for n in r.names() if r[n].kind == "tensor"}


def test_every_rank_loads_what_the_conversion_writes_for_it(golden_scenario, tmp_path):
    s = golden_scenario
    src, dst = str(s.src_checkpoints), s.dst_strategy
    reshard_job.transform_checkpoints(src, str(tmp_path / "out"), "checkpoint_", s.src_strategy, dst)
    devices = len(list((tmp_path / "out").glob("rank_*")))
    assert devices >= 1
    for rank in range(devices):
        loaded = reshard_job.load_rank(rank, src, s.src_strategy, dst)
        written = _written(tmp_path / "out" / f"rank_{rank}" / f"checkpoint_{rank}.ckpt")
        assert list(loaded) == list(written), rank
        for name, array in loaded.items():
            assert isinstance(array, np.ndarray) and array.tobytes() == written[name], (rank, name)


def test_bfloat16_comes_back_as_ml_dtypes_bfloat16(tmp_path, helpers):
    import ml_dtypes

    from reshard_job.core.dtypes import bf16_to_float32, float32_to_bf16

    words = float32_to_bf16(np.linspace(-2, 2, 12, dtype=np.float32)).reshape(3, 4)
    helpers.write_sharded(tmp_path / "src", {"w": (words, "BFloat16")})
    loaded = reshard_job.load_rank(0, tmp_path / "src")
    assert loaded["w"].dtype == ml_dtypes.bfloat16 and loaded["w"].shape == (3, 4)
    np.testing.assert_array_equal(loaded["w"].astype(np.float32), bf16_to_float32(words))


def test_iter_rank_yields_the_same_as_load_rank_a_few_at_a_time(golden_scenario):
    s = golden_scenario
    whole = reshard_job.load_rank(0, s.src_checkpoints, s.src_strategy, s.dst_strategy)
    streamed = list(reshard_job.iter_rank(0, s.src_checkpoints, s.src_strategy, s.dst_strategy))
    assert [n for n, _ in streamed] == list(whole)
    assert all(a.tobytes() == whole[n].tobytes() for n, a in streamed)


def test_a_rank_the_target_does_not_have_is_refused_in_one_line(golden_scenario):
    s = golden_scenario
    with pytest.raises(ReshardError, match=r"target rank 999 is outside 0\.\.\d+"):
        reshard_job.load_rank(999, s.src_checkpoints, s.src_strategy, s.dst_strategy)


@pytest.mark.parametrize("name", ["M1a_mf_llama_dp2mp2os_bf16_to_mp4", "M1b_mf_llama_pp2dp2mp2os2_to_mp4"])
def test_a_mindformers_save_loads_as_the_conversion_writes_it(name, tmp_path):
    d = Path(__file__).parents[2] / "golden" / name
    src, dst = str(d / "src_mindformers"), str(d / "dst_strategy.ckpt")
    reshard_job.transform_checkpoints(src, str(tmp_path / "out"), "checkpoint_", None, dst)
    for rank in range(4):
        loaded = reshard_job.load_rank(rank, src, None, dst)
        written = _written(tmp_path / "out" / f"rank_{rank}" / f"checkpoint_{rank}.ckpt")
        assert list(loaded) == list(written) and loaded
        assert all(loaded[n].tobytes() == written[n] for n in written), rank


def test_a_recorded_load_is_a_descendant_of_the_files_it_read(tmp_path, capsys, monkeypatch):
    from reshard_job.audit import main as audit

    d = Path(__file__).parents[2] / "golden" / "S2_block_mp4dp2opt_to_mp4"
    src, src_strategy, dst_strategy = d / "src_checkpoints", d / "src_strategy.ckpt", d / "dst_strategy.ckpt"
    url = f"sqlite:///{tmp_path / 'lineage.db'}"
    monkeypatch.setenv("RESHARD_JOB_CONSUMER", "finetune-7b")
    plain = reshard_job.load_rank(2, src, src_strategy, dst_strategy)
    recorded = reshard_job.load_rank(2, src, src_strategy, dst_strategy, lineage_url=url)
    assert list(recorded) == list(plain)
    assert audit(["--db", url, "runs", "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)
    assert len(runs) == 1 and runs[0]["status"] == "completed"
    assert "finetune-7b" in runs[0]["output_dir"] and "target rank 2" in runs[0]["output_dir"]
    assert audit(["--db", url, "show", runs[0]["id"], "--json"]) == 0
    inputs = {i["path"] for i in json.loads(capsys.readouterr().out)["inputs"]}
    assert str(src_strategy) in inputs and str(dst_strategy) in inputs
    source_file = next(p for p in sorted(inputs) if "/rank_" in p)
    assert audit(["--db", url, "trace", source_file, "--descendants", "--json"]) == 0
    assert runs[0]["id"] in capsys.readouterr().out
