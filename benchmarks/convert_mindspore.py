"""Convert with MindSpore's own ``transform_checkpoints`` (optional reference timing).

    /path/to/mindspore-venv/bin/python benchmarks/convert_mindspore.py SRC_DIR DST_DIR SRC_STRATEGY DST_STRATEGY

Runs in MindSpore's own environment (it needs numpy < 2), so it imports nothing from this
repository. A directory of per-stage pipeline strategies is merged first with
``merge_pipeline_strategys``, as MindSpore's tutorials do; the merge is part of the timed work.
"""

import os
import sys
import tempfile


def main(argv):
    src_dir, dst_dir, src_strategy, dst_strategy = argv
    import mindspore as ms

    with tempfile.TemporaryDirectory(prefix="bench_ms_merge_") as tmp:
        if os.path.isdir(src_strategy):
            merged = os.path.join(tmp, "src_merged.ckpt")
            ms.merge_pipeline_strategys(src_strategy, merged)
            src_strategy = merged
        ms.transform_checkpoints(src_dir, dst_dir, "checkpoint_", src_strategy, dst_strategy)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
