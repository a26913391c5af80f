"""How the job reaches Ray, without a cluster: the configuration keys settled at the edge, the
per-node checks and publishing run as plain functions on a folder standing for a node's disk,
source identities seen through another machine's mount, and node manifests read by the audit."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from reshard_job.errors import ConfigError
import reshard_job.job.config.schema as schema
from reshard_job.job.stages.executor_choice import cluster_layout
from reshard_job.job.output.manifest import build_manifest, manifest_digest
from reshard_job.job.output.node_outputs import (NodeFile, PublishRequest, SurveyRequest, node_manifest_name,
                                                 publish_node, survey_node)
from reshard_job.job.run.ray.worker import with_node_identities
from reshard_job.job.config.settle import settle
from reshard_job.job.config.spec import JobContext
from reshard_job.lineage.errors import LineageError
from reshard_job.audit.manifests import node_listings, read_listing
from reshard_job.storage.atomic import temp_name_for
from reshard_job.storage.local import identity_of
from reshard_job.execute.tasks import RankTask

STRATEGY_ARGS = ["source.checkpoints=/data/ckpt", "target=strategy", "target.strategy=/data/dst.ckpt"]


def settled(tmp_path, *overrides: str):
    schema.register()
    with initialize_config_module("reshard_job.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    return settle(cfg, JobContext(str(tmp_path), str(tmp_path / "run"), tuple(overrides), from_presets=True))


# ============================================================================ settling the keys


def test_defaults_run_locally_on_shared_storage(tmp_path):
    spec = settled(tmp_path)
    assert (spec.run.executor, spec.output.placement, spec.target.cluster.given) == ("local", "shared", False)
    assert (spec.run.ray.address, spec.run.ray.num_cpus_per_task, spec.run.ray.max_retries) == ("auto", 1.0, 3)


def test_ray_keys_settle(tmp_path):
    spec = settled(tmp_path, "job.executor=ray", "job.ray.address=ray://head:10001", "job.ray.num_cpus_per_task=0.5",
                   "job.ray.max_retries=0", "output.placement=per_node", "target.devices=8",
                   "target.cluster.nodes=2", "target.cluster.node_resource_prefix=rack_")
    assert (spec.run.executor, spec.run.ray.address, spec.run.ray.num_cpus_per_task, spec.run.ray.max_retries) == \
        ("ray", "ray://head:10001", 0.5, 0)
    assert spec.output.placement == "per_node"
    assert cluster_layout(spec, 8) == {"nodes": 2, "devices_per_node": 4, "node_resource_prefix": "rack_"}
    # the whole mapping form of the issue
    spec = settled(tmp_path, "target.devices=8", "target.cluster={nodes: 2, devices_per_node: 4}")
    assert (spec.target.cluster.nodes, spec.target.cluster.devices_per_node) == (2, 4)


@pytest.mark.parametrize("overrides, message", [
    (["job.executor=dask"], "job.executor must be local or ray, got 'dask'"),
    (["job.ray.address=head"], "job.ray.address: Ray address 'head' is not 'auto', 'ray://host:port' or 'host:port'"),
    (["job.ray.num_cpus_per_task=0"], "job.ray.num_cpus_per_task must be a number above 0 and at most 1024, got 0"),
    (["job.ray.num_cpus_per_task=inf"], "job.ray.num_cpus_per_task must be a number above 0 and at most 1024, "
                                        "got inf"),
    (["job.ray.max_retries=-1"], "job.ray.max_retries must be an integer from 0 to 100; got -1"),
    (["output.placement=nearby"], "output.placement must be shared or per_node, got 'nearby'"),
    (["output.placement=per_node", "target.cluster.nodes=2"],
     "output.placement=per_node writes each rank's file on its target node through Ray; set job.executor=ray"),
    (["output.placement=per_node", "job.executor=ray"],
     "output.placement=per_node needs the target cluster's layout: set target.cluster.devices_per_node "
     "(or target.cluster.nodes)"),
    (["output.placement=per_node", "job.executor=ray", "target.cluster.nodes=2", "output.dir=s3://bucket/out"],
     "output.placement=per_node writes to each node's local disk, but output.dir is 's3://bucket/out'; use a local "
     "path, or output.placement=shared"),
    (["target.devices=8", "target.cluster.nodes=2", "target.cluster.devices_per_node=8"],
     "target.cluster has 2 node(s) x 8 device(s) = 16 devices but target.devices is 8"),
    (["target.devices=8", "target.cluster.nodes=3"],
     "target.devices 8 cannot be spread evenly over target.cluster.nodes 3; set target.cluster.devices_per_node"),
    (["target.cluster.devices_per_node=0"], "target.cluster.devices_per_node must be an integer from 1 to 1048576"),
    (["target.cluster.node_resource_prefix=''"], "target.cluster.node_resource_prefix must be a non-empty name"),
    (["+job.ray.adress=auto"], "unknown configuration key job.ray.adress; did you mean job.ray.address?"),
])
def test_bad_values_are_refused_in_one_line_naming_the_key(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as info:
        settled(tmp_path, *overrides)
    assert str(info.value).startswith(message), str(info.value)
    assert "\n" not in str(info.value)


def test_cluster_is_checked_against_devices_from_the_strategy(tmp_path):
    spec = settled(tmp_path, *STRATEGY_ARGS, "job.executor=ray", "output.placement=per_node",
                   "target.cluster.devices_per_node=8")
    assert spec.target.devices is None  # known once the strategy is read
    assert cluster_layout(spec, 16)["nodes"] == 2
    with pytest.raises(ConfigError, match=r"^target\.devices 12 is not a multiple of target\.cluster\."
                                          r"devices_per_node 8 \(from target\.strategy\)$"):
        cluster_layout(spec, 12)


# ============================================================================ a node's disk


def node_disk(tmp_path) -> Path:
    out = tmp_path / "out"
    for rank in (2, 3):
        (out / f"rank_{rank}").mkdir(parents=True)
        (out / f"rank_{rank}" / f"checkpoint_{rank}.ckpt").write_bytes(bytes([rank]) * (100 + rank))
    return out


def as_node_file(out: Path, rank: int, *, identity: bool = True) -> NodeFile:
    path = out / f"rank_{rank}" / f"checkpoint_{rank}.ckpt"
    data = path.read_bytes()
    return NodeFile(rank, f"rank_{rank}/checkpoint_{rank}.ckpt", len(data), hashlib.sha256(data).hexdigest(),
                    tuple(identity_of(path.stat())) if identity else ())


def request(out: Path, **kw) -> SurveyRequest:
    expected = tuple(NodeFile(r, f"rank_{r}/checkpoint_{r}.ckpt") for r in (2, 3))
    return SurveyRequest(str(out), "reshard_node_1", kw.pop("fingerprint", "f" * 64), expected, **kw)


def test_survey_keeps_what_verifies_and_removes_leftovers(tmp_path):
    out = node_disk(tmp_path)
    claims = (as_node_file(out, 2), as_node_file(out, 3, identity=False))
    left = Path(temp_name_for(str(out / "rank_3" / "checkpoint_3.ckpt")))
    left.write_bytes(b"half")
    result = survey_node(request(out, claims=claims))
    assert (result.problem, result.verified, result.removed) == (None, (2, 3), 1)  # 3 re-hashed: no identity
    assert not left.exists()

    (out / "rank_3" / "checkpoint_3.ckpt").write_bytes(b"\x03" * 103)  # same size, same bytes, new identity
    (out / "rank_2" / "checkpoint_2.ckpt").write_bytes(b"\x09" * 102)  # same size, other bytes
    assert survey_node(request(out, claims=(as_node_file(out, 3),) + claims[:1])).verified == (3,)
    (out / "rank_3" / "checkpoint_3.ckpt").unlink()
    assert survey_node(request(out, claims=claims)).verified == ()


def test_survey_refuses_another_conversion_or_foreign_files_unless_overwrite(tmp_path):
    out = node_disk(tmp_path)
    other = {"fingerprint": "0" * 64, "run_id": "run-9", "target": {"files": [
        {"rank": 2, "path": "/elsewhere/out/rank_2/checkpoint_2.ckpt"}]}}
    manifest = out / node_manifest_name("reshard_node_1")
    manifest.write_text(json.dumps(other))
    problem = survey_node(request(out)).problem
    assert problem == (f"output.dir {out} on reshard_node_1 holds the outputs of a different conversion (run run-9); "
                       "choose another output.dir or set output.overwrite=true")
    assert manifest.exists()
    assert survey_node(request(out, overwrite=True)).problem is None
    assert not manifest.exists() and not (out / "rank_2" / "checkpoint_2.ckpt").exists()  # its files went

    problem = survey_node(request(out, driver_fresh=True)).problem  # rank_3's file: nobody's record
    assert problem == (f"output.dir {out} on reshard_node_1 holds files this tool did not produce "
                       "(rank_3/checkpoint_3.ckpt); choose another output.dir or set output.overwrite=true")
    assert survey_node(request(out, driver_fresh=False)).problem is None  # the driver's journal owns it


def test_survey_takes_the_node_manifest_down_only_before_rewriting(tmp_path):
    out = node_disk(tmp_path)
    manifest = out / node_manifest_name("reshard_node_1")
    manifest.write_text(json.dumps({"fingerprint": "f" * 64, "node": "reshard_node_1"}))
    digest = (manifest.stat().st_size, hashlib.sha256(manifest.read_bytes()).hexdigest())
    assert survey_node(request(out, will_write=False)).manifest == digest
    assert manifest.exists()
    assert survey_node(request(out, will_write=True)).manifest is None
    assert not manifest.exists()


def test_survey_refuses_a_link_out_of_output_dir_and_a_file_in_its_place(tmp_path):
    out = node_disk(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (out / "rank_3" / "checkpoint_3.ckpt").unlink()
    (out / "rank_3").rmdir()
    (out / "rank_3").symlink_to(elsewhere)
    problem = survey_node(request(out)).problem
    assert problem.startswith(f"output.dir {out} on reshard_node_1: rank_3/checkpoint_3.ckpt would be written to "
                              f"{elsewhere}, outside output.dir")
    blocked = tmp_path / "file"
    blocked.write_text("x")
    problem = survey_node(request(blocked)).problem
    assert problem == f"output.dir {blocked} on reshard_node_1 exists and is not a directory"


def test_publish_writes_strategy_then_manifest_and_checks_the_files(tmp_path):
    out = node_disk(tmp_path)
    files = (as_node_file(out, 2), as_node_file(out, 3))
    data = b'{"node": "reshard_node_1"}\n'
    size, sha = publish_node(PublishRequest(str(out), "reshard_node_1", files, data, "strategy.ckpt", b"strategy"))
    assert (size, sha) == (len(data), hashlib.sha256(data).hexdigest())
    assert (out / "manifest.reshard_node_1.json").read_bytes() == data
    assert (out / "strategy.ckpt").read_bytes() == b"strategy"
    assert oct((out / "manifest.reshard_node_1.json").stat().st_mode & 0o777) == "0o444"
    (out / "rank_3" / "checkpoint_3.ckpt").write_bytes(b"cut")
    answer = publish_node(PublishRequest(str(out), "reshard_node_1", files, data))
    assert answer == (f"output.dir {out} on reshard_node_1: rank_3/checkpoint_3.ckpt is missing or changed size "
                      "since it was written; run the same command again to redo it")


# ============================================================================ identities on another machine


def test_source_identities_are_taken_as_this_node_sees_the_same_file(tmp_path):
    src = tmp_path / "rank_0.ckpt"
    src.write_bytes(b"source")
    here = tuple(identity_of(src.stat()))
    task = RankTask(0, None, {0: str(src), 1: "s3://bucket/rank_1.ckpt"}, str(tmp_path / "out.ckpt"),
                    source_identities={0: (here[0] + 1,) + here[1:], 1: (6, "etag", None)})
    seen = with_node_identities(task)
    assert seen.source_identities == {0: here, 1: (6, "etag", None)}  # another mount of the same file
    changed = replace(task, source_identities={0: (here[0] + 1, here[1], here[2], here[3] + 1, here[4])})
    assert with_node_identities(changed) is changed  # a file that really changed still fails the task
    assert with_node_identities(seen) is seen


# ============================================================================ node manifests for the audit


def test_node_manifests_are_what_the_audit_reads_in_a_node_directory(tmp_path):
    out = node_disk(tmp_path)
    files = [{"rank": r, "path": f"/data/out/rank_{r}/checkpoint_{r}.ckpt", "size": 100 + r,
              "sha256": hashlib.sha256(bytes([r]) * (100 + r)).hexdigest(), "node": "reshard_node_1"} for r in (2, 3)]
    common = dict(run_id="r1", tool_version="x", fingerprint="f" * 64, config={}, source={}, plan_summary={})
    manifest = build_manifest(**common, target={"files": files, "strategy": None}, tensors={}, node="reshard_node_1")
    assert manifest["node"] == "reshard_node_1" and manifest["manifest_sha256"] == manifest_digest(manifest)
    (out / "manifest.reshard_node_1.json").write_text(json.dumps(manifest))
    (out / "manifest.other.json").write_text("{}")  # not a node manifest: ignored
    [listing] = node_listings(str(out))
    assert listing.node == "reshard_node_1" and listing.per_node
    assert [(f.rank, f.node, f.path) for f in listing.files] == [
        (2, "reshard_node_1", str(out / "rank_2" / "checkpoint_2.ckpt")),
        (3, "reshard_node_1", str(out / "rank_3" / "checkpoint_3.ckpt"))]
    assert read_listing(str(out)).files == listing.files  # no manifest.json: the node manifests stand for it
    os.remove(out / "manifest.reshard_node_1.json")
    with pytest.raises(LineageError, match="no manifest.json, so not a complete output directory"):
        read_listing(str(out))


def test_a_cluster_that_does_not_fit_the_strategy_is_refused_before_anything_is_written(tmp_path, all_golden_scenarios):
    from reshard_job.job.runner import run_job

    sc = next(s for s in all_golden_scenarios if s.name.startswith("S1_"))  # 4 target ranks
    out = tmp_path / "out"
    spec = settled(tmp_path, f"source.checkpoints={sc.src_checkpoints}", f"source.strategy={sc.src_strategy}",
                   "target=strategy", f"target.strategy={sc.dst_strategy}", f"output.dir={out}",
                   "target.cluster.devices_per_node=3", "lineage.enabled=false")
    with pytest.raises(ConfigError) as info:
        run_job(spec, emit=lambda text: None)
    assert str(info.value) == ("target.devices 4 is not a multiple of target.cluster.devices_per_node 3 "
                               "(from target.strategy)")
    assert not out.exists()
