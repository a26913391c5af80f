"""The outputs' fingerprints come from the bytes the rank tasks write (``execute.writer_tap``).

Each rank task fingerprints the tensors it counts (one rank per distinct box) as it hashes them, and
the job adds the partial sums up instead of reading its outputs back. Shown here on real files
(the golden scenarios' MindSpore-made sources): the counted boxes tile every global tensor exactly
once whatever the target (replicas, optimizer shards, pipeline stages, redundancy removed); the
sums equal the fingerprints read back from the files; a rank task that writes a wrong byte fails
the job with ProofError and nothing is committed; files kept from an earlier run are read back,
alone, and still checked.
"""

from __future__ import annotations

import json
import logging
import shutil
from math import prod
from pathlib import Path

import pytest
from stage_runs import convert_stages

from reshard_job.errors import ProofError
from reshard_job.execute.rank_task import run_rank_task
from reshard_job.execute.tasks import FORMAT_SAFETENSORS_INDEX, WriteOptions
from reshard_job.execute.writer_tap import TargetSums
from reshard_job.formats.manifest_file import MANIFEST_FILE
from reshard_job.job.config.spec import JobContext, JobSpec, LineageSpec, OutputSpec, RunSpec, SourceSpec, TargetSpec
from reshard_job.job.stages.convert import output_paths, rank_tasks, unit_paths
from reshard_job.job.stages.prepare import prepare
from reshard_job.job.stages.proof import checkpoint_fingerprints, prove
from reshard_job.plan.model import Copy, ParamPlans
from reshard_job.storage import storage_for

GOLDEN = Path(__file__).parents[3] / "golden"
S1 = GOLDEN / "S1_mlp_tutorial_8to4"
S2 = GOLDEN / "S2_block_mp4dp2opt_to_mp4"
S3 = GOLDEN / "S3_pipeline2x4opt_to_4"


def _spec(tmp_path: Path, target: TargetSpec | None = None) -> JobSpec:
    target = target or TargetSpec(strategy=str(S1 / "dst_strategy.ckpt"))
    return JobSpec(SourceSpec(str(S1 / "src_checkpoints"), str(S1 / "src_strategy.ckpt")), target,
                   OutputSpec(str(tmp_path / "out")), LineageSpec(False, f"sqlite:///{tmp_path / 'l.db'}"),
                   RunSpec(workers=1, hash_cache=False, progress=False),
                   JobContext(str(tmp_path), str(tmp_path / "run")), config={})


_convert = convert_stages  # tests/ is on sys.path through its conftest


@pytest.mark.parametrize("source,target,redundancy", [
    (S1, S1 / "src_strategy.ckpt", False),  # 8 -> 8 with data-parallel replicas
    (S2, S2 / "src_strategy.ckpt", False),  # replicas and optimizer shards
    (S2, S2 / "src_strategy.ckpt", True),  # one writer per block
    (S3, S3 / "src_strategy_merged.ckpt", False),  # two pipeline stages
    (S1, None, False),  # one whole rank
])
def test_the_counted_boxes_tile_every_global_tensor_exactly_once(source, target, redundancy):
    src = source / "src_strategy.ckpt" if (source / "src_strategy.ckpt").exists() else source / "src_strategy_merged.ckpt"
    with prepare(SourceSpec(str(source / "src_checkpoints"), str(src)),
                 TargetSpec(strategy=str(target) if target else None, remove_redundancy=redundancy)) as prepared:
        boxes: dict[str, list] = {}
        shapes: dict[str, tuple] = {}
        for rp in prepared.plan.ranks:
            assert rp.counting is not None
            for p in rp.params:
                if p.kind == "tensor" and rp.counts(p.place):
                    boxes.setdefault(p.name, []).append(tuple((o, o + n) for o, n in zip(p.place.origin, p.target_shape)))
                shapes[p.name] = p.global_shape
    assert boxes and set(boxes) == {n for n in shapes if n in boxes}
    for name, got in boxes.items():
        assert sum(prod(hi - lo for lo, hi in b) for b in got) == prod(shapes[name]), name
        for i, a in enumerate(got):  # disjoint: no element counted twice
            for b in got[i + 1:]:
                assert any(a_hi <= b_lo or b_hi <= a_lo for (a_lo, a_hi), (b_lo, b_hi) in zip(a, b)), name


