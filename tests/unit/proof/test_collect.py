"""Fingerprints of whole checkpoints (``proof.collect`` through ``job.stages.proof``): MindSpore's
own resharded outputs hold, parameter by parameter, the fingerprints of their sources; the
batched path for small tensors agrees with the one-tensor path; a changed byte names its parameter.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard_job.core.fingerprint import Fingerprint
from reshard_job.core.fingerprint_batch import WholeTensorBatch
from reshard_job.formats.ckpt import CheckpointReader
from reshard_job.job.config.spec import SourceSpec
from reshard_job.job.stages.proof import checkpoint_fingerprints

GOLDEN = Path(__file__).parents[2] / "golden"


def _quirks(scenario) -> set[str]:
    """Parameters whose MindSpore output is a MindSpore bug on some rank (not a reshard of the source)."""
    return {n for r in scenario.dst_ranks for n in scenario.expected(r) if scenario.is_quirk(r, n)}


def test_mindspore_outputs_hold_the_fingerprints_of_their_sources(golden_scenario):
    s = golden_scenario
    source = checkpoint_fingerprints(SourceSpec(str(s.src_checkpoints), s.src_strategy)).digests
    output = checkpoint_fingerprints(SourceSpec(str(s.dir / "expected"), s.dst_strategy)).digests
    expected_names = {n for r in s.dst_ranks for n in s.expected(r)}
    compared = {n for n in output if n in expected_names} - _quirks(s)
    assert compared, "nothing compared"
    assert {n: output[n] for n in compared} == {n: source[n] for n in compared}


def test_a_pipeline_source_gives_the_same_fingerprints_through_each_way_of_naming_its_strategy(golden_scenario):
    s = golden_scenario
    if len(s.src_strategy_variants) < 2:
        pytest.skip("one way only")
    a, b = (checkpoint_fingerprints(SourceSpec(str(s.src_checkpoints), v)).digests for v in s.src_strategy_variants)
    assert a == b and a


def test_one_changed_byte_changes_the_fingerprint_of_that_parameter_only(tmp_path):
    s = GOLDEN / "S2_block_mp4dp2opt_to_mp4"
    copy = tmp_path / "src"
    shutil.copytree(s / "src_checkpoints", copy)
    strategy = str(s / "src_strategy.ckpt")
    before = checkpoint_fingerprints(SourceSpec(str(copy), strategy)).digests
    target = copy / "rank_0" / "checkpoint_0.ckpt"
    with CheckpointReader(target) as r:
        name = next(n for n in r.names() if n.startswith("layers.0.") and r[n].nbytes > 16)
        offset = r[name].pieces[0][0] + 5
    data = bytearray(target.read_bytes())
    data[offset] ^= 0x10
    target.write_bytes(bytes(data))
    after = checkpoint_fingerprints(SourceSpec(str(copy), strategy)).digests
    assert sorted(n for n in before if before[n] != after[n]) == [name]


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(0, 9), min_size=0, max_size=4), count=st.integers(1, 6),
       dtype=st.sampled_from(["Float32", "Float16", "Int8", "Float64", "BFloat16", "Bool"]), seed=st.integers(0, 2**32 - 1))
def test_a_batch_of_small_tensors_gives_each_its_own_fingerprint(shape, count, dtype, seed):
    rng = np.random.default_rng(seed)
    nbytes = Fingerprint(dtype, shape).nbytes
    blobs = [rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes() for _ in range(count)]
    digests: dict[str, str] = {}
    batch = WholeTensorBatch(digests)
    for i, blob in enumerate(blobs):
        batch.add(f"t{i}", dtype, shape, blob)
    batch.flush()
    assert digests == {f"t{i}": Fingerprint(dtype, shape).add_run(0, blob).hexdigest() for i, blob in enumerate(blobs)}
