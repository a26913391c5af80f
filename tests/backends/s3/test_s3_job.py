"""The batch job with object storage, end to end against a real S3 server (SeaweedFS).

Golden MindSpore scenarios from the bucket to the bucket, from the bucket to a local directory (a
pipeline strategy directory given as a prefix) and from a local directory to the bucket; the
credentials reaching the store from the standard environment or from ``storage.*``, and never
written anywhere; the lineage of a checkpoint that crossed from a local file to an object.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from s3_job_helpers import GOLDEN, Bucket, Runner, completed, sha256

S1 = GOLDEN / "S1_mlp_tutorial_8to4"
S3 = GOLDEN / "S3_pipeline2x4opt_to_4"


@pytest.fixture
def bucket(s3_store, s3_prefix) -> Bucket:
    name, prefix = s3_prefix[len("s3://"):].split("/", 1)
    return Bucket(s3_store, name, prefix)


@pytest.fixture
def runner(tmp_path, s3_server, job_launcher) -> Runner:
    """Job runs that find the store through the standard environment variables."""
    key, secret = s3_server.credentials["admin"]
    return Runner(tmp_path, {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret,
                             "AWS_ENDPOINT_URL": s3_server.endpoint, "AWS_DEFAULT_REGION": "us-east-1"},
                  job_launcher)


def expected_files(scenario: Path, ranks) -> dict[str, bytes]:
    """What a local run of the same conversion writes: MindSpore's outputs where they are exact, else ours."""
    return {f"rank_{r}/checkpoint_{r}.ckpt": (scenario / "expected" / f"rank_{r}" / f"checkpoint_{r}.ckpt").read_bytes()
            for r in ranks}


def test_golden_from_the_bucket_to_the_bucket_is_byte_identical(bucket, runner):
    src = bucket.put_tree(S1, bucket.url("golden"))
    out = bucket.url("ckpt_4cards")
    res = runner.job(f"source.checkpoints={src}/src_checkpoints", f"source.strategy={src}/src_strategy.ckpt",
                     "target=strategy", f"target.strategy={src}/dst_strategy.ckpt", f"output.dir={out}/")
    assert completed(res) == out  # the prefix as given, without the trailing slash
    # the layout mirrors a local output directory; the lock and unfinished uploads are gone
    assert bucket.keys(out) == [".reshard_job/journal.jsonl", ".reshard_job/manifest.sha256"] + \
        [f".reshard_job/tensors/rank_{r}.json" for r in range(4)] + \
        ["manifest.json"] + [f"rank_{r}/checkpoint_{r}.ckpt" for r in range(4)] + ["strategy.ckpt"]
    assert bucket.uploads(out) == []
    for rel, want in expected_files(S1, range(4)).items():
        assert bucket.get(f"{out}/{rel}") == want, rel  # MindSpore 2.10's own bytes
    manifest = json.loads(bucket.get(f"{out}/manifest.json"))
    assert manifest["source"]["checkpoints"] == f"{src}/src_checkpoints"
    assert [f["path"] for f in manifest["source"]["files"]][:2] == [
        f"{src}/src_checkpoints/rank_0/checkpoint_0.ckpt", f"{src}/src_checkpoints/rank_1/checkpoint_1.ckpt"]
    for f in manifest["target"]["files"]:
        assert f["path"] == f"{out}/rank_{f['rank']}/checkpoint_{f['rank']}.ckpt"
        assert sha256(bucket.get(f["path"])) == f["sha256"]
    # run again: nothing to do, nothing rewritten
    before = {k: bucket.store.info(f"{out}/{k}").identity for k in bucket.keys(out) if k.startswith("rank_")}
    again = runner.job(f"source.checkpoints={src}/src_checkpoints", f"source.strategy={src}/src_strategy.ckpt",
                       "target=strategy", f"target.strategy={src}/dst_strategy.ckpt", f"output.dir={out}")
    assert completed(again) == out and "completed (already done)" in again.stdout
    assert {k: bucket.store.info(f"{out}/{k}").identity for k in before} == before


