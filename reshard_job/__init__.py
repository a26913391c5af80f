"""reshard_job: reshard MindSpore distributed checkpoints from M ranks to N ranks."""

__version__ = "0.1.0"

from .api import (  # noqa: E402
    merge_pipeline_strategies,
    merge_pipeline_strategys,
    rank_list_for_transform,
    transform_checkpoint_by_rank,
    transform_checkpoints,
)
from .errors import ReshardError  # noqa: E402

__all__ = [
    "transform_checkpoints",
    "transform_checkpoint_by_rank",
    "rank_list_for_transform",
    "merge_pipeline_strategies",
    "merge_pipeline_strategys",
    "ReshardError",
    "__version__",
]
