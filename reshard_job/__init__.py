"""reshard_job: reshard MindSpore distributed checkpoints from M ranks to N ranks.

The MindSpore-compatible functions are imported on first use, so that light entry points (the
audit CLI) do not pay for numpy and the engine.
"""

__version__ = "0.1.0"

__all__ = [
    "transform_checkpoints",
    "transform_checkpoint_by_rank",
    "rank_list_for_transform",
    "merge_pipeline_strategies",
    "merge_pipeline_strategys",
    "convert_checkpoints",
    "convert_checkpoint_by_rank",
    "rank_list_for_convert",
    "load_rank",
    "iter_rank",
    "merge_load_fingerprints",
    "record_use",
    "ReshardError",
    "__version__",
]


def __getattr__(name):
    if name in ("transform_checkpoints", "transform_checkpoint_by_rank", "rank_list_for_transform",
                "merge_pipeline_strategies", "merge_pipeline_strategys", "convert_checkpoints",
                "convert_checkpoint_by_rank", "rank_list_for_convert"):
        from reshard_job import api

        return getattr(api, name)
    if name in ("load_rank", "iter_rank", "merge_load_fingerprints"):
        from reshard_job import loading

        return getattr(loading, name)
    if name == "record_use":
        from reshard_job.lineage.uses import record_use

        return record_use
    if name == "ReshardError":
        from reshard_job.errors import ReshardError

        return ReshardError
    raise AttributeError(f"module 'reshard_job' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
