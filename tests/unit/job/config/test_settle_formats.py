"""Settling the keys of the formats MindFormers users have: source.iteration, and the export for
inference (target=hf_export, target.format=safetensors_index with max_shard_size and include)."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module

from reshard_job.errors import ConfigError
import reshard_job.job.config.schema as schema
from reshard_job.job.config.settle import settle
from reshard_job.job.config.spec import JobContext


def _settle(tmp_path, *overrides: str):
    schema.register()
    with initialize_config_module("reshard_job.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides), return_hydra_config=False)
    return settle(cfg, JobContext(str(tmp_path), str(tmp_path / "run"), tuple(overrides), from_presets=True))


def test_hf_export_preset_settles_to_an_unsharded_export(tmp_path):
    spec = _settle(tmp_path, "source.checkpoints=/data/mf", "target=hf_export")
    t = spec.target
    assert (t.format, t.strategy, t.layout, t.devices) == ("safetensors_index", None, None, 1)
    assert (t.max_shard_size, t.include) == (5 * 10**9, "weights")
    t = _settle(tmp_path, "source.checkpoints=/data/mf", "target=hf_export", "target.max_shard_size=2GiB",
                "target.include=all").target
    assert (t.max_shard_size, t.include) == (2 * 2**30, "all")
    t = _settle(tmp_path, "source.checkpoints=/data/mf", "target=single", "target.format=safetensors_index").target
    assert t.format == "safetensors_index"


def test_source_iteration(tmp_path):
    assert _settle(tmp_path, "source.checkpoints=/data/mf").source.iteration is None
    assert _settle(tmp_path, "source.checkpoints=/data/mf", "source.iteration=1200").source.iteration == 1200


@pytest.mark.parametrize("overrides,message", [
    (["target.format=safetensors_index"], "target.format=safetensors_index writes the full, unsharded model: "
                                          "use target=hf_export"),
    (["target=strategy", "target.strategy=/data/dst.ckpt", "target.format=safetensors_index"],
     "target.format=safetensors_index writes the full, unsharded model"),
    (["target=hf_export", "target.devices=2"], "target.devices=2 needs target.strategy or target.layout"),
    (["target=hf_export", "target.max_shard_size=lots"], "target.max_shard_size 'lots' is not a size"),
    (["target=hf_export", "target.max_shard_size=0"], "target.max_shard_size must be at least 1 byte"),
    (["target=hf_export", "target.include=weights_only"], "target.include must be weights or all, or a list of name patterns"),
    (["source.iteration=-1"], "source.iteration must be an integer from 0 to"),
])
def test_bad_values_are_refused_in_one_line(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as err:
        _settle(tmp_path, "source.checkpoints=/data/mf", *overrides)
    assert message in str(err.value) and "\n" not in str(err.value)
