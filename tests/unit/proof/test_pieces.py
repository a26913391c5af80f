"""Fingerprints fed piece by piece (``proof.pieces``) equal those of the whole tensors as the rank
task's writer code assembles them, for every kind of source, whatever the read block, whichever
tensors are batched, and however many parts the plan is cut into (partial fingerprints merged)."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from reshard_job import api
from reshard_job.core.fingerprint import Fingerprint
from reshard_job.errors import FormatError
from reshard_job.execute.rank_task import write_params
from reshard_job.formats.ckpt import CheckpointWriter
from reshard_job.formats.tensorfile import KIND_TENSOR
from reshard_job.job.config.spec import SourceSpec, TargetSpec
from reshard_job.job.run.local import run_forked
from reshard_job.job.stages.prepare import prepare
from reshard_job.proof.pieces import PartFingerprints, fingerprint_part, merge_parts, plan_bytes

GOLDEN = Path(__file__).parents[2] / "golden"
SCENARIOS = sorted(p.name for p in GOLDEN.iterdir() if (p / "manifest.json").exists())


class _Assembler:
    """A writer that keeps every tensor whole, in C order of its global shape (the reference)."""

    def __init__(self):
        self.tensors: dict[str, tuple[str, tuple, bytearray]] = {}

    def arrange(self, decls):
        return [d.name for d in decls]

    def add_bytes(self, name, dtype, dims, data, *_):
        self.tensors[name] = (dtype, tuple(dims), bytearray(memoryview(data).cast("B")))

    def begin(self, name, dtype, dims, *_, **__):
        held = self.tensors[name] = (dtype, tuple(dims), bytearray())
        return _Held(held[2])

    def add_str(self, *_):
        return None

    def add_map(self, *_):
        return None

    def digests(self) -> dict[str, str]:
        return {n: Fingerprint(dt, dims).add_run(0, bytes(data)).hexdigest()
                for n, (dt, dims, data) in self.tensors.items()}


class _Held:
    def __init__(self, data: bytearray):
        self.data = data

    def write(self, block):
        self.data += memoryview(block).cast("B")

    def close(self):
        return None


@contextmanager
def _one_device(spec: SourceSpec):
    with prepare(spec, TargetSpec(devices=1)) as prepared:
        yield prepared.plan.rank(0), prepared.readers


def _assembled(plan, readers) -> dict[str, str]:
    writer = _Assembler()
    write_params(writer, plan, readers)
    tensors = {p.name for p in plan.params if p.kind == KIND_TENSOR}
    return {n: d for n, d in writer.digests().items() if n in tensors}


def _in_parts(plan, readers, parts: int, **kw) -> dict[str, str]:
    return merge_parts([fingerprint_part(plan, readers, part=k, parts=parts, **kw) for k in range(parts)])


def _golden_sources(name: str) -> list[SourceSpec]:
    d = GOLDEN / name
    if (d / "src_mindformers").exists():  # layouts from the save's own metadata
        src, strategy = d / "src_mindformers", None
    else:
        src = d / "src_checkpoints"
        strategy = next((str(p) for p in (d / "src_strategy.ckpt", d / "src_strategy_dir") if p.exists()), None)
    dst = str(d / "dst_strategy.ckpt") if (d / "dst_strategy.ckpt").exists() else None
    return [SourceSpec(str(src), strategy), SourceSpec(str(d / "expected"), dst)]


@pytest.mark.parametrize("name", SCENARIOS)
def test_golden_sources_and_outputs_give_the_assembled_fingerprints_read_in_any_blocks_and_parts(name):
    for spec in _golden_sources(name):
        with _one_device(spec) as (plan, readers):
            expected = _assembled(plan, readers)
            assert expected
            assert merge_parts([fingerprint_part(plan, readers)]) == expected
            # every tensor cut into boxes of a few rows, or parts of a row, and shared among parts
            assert _in_parts(plan, readers, 3, read_block=200, batched=0) == expected
            assert _in_parts(plan, readers, 2, read_block=1 << 20, batched=0) == expected


def test_a_single_file_of_chunked_records_and_a_large_tensor(tmp_path):
    rng = np.random.default_rng(7)
    path = tmp_path / "whole.ckpt"
    tensors = {"big": rng.standard_normal((300, 70)).astype(np.float32),  # 84 000 bytes: fed in boxes
               "chunked": rng.integers(0, 1 << 15, (33, 17), dtype=np.int16),
               "scalar": np.float64(2.5), "empty": np.zeros((0, 4), np.float32),
               "bias": rng.standard_normal(9).astype(np.float16)}
    with CheckpointWriter(path, chunk_bytes=256) as w:  # records of 256 bytes: every tensor in several
        for n, a in tensors.items():
            w.add(n, np.array(a))
    with _one_device(SourceSpec(str(path))) as (plan, readers):
        expected = _assembled(plan, readers)
        assert set(expected) == set(tensors)
        whole = Fingerprint("Float32", (300, 70)).add_box(((0, 300), (0, 70)), tensors["big"])
        assert expected["big"] == whole.hexdigest()
        for kw in ({}, {"read_block": 1000}, {"read_block": 100, "batched": 0}):
            assert merge_parts([fingerprint_part(plan, readers, **kw)]) == expected
            assert _in_parts(plan, readers, 4, **kw) == expected
        assert fingerprint_part(plan, readers, part=0, parts=4, read_block=100, batched=0).partial  # "big" is cut


@pytest.mark.parametrize("fmt", ["safetensors", "safetensors_index"])
def test_safetensors_outputs_and_export_folders(tmp_path, fmt):
    s = GOLDEN / "S1_mlp_tutorial_8to4"
    out = tmp_path / "out"
    dst = str(s / "dst_strategy.ckpt") if fmt == "safetensors" else None
    api.transform_checkpoints(s / "src_checkpoints", out, "", s / "src_strategy.ckpt", dst, output_format=fmt,
                              max_shard_size="20KB")
    with _one_device(SourceSpec(str(out), dst)) as (plan, readers):
        expected = _assembled(plan, readers)
        assert expected
        assert _in_parts(plan, readers, 3, read_block=300, batched=0) == expected
        assert merge_parts([fingerprint_part(plan, readers)]) == expected


def test_wanted_names_only_are_read_and_progress_hears_of_every_byte():
    spec = _golden_sources("S2_block_mp4dp2opt_to_mp4")[0]
    with _one_device(spec) as (plan, readers):
        names = sorted(p.name for p in plan.params if p.kind == KIND_TENSOR)
        wanted = set(names[::3])
        heard = []
        got = merge_parts([fingerprint_part(plan, readers, wanted=wanted, progress=heard.append, batched=0)])
        assembled = _assembled(plan, readers)
        assert set(got) == wanted and got == {n: assembled[n] for n in wanted}
        assert sum(heard) == plan_bytes(plan, wanted) > 0


def test_merging_refuses_parts_that_do_not_cover_a_parameter():
    spec = _golden_sources("S2_block_mp4dp2opt_to_mp4")[0]
    with _one_device(spec) as (plan, readers):
        first = fingerprint_part(plan, readers, part=0, parts=2, batched=0)
        assert first.partial
        with pytest.raises(ValueError, match="fed"):
            merge_parts([first, PartFingerprints()])


def test_parts_read_in_forked_workers_merge_to_the_fingerprints_read_here():
    spec = _golden_sources("S3_pipeline2x4opt_to_4")[0]
    with _one_device(spec) as (plan, readers):
        expected = merge_parts([fingerprint_part(plan, readers)])
        heard = []

        def part(k, report):
            return fingerprint_part(plan, readers, part=k, parts=3, progress=report, read_block=256, batched=0)

        results = run_forked(part, 3, 2, heard.append)
        assert any(r.partial for r in results)  # parameters cut between parts came back partial
        assert merge_parts(results) == expected
        assert sum(heard) == plan_bytes(plan)


def test_a_failure_in_a_worker_is_raised_here_as_itself(tmp_path):
    copy = tmp_path / "src"
    shutil.copytree(GOLDEN / "S2_block_mp4dp2opt_to_mp4" / "src_checkpoints", copy)
    spec = SourceSpec(str(copy), str(GOLDEN / "S2_block_mp4dp2opt_to_mp4" / "src_strategy.ckpt"))
    with _one_device(spec) as (plan, readers):
        for f in copy.glob("rank_*/*.ckpt"):  # cut short after indexing: the reads run past the end
            f.chmod(0o644)
            os.truncate(f, f.stat().st_size // 2)
        with pytest.raises(FormatError, match="end of file"):
            run_forked(lambda k, report: fingerprint_part(plan, readers, part=k, parts=2), 2, 2, lambda n: None)