@pytest.mark.slow  # per-stage strategies are read the same way from disk (tests/e2e/cli)
def test_pipeline_strategy_prefix_in_the_bucket_to_a_local_directory(bucket, runner, tmp_path):
    src = bucket.put_tree(S3, bucket.url("pp"))
    local_run = runner.job(f"source.checkpoints={S3 / 'src_checkpoints'}", f"source.strategy={S3 / 'src_strategy_dir'}",
                           "target=strategy", f"target.strategy={S3 / 'dst_strategy.ckpt'}",
                           f"output.dir={tmp_path / 'from_disk'}")
    completed(local_run)
    res = runner.job(f"source.checkpoints={src}/src_checkpoints", f"source.strategy={src}/src_strategy_dir",
                     "target=strategy", f"target.strategy={src}/dst_strategy.ckpt", "output.dir=from_bucket")
    assert completed(res) == str(tmp_path / "from_bucket")
    for r in range(4):
        rel = Path(f"rank_{r}") / f"checkpoint_{r}.ckpt"
        assert (tmp_path / "from_bucket" / rel).read_bytes() == (tmp_path / "from_disk" / rel).read_bytes()
    manifest = json.loads((tmp_path / "from_bucket" / "manifest.json").read_text())
    strategy = manifest["source"]["strategy"]
    assert strategy["path"] == f"{src}/src_strategy_dir"
    assert sorted(f["path"] for f in strategy["files"]) == sorted(
        f"{src}/src_strategy_dir/{p.name}" for p in (S3 / "src_strategy_dir").iterdir())


def test_local_to_the_bucket_with_credentials_in_the_config_never_written_down(bucket, s3_server, tmp_path):
    key, secret = s3_server.credentials["admin"]
    env_secret = "environment-secret-never-recorded-0123"
    # The environment holds a (wrong, unused) secret too; the config's credentials win, and neither
    # may appear in anything the job writes.
    runner = Runner(tmp_path, {"AWS_ACCESS_KEY_ID": "unused-key", "AWS_SECRET_ACCESS_KEY": env_secret})
    out = bucket.url("uploaded")
    res = runner.job(f"source.checkpoints={S1 / 'src_checkpoints'}", f"source.strategy={S1 / 'src_strategy.ckpt'}",
                     "target=strategy", f"target.strategy={S1 / 'dst_strategy.ckpt'}", f"output.dir={out}",
                     f"storage.endpoint_url={s3_server.endpoint}", f"+storage.options.key={key}",
                     f"+storage.options.secret={secret}", "job.workers=2")
    assert completed(res) == out
    for rel, want in expected_files(S1, range(4)).items():
        assert bucket.get(f"{out}/{rel}") == want, rel
    written = [res.stdout, res.stderr] + [p.read_bytes().decode("utf-8", "replace")
                                          for p in tmp_path.rglob("*") if p.is_file()]
    written += [bucket.get(f"{out}/{k}").decode("utf-8", "replace") for k in bucket.keys(out)
                if not k.endswith(".ckpt")]
    with sqlite3.connect(tmp_path / "runs" / "lineage.db") as con:
        written += [" ".join(map(str, row)) for table in ("runs", "events", "artifact_locations")
                    for row in con.execute(f"select * from {table}")]  # noqa: S608 - fixed names
    assert any("result.json" in str(p) for p in tmp_path.rglob("*"))
    assert any(".hydra" in str(p) for p in tmp_path.rglob("*"))
    for text in written:
        assert secret not in text and env_secret not in text
    config = json.loads(bucket.get(f"{out}/manifest.json"))["config"]
    assert config["storage"] == {"endpoint_url": s3_server.endpoint, "options": {"key": "***", "secret": "***"}}


