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

import copy
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
    from omegaconf import OmegaConf, open_dict, read_write

    from reshard_job.secrets import mask_text
    from reshard_job.storage.local_files import make_folder, replace_file

    task_cfg = copy.deepcopy(config)
    with read_write(task_cfg), open_dict(task_cfg):
        del task_cfg["hydra"]
    documents = {"config.yaml": task_cfg, "hydra.yaml": OmegaConf.masked_copy(config, "hydra"),
                 "overrides.yaml": config.hydra.overrides.task}
    folder = os.path.join(config.hydra.runtime.output_dir, config.hydra.output_subdir or SAVED_DIR)
    make_folder(folder)
    for name in SAVED_FILES:
        replace_file(os.path.join(folder, name), mask_text(OmegaConf.to_yaml(documents[name])).encode("utf-8"))
