"""The configuration Hydra saves in a run directory (``.hydra/``), with its credentials masked."""

from __future__ import annotations

import os

SAVED_FILES = ("config.yaml", "overrides.yaml", "hydra.yaml")


def scrub_saved_config(run_dir: str) -> None:
    """Hydra saves the composed config and the command line under .hydra/: mask credentials there."""
    from reshard_job.secrets import mask_text
    from reshard_job.storage.local_files import replace_file

    folder = os.path.join(run_dir, ".hydra")
    for name in SAVED_FILES:
        path = os.path.join(folder, name)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
            masked = mask_text(text)
            if masked != text:
                replace_file(path, masked.encode("utf-8"))
        except OSError:
            continue