def test_lineage_crosses_from_a_local_file_to_the_object_it_was_uploaded_as(bucket, runner, tmp_path):
    first = runner.job(f"source.checkpoints={S1 / 'src_checkpoints'}", f"source.strategy={S1 / 'src_strategy.ckpt'}",
                       "target=strategy", f"target.strategy={S1 / 'dst_strategy.ckpt'}", "output.dir=ckpt_4cards")
    local_out = Path(completed(first))
    uploaded = bucket.put_tree(local_out, bucket.url("ckpt_4cards"))  # as `aws s3 cp --recursive` would
    second = runner.job(f"source.checkpoints={uploaded}", f"source.strategy={uploaded}/strategy.ckpt",
                        "target=single", f"output.dir={bucket.url('ckpt_full')}")
    full = completed(second)

    # backwards from the final object: through the uploaded objects to the original local files
    trace = runner.audit("trace", f"{full}/rank_0/checkpoint_0.ckpt", "--json")
    assert trace.returncode == 0, trace.stderr
    doc = json.loads(trace.stdout)
    originals = {path for a in doc["original_sources"] for path in a["paths"]}
    assert str(S1 / "src_checkpoints" / "rank_0" / "checkpoint_0.ckpt") in originals
    assert {sha256((S1 / "src_checkpoints" / f"rank_{r}" / f"checkpoint_{r}.ckpt").read_bytes())
            for r in range(8)} <= {a["sha256"] for a in doc["original_sources"]}
    # forwards from a local output file: to the run that read its uploaded copy, and its object
    down = runner.audit("trace", "--descendants", str(local_out / "rank_0" / "checkpoint_0.ckpt"), "--json")
    assert down.returncode == 0, down.stderr
    assert f"{full}/rank_0/checkpoint_0.ckpt" in down.stdout and f"{uploaded}/rank_0/checkpoint_0.ckpt" in down.stdout

    # verify re-reads the objects: intact, then one object replaced is found changed
    assert runner.audit("verify", full).returncode == 0
    bucket.put(f"{full}/rank_0/checkpoint_0.ckpt", b"not the checkpoint")
    broken = runner.audit("verify", full)
    assert broken.returncode == 1 and "changed" in broken.stdout and f"{full}/rank_0/checkpoint_0.ckpt" in broken.stdout


def test_output_guards_compare_urls_as_places(bucket):
    from reshard_job.errors import OutputError
    from reshard_job.job.output.directory import OutputDir

    src = bucket.url("ckpt")
    inside = OutputDir(bucket.url("ckpt", "out").replace("s3://", "s3a://"), bucket.store)
    with pytest.raises(OutputError, match="is inside the source directory"):
        inside.check_not_source([src + "/"], [])
    beside = OutputDir(bucket.url("ckpt_4cards"), bucket.store)  # a sibling sharing a name prefix
    beside.check_not_source([src], [f"{src}/rank_0/checkpoint_0.ckpt"])
    with pytest.raises(OutputError, match="would replace the source file"):
        beside.check_planned([bucket.url("ckpt_4cards", "strategy.ckpt")], [bucket.url("ckpt_4cards/strategy.ckpt/")])


M1A = GOLDEN / "M1a_mf_llama_dp2mp2os_bf16_to_mp4"
M1B = GOLDEN / "M1b_mf_llama_pp2dp2mp2os2_to_mp4"


def local_outputs(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.suffix in (".ckpt", ".safetensors", ".json") and ".reshard_job" not in p.parts
            and p.name != "manifest.json"}


@pytest.mark.slow  # each source kind's reading from the bucket goes through the one storage layer the rank-folder test covers
def test_mindformers_save_and_an_export_in_the_bucket_convert_as_on_disk(bucket, runner, tmp_path):
    """The formats MindFormers users have, where their checkpoints live: a MindFormers save (tracker
    file, iteration folder, metadata.json, per-rank model and opt files) read from a prefix, and an
    export for inference (shards + index) written to the bucket and read back from it."""
    src = bucket.put_tree(M1A / "src_mindformers", bucket.url("mf"))
    target = [f"target.strategy={M1A / 'dst_strategy.ckpt'}", "target=strategy"]
    completed(runner.job("source=checkpoints", f"source.checkpoints={M1A / 'src_mindformers'}", *target,
                         "output.dir=from_disk"))
    out = completed(runner.job("source=checkpoints", f"source.checkpoints={src}", *target, "output.dir=from_bucket"))
    want = local_outputs(tmp_path / "from_disk")
    assert len(want) == 5 and local_outputs(Path(out)) == want  # 4 ranks + strategy
    manifest = json.loads((Path(out) / "manifest.json").read_text())
    assert all(f["path"].startswith(f"{src}/iteration_00000020/") for f in manifest["source"]["files"])

    exported = bucket.url("exp")
    common = ["source=checkpoints", "target=hf_export", "target.max_shard_size=12KB", "target.include=all"]
    completed(runner.job(*common, f"source.checkpoints={M1B / 'src_mindformers'}", "output.dir=exp_disk"))
    completed(runner.job(*common, f"source.checkpoints={bucket.put_tree(M1B / 'src_mindformers', bucket.url('mfb'))}",
                         f"output.dir={exported}"))
    disk = {k: v for k, v in local_outputs(tmp_path / "exp_disk").items()}
    assert len(disk) > 2 and {k: bucket.get(f"{exported}/{k}") for k in disk} == disk
    back = [f"target.strategy={M1B / 'src_strategy_merged.ckpt'}", "target=strategy", "lineage.enabled=false"]
    completed(runner.job("source=checkpoints", f"source.checkpoints={tmp_path / 'exp_disk'}", *back,
                         "output.dir=back_disk"))
    out = completed(runner.job("source=checkpoints", f"source.checkpoints={exported}", *back, "output.dir=back_bucket"))
    assert local_outputs(Path(out)) == local_outputs(tmp_path / "back_disk") != {}


