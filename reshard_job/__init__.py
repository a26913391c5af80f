"""reshard_job: reshard MindSpore distributed checkpoints from M ranks to N ranks."""

__version__ = "0.1.0"
