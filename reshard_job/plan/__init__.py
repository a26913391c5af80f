"""Planning: for every target rank and parameter, which source ranks and which boxes to copy.

Pure code, no I/O, no protobuf, no storage. The modules, lowest first:

* ``plan.model``: the plan as plain data (``Copy``, ``ParamPlan``, ``RankPlan``, ``Plan``) and its JSON;
* ``plan.patterns``: copy patterns, the copies building a target block from two layouts alone;
* ``plan.checks``: the cross-checks between the strategies and the files (``CHECK_*``);
* ``plan.resolve``: phase 1, every parameter the sources hold resolved into a ``ParamSource``;
* ``plan.planner``: phase 2, the ``Planner`` planning those records against the target;
* ``plan.rank_list``: ``source_ranks_for``, our (minimal) ``rank_list_for_transform``;
* ``plan.mindspore_rank_list``: MindSpore 2.10's own list, the superset its converter requires.

The inputs are the two topologies (resolved strategies) and an index of what each source file
holds (names, dtypes, shapes); the output is a ``Plan``, plain data that serialises to JSON. It is
what ``job.mode=plan`` prints, what the executor runs, and what lineage records as the rank map.

Choices, and how they relate to MindSpore 2.10's converter (spec §5–§7):

* **Any M→N.** A target box is assembled from its intersections with source boxes, which works for
  any pair of device counts; MindSpore requires one count to divide the other.
* **Which replica is read.** Replicated source blocks are identical in a consistent checkpoint;
  we read the replica MindSpore reads, so results agree with it bit for bit: target local rank
  ``r`` reads the ranks of the optimizer chunk of source local rank ``r mod F`` (the chunk's
  blocks tile the tensor exactly), which is MindSpore's replica rule.
* **Exact reads.** A target rank reads only source ranks whose boxes intersect its own box, so
  ``rank_list_for_transform`` returns the set actually read, plus per source stage read from the
  file that parameters outside the strategies are copied from: within MindSpore's list (but for
  the cases ``plan.rank_list`` names), which ``minimal=False`` gives.
* **Training truth.** Boxes follow training semantics (``layout.py``); for optimizer-sharded
  non-canonical maps this differs from MindSpore's fast path, which reads the wrong rows.
* **Parameters in the source strategy but not in the target one**: MindSpore copies the source
  slice unchanged, which does not fit the target layout. The gradient-accumulation buffers a
  pipeline strategy lays out (``accu_grads.*``, ``BUFFER_PREFIXES``) are left out and listed in
  ``plan.omitted``; any other such parameter needs a choice: ``unmapped="full"`` keeps them as full
  tensors, ``unmapped="drop"`` leaves them out (listed too). A target strategy that lays out none of
  the checkpoints' parameters belongs to another network and is refused whatever the choice.
* **Parameters in the target strategy but not in the source one** are taken as whole tensors (as
  when no source strategy is given) and cut for the target; MindSpore copies them unchanged.
* **Parameters in neither strategy** (``global_step``, ``learning_rate``) are copied unchanged from
  source local rank ``r mod F`` of the lowest stage holding them, as MindSpore does.
* **Redundancy-removed saves** (``save_checkpoint(..., remove_redundancy=True)`` keeps each
  distinct block on one rank): a block is read from MindSpore's replica when its file holds it,
  else from another rank holding the same block. Only a block no file holds is refused, naming it.
* **Parameters shared by pipeline stages** (an embedding tied to the output layer) are one tensor
  laid out alike in each stage: read once (from the lowest stage, as MindSpore does), their other
  copies listed in ``Plan.identical``. Different layouts in different stages are refused.
* **JSON multi-axis maps**, which MindSpore's JSON writer records flattened with the extended
  ``tensor_shape``, are folded back while planning (``layout.unflatten``): only the checkpoint tells a
  tensor's number of dimensions.
* **Optimizer states a strategy leaves out** (MindSpore records trainable parameters only by
  default) are laid out like their parameter (``adam_m.w`` like ``w``), in the source when their
  local shapes match the parameter's, in the target when it lists no optimizer state at all.
  MindSpore copies them unchanged, which gives the target the source's slice shape.
"""

from reshard_job.core.tensor_meta import TensorMeta
from reshard_job.plan.checks import (CHECK_COMPLETE, CHECK_IDENTICAL, CHECK_NAMES, CHECK_OPTIMIZER, CHECK_SHAPES,
                                     CHECK_STAGES, CHECK_TARGET, CHECK_TENSOR_SHAPE, CHECK_WHOLE, REMEDY,
                                     identical_mismatch)
from reshard_job.plan.model import (ACTION_COPY, ACTION_FULL, ACTION_RESHARD, BUFFER_PREFIXES, PLAN_VERSION,
                                    UNMAPPED_CHOICES, UNMAPPED_DROP, UNMAPPED_FULL, UNMAPPED_OMIT, Copy,
                                    ParamPlan, ParamPlans, Plan, RankPlan)
from reshard_job.plan.patterns import Pattern, copy_pattern, needed_local_ranks
from reshard_job.plan.planner import MISSING_SAMPLE, Planner
from reshard_job.plan.rank_list import source_ranks_for

__all__ = [
    "ACTION_COPY", "ACTION_FULL", "ACTION_RESHARD", "BUFFER_PREFIXES", "CHECK_COMPLETE", "CHECK_IDENTICAL",
    "CHECK_NAMES", "CHECK_OPTIMIZER", "CHECK_SHAPES", "CHECK_STAGES", "CHECK_TARGET", "CHECK_TENSOR_SHAPE",
    "CHECK_WHOLE", "MISSING_SAMPLE", "PLAN_VERSION", "REMEDY", "UNMAPPED_CHOICES", "UNMAPPED_DROP", "UNMAPPED_FULL",
    "UNMAPPED_OMIT", "Copy", "ParamPlan", "ParamPlans", "Pattern", "Plan", "Planner", "RankPlan", "TensorMeta",
    "copy_pattern", "identical_mismatch", "needed_local_ranks", "source_ranks_for",
]