@pytest.mark.slow  # safetensors rank files read the same way from disk; the bucket path is the rank-folder test's
def test_safetensors_rank_folders_in_the_bucket_convert_as_on_disk(bucket, runner, tmp_path):
    """Per-rank safetensors files (what a ``target.format=safetensors`` job writes) as sources in a
    bucket: indexed and hashed in one read each, converted to the same bytes as from disk."""
    s1 = [f"source.strategy={S1 / 'src_strategy.ckpt'}"]
    to_st = ["target=strategy", f"target.strategy={S1 / 'src_strategy.ckpt'}", "target.format=safetensors"]
    completed(runner.job(f"source.checkpoints={S1 / 'src_checkpoints'}", *s1, *to_st, "output.dir=st"))
    src = bucket.url("st")
    for path in sorted((tmp_path / "st").glob("rank_*/*.safetensors")):
        bucket.put(f"{src}/{path.parent.name}/{path.name}", path.read_bytes())
    back = [*s1, "target=strategy", f"target.strategy={S1 / 'dst_strategy.ckpt'}", "lineage.enabled=false"]
    completed(runner.job(f"source.checkpoints={tmp_path / 'st'}", *back, "output.dir=from_disk"))
    out = completed(runner.job(f"source.checkpoints={src}", *back, "output.dir=from_bucket"))
    want = local_outputs(tmp_path / "from_disk")
    assert len(want) == 5 and local_outputs(Path(out)) == want
    manifest = json.loads((Path(out) / "manifest.json").read_text())
    for f in manifest["source"]["files"]:  # the digests taken while indexing are those of the bytes
        assert f["sha256"] == sha256(bucket.get(f["path"]))


def test_verify_reaches_objects_at_the_endpoint_the_run_recorded(bucket, runner, s3_server):
    from dataclasses import replace

    out = bucket.url("verify_where")
    res = runner.job(f"source.checkpoints={S1 / 'src_checkpoints'}", f"source.strategy={S1 / 'src_strategy.ckpt'}",
                     "target=strategy", f"target.strategy={S1 / 'dst_strategy.ckpt'}", f"output.dir={out}")
    assert completed(res) == out
    run_id = json.loads(bucket.get(f"{out}/manifest.json"))["run_id"]
    # an auditor's shell: credentials, but no AWS_ENDPOINT_URL
    auditor = replace(runner, env={k: v for k, v in runner.env.items() if k != "AWS_ENDPOINT_URL"})
    digest = sha256(bucket.get(f"{out}/rank_1/checkpoint_1.ckpt"))
    for ref in (out, f"{out}/rank_1/checkpoint_1.ckpt", run_id, digest[:12]):
        checked = auditor.audit("verify", ref)
        assert checked.returncode == 0, (ref, checked.stdout, checked.stderr)
        assert "intact" in checked.stdout
    shown = json.loads(auditor.audit("show", run_id, "--json").stdout)
    assert shown["config"]["storage"]["endpoint_url"] == s3_server.endpoint
    assert shown["config"]["storage"]["endpoint_from"] == "environment"
    key, secret = s3_server.credentials["admin"]
    assert secret not in json.dumps(shown)
