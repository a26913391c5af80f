"""The sources' fingerprints from the bytes the hash pass reads (``proof.source_taps``).

On every golden source (MindSpore rank folders, pipeline stages, optimizer shards, MindFormers
saves) the taps give exactly the fingerprints the independent read by pieces gives, with nothing
left over and nothing read a second time; a rerun takes them from the cache, a cache without them
(or with a damaged state) reads the records only; chunks cut anywhere give the same sums; records
that overlap are left to the read by pieces rather than trusted.
"""

from __future__ import annotations

import random
from array import array
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from reshard_job.core.fingerprint import fingerprint_array
from reshard_job.formats.ckpt import CheckpointWriter
from reshard_job.job.config.spec import SourceSpec, TargetSpec
from reshard_job.job.stages.integrity import hash_sources
from reshard_job.job.stages.prepare import prepare
from reshard_job.job.stages.proof import checkpoint_fingerprints, converted_names, source_taps
from reshard_job.proof.source_taps import FileTap, SourceTaps, Tapped
from reshard_job.sources.file_digests import CACHE_DIR_ENV

GOLDEN = Path(__file__).parents[2] / "golden"
SCENARIOS = sorted(p.name for p in GOLDEN.iterdir() if (p / "manifest.json").is_file())
JOB = SimpleNamespace(run=SimpleNamespace(fingerprints=True), storage=None)


def _source(name: str) -> tuple[SourceSpec, TargetSpec]:
    d = GOLDEN / name
    if (d / "src_mindformers").exists():
        return SourceSpec(str(d / "src_mindformers")), TargetSpec(devices=1)
    strategy = next((str(p) for p in (d / "src_strategy.ckpt", d / "src_strategy_dir") if p.exists()), None)
    dst = d / "dst_strategy.ckpt"
    target = TargetSpec(strategy=str(dst)) if dst.exists() else TargetSpec(devices=1)
    return SourceSpec(str(d / "src_checkpoints"), strategy), target


def _tapped(source: SourceSpec, target: TargetSpec, *, use_cache: bool = False):
    """(taps after the hash pass, their digests, what they left, the converted names)."""
    with prepare(source, target) as prepared:
        taps = source_taps(JOB, prepared)
        hash_sources(prepared, use_cache=use_cache, progress=False, taps=taps)
        digests, residual = taps.digests()
        return taps, digests, residual, converted_names(prepared)


@pytest.mark.parametrize("name", SCENARIOS)
def test_the_hash_pass_gives_every_converted_parameter_the_fingerprint_read_by_pieces(name):
    source, target = _source(name)
    taps, digests, residual, names = _tapped(source, target)
    assert residual == set() and taps.read_back == 0  # all from the hash pass, nothing read again
    expected = checkpoint_fingerprints(source, wanted=names).digests
    assert digests == expected and len(digests) == len({n for n in names if n in expected}) > 0


@pytest.mark.parametrize("name", ["S1_mlp_tutorial_8to4", "S3_pipeline2x4opt_to_4"])
def test_parameters_looked_up_a_few_at_a_time_give_the_same_fingerprints(name, monkeypatch):
    import reshard_job.proof.source_taps as source_taps_module

    source, target = _source(name)
    _, whole, _, _ = _tapped(source, target)
    monkeypatch.setattr(source_taps_module, "WHOLE_RUN", 2)
    taps, runs, residual, _ = _tapped(source, target)
    assert runs == whole and not residual and taps.read_back == 0