def test_the_rank_tasks_partial_sums_equal_the_outputs_read_back(tmp_path):
    with prepare(SourceSpec(str(S1 / "src_checkpoints"), str(S1 / "src_strategy.ckpt")),
                 TargetSpec(strategy=str(S1 / "src_strategy.ckpt"))) as prepared:  # 8 ranks, dp replicas
        paths = output_paths(prepared.plan, str(tmp_path), "checkpoint_", "ckpt", storage_for(str(tmp_path)))
        results = [run_rank_task(t, sources=prepared.readers)
                   for t in rank_tasks(prepared, paths, WriteOptions(fingerprints=True))]
    assert all(r.fingerprints is not None for r in results)
    counted = [set(r.fingerprints.names) for r in results]
    assert sum(len(c) for c in counted) < sum(len(r.tensors) for r in results)  # replicas counted once
    sums = TargetSums()
    for r in results:
        sums.add(r.fingerprints)
    read_back = checkpoint_fingerprints(SourceSpec(str(tmp_path), str(S1 / "src_strategy.ckpt")),
                                        files={r.target_rank: r.path for r in results}).digests
    tapped, uncovered = sums.digests(p.tensor for p in prepared.plan.ranks[0].params)
    assert not uncovered and tapped == {n: read_back[n] for n in tapped} and set(tapped) == set(read_back)


def test_an_export_is_fingerprinted_from_the_bytes_written_too(tmp_path):
    spec = _spec(tmp_path, TargetSpec(format=FORMAT_SAFETENSORS_INDEX, include="all", max_shard_size=200_000))
    with prepare(spec.source, spec.target) as prepared:
        paths = unit_paths(prepared, str(tmp_path / "x"), "checkpoint_", FORMAT_SAFETENSORS_INDEX,
                           storage_for(str(tmp_path)))
        results = [run_rank_task(t, sources=prepared.readers)
                   for t in rank_tasks(prepared, paths, WriteOptions(fingerprints=True))]
        assert len(results) > 1 and all(r.fingerprints is not None for r in results)
        sums = TargetSums()
        for r in results:
            sums.add(r.fingerprints, r.part)
        proof = prove(spec, prepared, str(tmp_path / "x"), None, {r.part: r.path for r in results}, sums)
    assert proof.target and proof.target == {n: proof.source[n] for n in proof.target}


def _swap_sources_of_one_copy(prepared) -> None:
    """A corrupted plan: target rank 1 takes the two column halves of layer1.weight from each
    other's source rank, so its file holds wrong bytes in the right place and shape."""
    rp = prepared.plan.ranks[1]
    params = rp.params
    i = next(k for k, t in enumerate(params.tensors) if t.name == "layer1.weight")
    shape, copies, nbytes, place = params.slices[i]
    a, b = copies
    swapped = (Copy(b.source_rank, a.source_box, a.target_box), Copy(a.source_rank, b.source_box, b.target_box))
    slices = list(params.slices)
    slices[i] = (shape, swapped, nbytes, place)
    rp.params = ParamPlans(params.tensors, tuple(slices))


def test_a_rank_task_writing_a_wrong_byte_fails_the_job_and_commits_nothing(tmp_path, caplog):
    spec = _spec(tmp_path)
    with caplog.at_level(logging.DEBUG, logger="reshard_job"), pytest.raises(ProofError, match="layer1.weight"):
        _convert(spec, before_convert=_swap_sources_of_one_copy)
    assert "4 output file(s) from the bytes written, 0 read back" in caplog.text  # nothing was read back
    assert not (tmp_path / "out" / MANIFEST_FILE).exists()


def test_files_kept_from_an_earlier_run_are_read_back_and_checked(tmp_path):
    spec = _spec(tmp_path)
    first = _convert(spec)
    written = {f["rank"]: f["path"] for f in first.files}
    with prepare(spec.source, spec.target) as prepared:
        paths = {1: written[1]}
        fresh = [run_rank_task(t, sources=prepared.readers)
                 for t in rank_tasks(prepared, paths, WriteOptions(fingerprints=True))]
        def tapped():  # rank 1 only: ranks 0, 2 and 3 as a resumed run keeps them, untapped
            sums = TargetSums()
            sums.add(fresh[0].fingerprints, 1)
            return sums

        assert prove(spec, prepared, spec.output.dir, None, written, tapped()).differ == []
        wrong = tmp_path / "rank_2_copy_of_rank_3.ckpt"
        shutil.copy(written[3], wrong)  # the right shapes, another rank's bytes
        with pytest.raises(ProofError):
            prove(spec, prepared, spec.output.dir, None, {**written, 2: str(wrong)}, tapped())


def test_a_resumed_conversion_reads_back_the_files_it_kept_and_records_equal_fingerprints(tmp_path, caplog):
    spec = _spec(tmp_path)
    first = _convert(spec)
    damaged = Path(next(f["path"] for f in first.files if f["rank"] == 2))
    damaged.chmod(0o644)
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"\0")
    (tmp_path / "out" / MANIFEST_FILE).unlink()  # as if interrupted before the manifest
    with caplog.at_level(logging.DEBUG, logger="reshard_job"):
        again = _convert(spec)
    assert "1 output file(s) from the bytes written, 3 read back" in caplog.text
    fps = json.loads(Path(again.manifest_path).read_text())["fingerprints"]
    assert fps["target"] and fps["target"] == {n: fps["source"][n] for n in fps["target"]}
