"""The batch job: Hydra configuration, the conversion runner, outputs, manifest and progress."""
