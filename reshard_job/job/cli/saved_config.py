"""The configuration Hydra would save in a run directory (``.hydra/``), saved by the job instead with
its credentials masked: Hydra writes those files before any of the job's code runs, so a password
given on the command line stayed on disk when a job was killed (``kill -9``) before it could mask
them. ``hydra.output_subdir`` is null (``conf/config.yaml``) and ``MaskedSavedConfig``, a callback
run as the job starts, writes the same three files, masked from the first byte (over Hydra's own,
where a user's ``hydra.output_subdir=…`` brought them back).
"""

from __future__ import annotations

import copy
import os
from typing import Any

from hydra.experimental.callback import Callback

SAVED_DIR = ".hydra"
SAVED_FILES = ("config.yaml", "overrides.yaml", "hydra.yaml")


class MaskedSavedConfig(Callback):
    def on_job_start(self, config, **kwargs: Any) -> None:
        save_masked_config(config)


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
