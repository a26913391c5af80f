"""The configuration Hydra would save in a run directory (``.hydra/``), saved by the job instead with
its credentials masked: Hydra writes those files before any of the job's code runs, so a password
given on the command line stayed on disk when a job was killed (``kill -9``) before it could mask
them. ``hydra.output_subdir`` is null (``conf/config.yaml``) and ``MaskedSavedConfig``, a callback
run as the job starts, writes the same three files, masked from the first byte (over Hydra's own,
where a user's ``hydra.output_subdir=…`` brought them back).

A sweep (``-m``) has one more: Hydra's sweeper saves the whole configuration as ``multirun.yaml`` in
the sweep folder before the first job, unmasked, from code no callback runs inside. As the sweep
starts, ``multirun.yaml`` is made a link to ``os.devnull`` (the sweeper's copy goes nowhere), and the
masked text replaces the link when the first job starts (and at the sweep's end, whatever came first).
"""

from __future__ import annotations

import os
from typing import Any

from hydra.experimental.callback import Callback

SAVED_DIR = ".hydra"
SAVED_FILES = ("config.yaml", "overrides.yaml", "hydra.yaml")


MULTIRUN_FILE = "multirun.yaml"


class MaskedSavedConfig(Callback):
    def __init__(self) -> None:
        self._multirun: tuple[str, bytes] | None = None  # (multirun.yaml's path, its masked text), until written

    def on_multirun_start(self, config, **kwargs: Any) -> None:
        from omegaconf import OmegaConf

        from reshard_job.secrets import mask_text
        from reshard_job.storage.local_files import discard_writes_to, make_folder

        folder = os.path.abspath(str(config.hydra.sweep.dir))  # jobs may chdir (hydra.job.chdir=true)
        make_folder(folder)
        path = os.path.join(folder, MULTIRUN_FILE)
        self._multirun = (path, mask_text(OmegaConf.to_yaml(config)).encode("utf-8"))
        discard_writes_to(path)  # what the sweeper saves there is thrown away

    def on_job_start(self, config, **kwargs: Any) -> None:
        self._write_multirun()
        save_masked_config(config)

    def on_multirun_end(self, config, **kwargs: Any) -> None:
        self._write_multirun()

    def _write_multirun(self) -> None:
        if self._multirun is None:
            return
        from reshard_job.storage.local_files import replace_file

        path, data = self._multirun
        self._multirun = None
        replace_file(path, data)  # over the link, not through it


def save_masked_config(config) -> None:
    """``config.yaml`` (the task's), ``hydra.yaml`` and ``overrides.yaml`` as Hydra writes them, masked."""
    from reshard_job.secrets import mask_text
    from reshard_job.storage.local_files import make_folder, replace_file

    documents = saved_documents(config)
    folder = os.path.join(config.hydra.runtime.output_dir, config.hydra.output_subdir or SAVED_DIR)
    make_folder(folder)
    for name in SAVED_FILES:
        replace_file(os.path.join(folder, name), mask_text(documents[name]).encode("utf-8"))


def saved_documents(config) -> dict[str, str]:
    """The three files' text, unmasked, as ``OmegaConf.to_yaml`` writes them, from one plain copy of
    `config` (a deep copy of the configuration to leave ``hydra`` out, then OmegaConf's own
    conversion in ``to_yaml``, took seconds each for 100,000 patterns)."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf._utils import get_omega_conf_dumper  # the dumper OmegaConf.to_yaml uses

    def to_yaml(container) -> str:  # OmegaConf.to_yaml's own arguments
        return yaml.dump(container, default_flow_style=False, allow_unicode=True, sort_keys=False,
                         Dumper=get_omega_conf_dumper())

    task = OmegaConf.to_container(config, resolve=False, enum_to_str=True)
    hydra = task.pop("hydra")
    return {"config.yaml": to_yaml(task), "hydra.yaml": to_yaml({"hydra": hydra}),
            "overrides.yaml": to_yaml(hydra["overrides"]["task"])}