def test_a_rerun_takes_them_from_the_cache_and_a_cache_without_them_reads_the_records_only(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    source, target = _source("S3_pipeline2x4opt_to_4")
    first, digests, _, _ = _tapped(source, target, use_cache=True)
    kept = sorted((tmp_path / "cache").rglob("*.tap"))
    assert first.read_back == 0 and len(kept) > 1 and first.restored == 0

    again, same, residual, _ = _tapped(source, target, use_cache=True)  # digests cached: no hash pass
    assert same == digests and not residual and again.read_back == 0 and again.restored == len(kept)

    kept[0].write_bytes(kept[0].read_bytes()[:40])  # a damaged state is computed again
    for path in kept[1:]:
        path.unlink()
    fed, same, residual, _ = _tapped(source, target, use_cache=True)
    assert same == digests and not residual and fed.read_back == len(kept)
    assert len(list((tmp_path / "cache").rglob("*.tap"))) == len(kept)  # and kept again


def test_chunks_cut_anywhere_give_the_same_sums(tmp_path):
    rng = np.random.default_rng(3)
    path = tmp_path / "whole.ckpt"
    with CheckpointWriter(path, chunk_bytes=256) as w:  # most tensors in several records
        w.add("big", rng.standard_normal((40, 30)).astype(np.float32))
        w.add("odd", rng.integers(0, 1 << 15, (33, 17), dtype=np.int16))
        w.add("empty", np.zeros((0, 4), np.float32))
        w.add("bias", rng.standard_normal(9).astype(np.float16))
    source = SourceSpec(str(path))
    _, whole, residual, names = _tapped(source, TargetSpec(devices=1))
    assert not residual and set(whole) == {"big", "odd", "empty", "bias"}
    data = path.read_bytes()
    for seed in range(3):
        with prepare(source, TargetSpec(devices=1)) as prepared:
            taps = source_taps(JOB, prepared)  # not hashed: fed here
        pick = random.Random(seed)
        for tap in taps.files.values():
            pos = 0
            while pos < len(data):
                n = pick.randint(1, 700)
                tap.update(pos, memoryview(data)[pos:pos + n])
                pos += n
        assert taps.digests() == (whole, set())


def _overlapping() -> SourceTaps:
    tap = FileTap("f", ())
    tap.add(Tapped("a", "Float32", (4,), None), ((0, 16),))
    tap.add(Tapped("b", "Float32", (4,), None), ((8, 16),))  # starts inside "a"
    tap.seal()
    taps = SourceTaps()
    taps.files[(0, 0)] = tap
    return taps


def test_records_whose_bytes_went_by_unfed_are_left_to_the_read_by_pieces():
    data = memoryview(np.arange(6, dtype=np.float32).tobytes())
    taps = _overlapping()
    taps.files[(0, 0)].update(0, data)  # one chunk holds both: each record is fed its own bytes
    expected = {n: fingerprint_array("Float32", np.frombuffer(data[o:o + 16], np.float32)) for n, o in (("a", 0), ("b", 8))}
    assert taps.digests() == (expected, set())
    taps = _overlapping()
    taps.files[(0, 0)].update(0, data[:12])
    taps.files[(0, 0)].update(12, data[12:])  # "b"'s first bytes went by while "a" was fed
    assert taps.files[(0, 0)].result() is None
    assert taps.digests() == ({}, {"a", "b"})


def test_a_job_proves_its_conversion_with_the_fingerprints_its_hash_pass_took(tmp_path, monkeypatch):
    import json

    from reshard_job.job.config.spec import JobContext, JobSpec, LineageSpec, OutputSpec, RunSpec
    from reshard_job.job.runner import run_job

    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    s = GOLDEN / "S2_block_mp4dp2opt_to_mp4"
    source = SourceSpec(str(s / "src_checkpoints"), str(s / "src_strategy.ckpt"))
    spec = JobSpec(source, TargetSpec(strategy=str(s / "dst_strategy.ckpt")), OutputSpec(str(tmp_path / "out")),
                   LineageSpec(False, f"sqlite:///{tmp_path / 'l.db'}"), RunSpec(workers=1, progress=False),
                   JobContext(str(tmp_path), str(tmp_path / "run")), config={})
    run_job(spec, emit=lambda line: None)
    assert len(list((tmp_path / "cache").rglob("*.tap"))) == 8  # one per source file, taken by the job
    section = json.loads((tmp_path / "out" / "manifest.json").read_text())["fingerprints"]
    expected = checkpoint_fingerprints(source, wanted=set(section["source"])).digests
    assert section["source"] == expected == section["target"] and expected


def _two_boxes_tap() -> FileTap:
    """A file holding "w" as two blocks (its rows 0-1 and 2-3) after "b", in the other order on disk."""
    tap = FileTap("f", ())
    tap.add(Tapped("b", "Float32", (3,), None), ((48, 12),))
    tap.add(Tapped("w", "Float32", (4, 3), ((2, 4), (0, 3))), ((0, 24),))
    tap.add(Tapped("w", "Float32", (4, 3), ((0, 2), (0, 3))), ((24, 24),))
    tap.seal()
    return tap


def test_a_kept_state_restores_the_same_sums_and_a_state_that_does_not_fit_is_refused():
    data = memoryview(np.arange(15, dtype=np.float32).tobytes())
    fed = _two_boxes_tap()
    fed.update(0, data)
    blob = fed.state()
    assert fed.result() is not None and blob is not None
    restored = _two_boxes_tap()
    assert restored.restore(blob) and restored.restored
    assert list(restored.result()) == list(fed.result())
    header_end = blob.index(b"\n", blob.index(b"\n") + 1) + 1
    count = len(fed.result())
    wrong_index = blob[:-4] + array("I", [7]).tobytes()  # a tensor index past this tap's three
    for bad in (blob[:-1], wrong_index, blob[:header_end] + blob[header_end + 1:], b"x" + blob[1:]):
        assert not _two_boxes_tap().restore(bad)
    other = FileTap("f", ())  # fewer tensors than the state has sums
    other.add(Tapped("b", "Float32", (3,), None), ((48, 12),))
    other.seal()
    assert count == 3 and not other.restore(blob)


@pytest.mark.parametrize("with_empty", [False, True])
def test_whole_records_added_as_a_run_are_the_records_added_one_by_one(with_empty):
    """``FileTap.add_whole`` (a run of tensors stored whole, many small parameters) keeps what
    ``add`` of each keeps: the same tensors, records, key and order, an empty tensor included."""
    rng = random.Random(7)
    names = [f"p{i}" for i in range(50)]
    kinds = [("Float32", (3,), None) if i % 3 else ("Float16", (2, 2), None) for i in range(50)]
    lengths = [12 if i % 3 else 8 for i in range(50)]
    if with_empty:
        kinds[10], lengths[10] = ("Float32", (0,), None), 0
    offsets = sorted(rng.sample(range(0, 100_000, 16), 50))
    one_by_one, as_run = FileTap("f", (1, 2)), FileTap("f", (1, 2))
    one_by_one.add(Tapped("first", "Int32", (1,), None), ((5, 4),))
    as_run.add(Tapped("first", "Int32", (1,), None), ((5, 4),))
    for name, kind, offset, length in zip(names, kinds, offsets, lengths):
        one_by_one.add(Tapped(name, *kind), ((offset, length),))
    as_run.add_whole(names, kinds, offsets, lengths)
    for tap in (one_by_one, as_run):
        tap.seal()
    assert list(as_run.tensors) == list(one_by_one.tensors) and len(as_run.tensors) == 51
    assert as_run.key == one_by_one.key
    assert list(as_run.ranges()) == list(one_by_one.ranges())


def test_taps_are_made_only_for_a_conversion_that_runs_when_the_hash_pass_reads_nothing(tmp_path, monkeypatch):
    """A first run reads every source: the taps ride on that read, made at once. A rerun finds every
    digest cached and reads nothing: the taps are left to ``settled()`` (the conversion, if it runs),
    and then give the same fingerprints, from the cache of tap states, reading nothing again."""
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    source, target = _source("S2_block_mp4dp2opt_to_mp4")
    made = []

    def run():
        with prepare(source, target) as prepared:
            def make():
                made.append(source_taps(JOB, prepared))
                return made[-1]
            digests = hash_sources(prepared, use_cache=True, progress=False, make_taps=make)
            count = len(made)
            settled = digests.settled()
            return count, settled.fingerprints.digests(), settled

    first = run()
    assert first[0] == 1 and first[2].pending is None  # made at once, fed by the read
    again = run()
    assert again[0] == 1 and len(made) == 2  # not made by the hash pass; made once settled
    assert again[1] == first[1] and made[-1].read_back == 0
