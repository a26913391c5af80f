"""Settling target.remove_redundancy: off by default, kept for sharded targets, refused in one line
where there is nothing to deduplicate (one device, one full model)."""

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


def test_off_by_default_and_kept_for_a_sharded_target(tmp_path):
    assert _settle(tmp_path, "source.checkpoints=/data/ck").target.remove_redundancy is False
    for target in (["target=strategy", "target.strategy=/data/dst.ckpt"], ["target=demo_mlp"]):
        t = _settle(tmp_path, "source.checkpoints=/data/ck", *target, "target.remove_redundancy=true",
                    "target.format=safetensors").target
        assert t.remove_redundancy is True and t.format == "safetensors"


@pytest.mark.parametrize("overrides,message", [
    (["target=hf_export"], "target.remove_redundancy=true cannot apply to target.format=safetensors_index"),
    (["target=single"], "target.remove_redundancy=true needs a sharded target (target.strategy or target.layout)"),
])
def test_refused_in_one_line_where_nothing_is_replicated(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as err:
        _settle(tmp_path, "source.checkpoints=/data/ck", *overrides, "target.remove_redundancy=true")
    assert message in str(err.value) and "\n" not in str(err.value)
