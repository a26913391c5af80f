"""The run directory's ``.hydra/`` files, written by the job with credentials masked: the text
``OmegaConf.to_yaml`` gives, from one plain copy of the configuration."""

from __future__ import annotations

import copy

import pytest
from hydra import compose, initialize_config_module
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

import reshard_job.job.config.schema as schema
from reshard_job.job.cli.saved_config import save_masked_config
from reshard_job.secrets import mask_text

OVERRIDES = ["target.include=[a*,'b c',\"x: y\",'1.5']", "target.rename={a.: b.}", "job.workers=3",
             "lineage.url=postgresql://alice:s3cret@db/lineage", "+storage.options.secret=SK",
             "output.dir=${hydra:runtime.cwd}/out"]


def _config(tmp_path) -> DictConfig:
    schema.register()
    with initialize_config_module("reshard_job.conf", version_base="1.3"):
        config = compose(config_name="config", overrides=OVERRIDES, return_hydra_config=True)
    with read_write(config), open_dict(config):
        config.hydra.runtime.output_dir = str(tmp_path)
    return config


def _as_hydra_writes_them(config: DictConfig) -> dict[str, str]:
    task = copy.deepcopy(config)
    with read_write(task), open_dict(task):
        del task["hydra"]
    return {"config.yaml": OmegaConf.to_yaml(task), "hydra.yaml": OmegaConf.to_yaml(OmegaConf.masked_copy(config, "hydra")),
            "overrides.yaml": OmegaConf.to_yaml(config.hydra.overrides.task)}


def test_the_saved_files_are_omegaconf_s_yaml_masked_without_copying_the_configuration(tmp_path, monkeypatch):
    """A deep copy of the configuration (to leave out ``hydra``) took seconds for 100,000 patterns."""
    config = _config(tmp_path)
    expected = _as_hydra_writes_them(config)
    assert "s3cret" in expected["config.yaml"] and "'1.5'" in expected["config.yaml"]
    monkeypatch.setattr(DictConfig, "__deepcopy__", lambda *a: pytest.fail("the configuration was deep-copied"))
    save_masked_config(config)
    for name, text in expected.items():
        saved = (tmp_path / ".hydra" / name).read_text()
        assert saved == mask_text(text) and "s3cret" not in saved and "SK" not in saved
