"""The convert stage on its own (``job.stages.convert.convert``): a fresh conversion into tmp_path
writes the files the plan names and, last, a manifest whose digests are those of the files; the
same job run again does nothing; a damaged output is redone and the others kept.

Real files: the golden scenario S1 (MindSpore's own MLP, 8 ranks to 4), whose expected tensors
(MindSpore's own conversion) the outputs must hold. The stages around convert run as the job runs
them: ``prepare``, lock the output directory, ``hash_sources``, ``convert``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from stage_runs import convert_stages

from reshard_job.audit.queries import run_details
from reshard_job.formats.ckpt import CheckpointReader
from reshard_job.formats.manifest_file import MANIFEST_FILE
from reshard_job.job.config.spec import JobContext, JobSpec, LineageSpec, OutputSpec, RunSpec, SourceSpec, TargetSpec
from reshard_job.job.output.manifest import manifest_digest
from reshard_job.job.stages.convert import STATUS_COMPLETED, unit_paths
from reshard_job.job.stages.reuse import STATUS_REUSED
from reshard_job.job.stages.prepare import prepare
from reshard_job.job.stages.record import LineageRecorder
from reshard_job.lineage import LineageStore
from reshard_job.storage import SourceChangedError, storage_for

S1 = Path(__file__).parents[3] / "golden" / "S1_mlp_tutorial_8to4"
EXPECTED = json.loads((S1 / "manifest.json").read_text())["expected"]  # per target rank: tensor -> sha256


def _spec(tmp_path: Path, sources: Path = S1 / "src_checkpoints", lineage: bool = False) -> JobSpec:
    return JobSpec(SourceSpec(str(sources), str(S1 / "src_strategy.ckpt")),
                   TargetSpec(strategy=str(S1 / "dst_strategy.ckpt")), OutputSpec(str(tmp_path / "out")),
                   LineageSpec(lineage, f"sqlite:///{tmp_path / 'runs' / 'lineage.db'}"),
                   RunSpec(workers=1, hash_cache=False, progress=False),
                   JobContext(str(tmp_path), str(tmp_path / "run")),
                   config={"target": {"strategy": str(S1 / "dst_strategy.ckpt")}})


_convert = convert_stages  # tests/ is on sys.path through its conftest


def _sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _tensor_sha256(path: str, name: str) -> str:
    h = hashlib.sha256()
    with CheckpointReader(path) as reader:
        for block in reader.iter_content(name):
            h.update(block)
    return h.hexdigest()


def _stamps(out: Path) -> dict[str, tuple[int, int]]:
    """(inode, mtime) of every file under `out` except the job's own state folder."""
    return {str(p.relative_to(out)): (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(out.rglob("*"))
            if p.is_file() and not p.relative_to(out).parts[0].startswith(".")}


def test_a_fresh_conversion_writes_the_planned_files_and_a_manifest_of_their_digests(tmp_path):
    spec = _spec(tmp_path)
    outputs = _convert(spec)
    out = tmp_path / "out"
    assert outputs.status == STATUS_COMPLETED and outputs.out_dir == str(out)
    with prepare(spec.source, spec.target) as prepared:
        planned = unit_paths(prepared, str(out), "checkpoint_", "ckpt", storage_for(str(out)))
    assert planned == {r: str(out / f"rank_{r}" / f"checkpoint_{r}.ckpt") for r in range(4)}

    manifest_bytes = (out / MANIFEST_FILE).read_bytes()
    assert outputs.manifest_path == str(out / MANIFEST_FILE)
    assert outputs.manifest_sha256 == hashlib.sha256(manifest_bytes).hexdigest()
    manifest = json.loads(manifest_bytes)
    assert manifest["manifest_sha256"] == manifest_digest(manifest)
    listed = manifest["target"]["files"]
    assert {f["rank"]: f["path"] for f in listed} == planned
    for f in listed:
        assert (f["size"], f["sha256"]) == (os.path.getsize(f["path"]), _sha256(f["path"]))
    strategy = manifest["target"]["strategy"]
    assert strategy["path"] == str(out / "strategy.ckpt") and strategy["sha256"] == _sha256(out / "strategy.ckpt")
    assert {f["rank"]: f["sha256"] for f in manifest["source"]["files"]} == {
        r: _sha256(S1 / "src_checkpoints" / f"rank_{r}" / f"checkpoint_{r}.ckpt") for r in range(4)}
    for rank, tensors in EXPECTED.items():
        for name, expected in tensors.items():
            assert _tensor_sha256(planned[int(rank)], name) == expected["sha256"], (rank, name)


def test_the_same_job_again_is_a_no_op(tmp_path):
    spec = _spec(tmp_path)
    first = _convert(spec)
    before = _stamps(tmp_path / "out")
    manifest_bytes = (tmp_path / "out" / MANIFEST_FILE).read_bytes()
    again = _convert(spec)
    assert again.status == STATUS_REUSED
    assert again.manifest_sha256 == first.manifest_sha256
    assert [(f["rank"], f["sha256"]) for f in again.files] == [(f["rank"], f["sha256"]) for f in first.files]
    assert _stamps(tmp_path / "out") == before  # not one file rewritten
    assert (tmp_path / "out" / MANIFEST_FILE).read_bytes() == manifest_bytes


def test_a_damaged_output_is_redone_and_the_others_kept(tmp_path):
    spec = _spec(tmp_path)
    first = _convert(spec)
    damaged = tmp_path / "out" / "rank_1" / "checkpoint_1.ckpt"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    os.chmod(damaged, 0o644)
    damaged.write_bytes(bytes(data))  # same size, other bytes
    kept = {name: stamp for name, stamp in _stamps(tmp_path / "out").items() if name.startswith("rank_")
            and not name.startswith("rank_1/")}

    again = _convert(spec)
    assert again.status == STATUS_COMPLETED
    assert _sha256(damaged) == next(f["sha256"] for f in first.files if f["rank"] == 1)
    now = _stamps(tmp_path / "out")
    assert {name: now[name] for name in kept} == kept  # the intact ranks were not written again
    manifest = json.loads((tmp_path / "out" / MANIFEST_FILE).read_bytes())
    listed = {f["rank"]: f["sha256"] for f in manifest["target"]["files"]}
    assert listed == {f["rank"]: f["sha256"] for f in first.files}
    assert again.manifest_sha256 == _sha256(tmp_path / "out" / MANIFEST_FILE)


def test_the_lineage_record_names_what_was_read_and_what_the_manifest_lists(tmp_path):
    spec = _spec(tmp_path, lineage=True)
    recorder = LineageRecorder(spec)
    try:
        recorder.ensure_open()
        # the job records the plan before converting: a run completes only with its plan
        outputs = _convert(spec, recorder, lambda prepared: recorder.record_plan(prepared.plan.to_json))
    finally:
        recorder.close()
    manifest = json.loads((tmp_path / "out" / MANIFEST_FILE).read_bytes())
    assert manifest["run_id"] == outputs.run_id == recorder.run_id
    with LineageStore(spec.lineage.url) as store, store.read_session() as session:
        run = run_details(session, outputs.run_id).to_json()
    assert run["status"] == "completed" and [r["target_rank"] for r in run["rank_map"]] == [0, 1, 2, 3]
    recorded = {(f["kind"], f["path"], f["sha256"]) for f in run["outputs"]}
    strategy = manifest["target"]["strategy"]
    assert recorded == ({("target_checkpoint", f["path"], f["sha256"]) for f in manifest["target"]["files"]}
                        | {("strategy", strategy["path"], strategy["sha256"]),
                           ("manifest", outputs.manifest_path, outputs.manifest_sha256)})
    read = {(f["kind"], f["rank"], f["sha256"]) for f in run["inputs"]}
    assert read == ({("source_checkpoint", f["rank"], f["sha256"]) for f in manifest["source"]["files"]}
                    | {("strategy", None, _sha256(S1 / "src_strategy.ckpt")),
                       ("strategy", None, _sha256(S1 / "dst_strategy.ckpt"))})  # the target strategy given is read too
    copied = {f["path"] for f in run["outputs"] if f.get("copied")}
    assert copied == {strategy["path"]}  # strategy.ckpt is a copy of that input, not a product


def test_a_source_that_changes_after_it_was_hashed_leaves_no_manifest(tmp_path):
    sources = tmp_path / "src"
    shutil.copytree(S1 / "src_checkpoints", sources)
    spec = _spec(tmp_path, sources)
    changed = sources / "rank_2" / "checkpoint_2.ckpt"

    def change_a_source(prepared):
        data = changed.read_bytes()
        changed.unlink()
        changed.write_bytes(data)  # same bytes, another file: what was hashed is gone

    with pytest.raises(SourceChangedError, match=str(changed)):
        _convert(spec, before_convert=change_a_source)
    assert not (tmp_path / "out" / MANIFEST_FILE).exists()
