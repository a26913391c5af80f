"""Hostile inputs of a fifth round (combinations of keys that are each valid alone), as a user runs
them: each ends in one line (exit 2) before anything is written, or converts correctly."""

from __future__ import annotations

from pathlib import Path

import pytest

from reliability_helpers import copy_s1, run_app, s1_args, the_error


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:", "sqlite+pysqlite://"])
def test_an_in_memory_lineage_database_is_refused_before_anything_runs(tmp_path, url):
    """It kept nothing and each connection had its own: the conversion ran, its manifest was
    committed, then the job failed with a traceback naming an internal call."""
    ckpts, src, dst = copy_s1(tmp_path / "s1")
    res = run_app(tmp_path, *s1_args(ckpts, src, dst, tmp_path / "out"), f"lineage.url={url}")
    line = the_error(res)
    assert line.startswith(f"lineage.url='{url}': an in-memory SQLite database keeps nothing"), line
    assert res.stderr.count("\n") == 1, res.stderr  # not even a log line before it
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("preset", ["strategy", "single"])
def test_a_declarative_layout_given_on_the_command_line_of_a_preset_without_one_converts(tmp_path, preset):
    """`target.layout={...}` on a preset whose layout was null: OmegaConf cannot merge a dict into a
    null typed node, and the job died in a 61-line traceback (only demo_mlp, which has a layout, worked)."""
    import hashlib
    import json

    from reliability_helpers import GOLDEN
    from reshard_job.formats.ckpt import CheckpointReader

    d = GOLDEN / "S5a_merge_8to1"
    res = run_app(tmp_path, "source=checkpoints", f"source.checkpoints={d / 'src_checkpoints'}",
                  f"source.strategy={d / 'src_strategy.ckpt'}", f"target={preset}", "target.strategy=null",
                  "target.devices=4", "target.layout={mesh: {dp: 1, mp: 4}, rules: [{match: '.*', dims: []}]}",
                  "output.dir=out", "lineage.enabled=false")
    assert res.returncode == 0, res.stderr
    want = json.loads((d / "manifest.json").read_text())["expected"]["0"]  # the whole model, merged
    for rank in range(4):  # every rank holds it whole (dims [] replicate every parameter)
        with CheckpointReader(tmp_path / "out" / f"rank_{rank}" / f"checkpoint_{rank}.ckpt") as r:
            got = {n: hashlib.sha256(r.read_raw(n)).hexdigest() for n in r.names()}
        assert {n: got.get(n) for n in want} == {n: info["sha256"] for n, info in want.items()}


def test_storage_options_given_as_a_dict_are_taken(tmp_path):
    """`storage.options={...}`: the key is documented as a dict, but every key was refused as
    'not in struct' (only `+storage.options.k=v` worked)."""
    res = run_app(tmp_path, "storage.options={anon: true, client_kwargs: {region_name: x}}", "job.mode=plan",
                  "hydra.run.dir=run")
    assert res.returncode == 0, res.stderr
    import yaml

    saved = yaml.safe_load((tmp_path / "run" / ".hydra" / "config.yaml").read_text())
    assert saved["storage"]["options"] == {"anon": True, "client_kwargs": {"region_name": "x"}}


def test_a_manifest_json_of_someone_else_in_output_dir_is_refused_before_the_lock_is_written(tmp_path):
    """It was called one that 'cannot be read (damaged...)', after `.reshard_job/lock` had been
    written into the folder: a golden scenario's folder given as output.dir kept a lock file."""
    ckpts, src, dst = copy_s1(tmp_path / "s1")
    out = tmp_path / "theirs"
    out.mkdir()
    (out / "manifest.json").write_text('{"scenario": "S1", "expected": {}}')
    res = run_app(tmp_path, *s1_args(ckpts, src, dst, out), "lineage.enabled=false")
    assert the_error(res) == (f"output.dir {out} holds a manifest.json this tool did not write (it has no "
                              "'fingerprint'); choose another output.dir or set output.overwrite=true")
    assert sorted(p.name for p in out.rglob("*")) == ["manifest.json"]


def test_a_refusal_after_log_lines_is_its_one_line_alone_and_the_log_file_keeps_them(tmp_path):
    """A selection's INFO line, then the refusal: two lines on the console (a rerun with another
    selection into a finished output.dir, a rename the target strategy does not know)."""
    ckpts, src, dst = copy_s1(tmp_path / "s1")
    args = s1_args(ckpts, src, dst, tmp_path / "out")
    assert run_app(tmp_path, *args, "lineage.enabled=false").returncode == 0
    res = run_app(tmp_path, *args, "lineage.enabled=false", "target.exclude=[layer1.*]", "hydra.run.dir=run2")
    line = the_error(res)
    assert line.startswith(f"output.dir {tmp_path / 'out'} holds the outputs of a different conversion (run not "
                           "recorded)"), line
    assert res.stderr.count("\n") == 1, res.stderr
    log = (tmp_path / "run2" / "reshard_job.log").read_text()
    assert "[INFO] - selection: include=all exclude=" in log and "holds the outputs of a different" in log
    res = run_app(tmp_path, *args[:-1], f"output.dir={tmp_path / 'out2'}", "lineage.enabled=false")
    assert res.returncode == 0 and "[INFO] - converting 4 target rank(s)" in res.stderr  # a run that goes on: shown


def test_rank_folders_declared_copies_are_compared_by_content_unless_told_not_to(tmp_path):
    """source.unsharded=true took rank_0 as the model and never read the others: a copy with one
    bit flipped, or S2's shards declared copies, converted with exit 0."""
    import shutil

    from reliability_helpers import GOLDEN

    s5b = GOLDEN / "S5b_split_1to8"
    src = tmp_path / "copies"
    for r in range(3):
        shutil.copytree(s5b / "src_checkpoints" / "rank_0", src / f"rank_{r}")
    args = ["source=checkpoints", f"source.checkpoints={src}", "source.unsharded=true", "target=strategy",
            f"target.strategy={s5b / 'dst_strategy.ckpt'}", "lineage.enabled=false"]
    assert run_app(tmp_path, *args, "output.dir=same").returncode == 0  # true copies: converted
    flipped = next((src / "rank_2").glob("*.ckpt"))
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 1
    flipped.write_bytes(bytes(data))
    line = the_error(run_app(tmp_path, *args, "output.dir=out"))
    assert line.startswith(f"{flipped}: source.unsharded=true says each rank folder is a copy of rank_0's whole "
                           "model, but '"), line
    assert "rank_2 holds other values" in line and not (tmp_path / "out").exists()
    assert run_app(tmp_path, *args, "output.dir=out", "source.verify_replicas=false").returncode == 0
    s2 = GOLDEN / "S2_block_mp4dp2opt_to_mp4" / "src_checkpoints"
    line = the_error(run_app(tmp_path, "source=checkpoints", f"source.checkpoints={s2}", "source.strategy=null",
                             "source.unsharded=true", "target=single", "output.dir=s2", "lineage.enabled=false"))
    assert "is a copy of rank_0's whole model, but 'embedding_table': rank_1 holds other values" in line


def _completed(tmp_path) -> tuple[Path, list[str]]:
    ckpts, src, dst = copy_s1(tmp_path / "s1")
    out = tmp_path / "out"
    args = [*s1_args(ckpts, src, dst, out), f"lineage.url=sqlite:///{tmp_path / 'lin.db'}"]
    assert run_app(tmp_path, *args).returncode == 0
    return out, args


def _edit_manifest(out: Path, edit) -> None:
    import json
    import os

    path = out / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    os.chmod(path, 0o644)
    path.write_text(json.dumps(manifest, indent=2) + "\n")


def _audit_verify(tmp_path, out: Path) -> str:
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "reshard_job.audit", "--db", f"sqlite:///{tmp_path / 'lin.db'}",
                          "verify", str(out)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def _tensor_digests_hold(out: Path) -> None:
    import hashlib
    import json

    from reshard_job.formats.ckpt import CheckpointReader

    manifest = json.loads((out / "manifest.json").read_text())
    for f in manifest["target"]["files"]:
        assert hashlib.sha256(Path(f["path"]).read_bytes()).hexdigest() == f["sha256"]
        with CheckpointReader(f["path"]) as r:
            got = {n: hashlib.sha256(r.read_raw(n)).hexdigest() for n in r.names()}
        assert got == manifest["tensors"][str(f["rank"])]


@pytest.mark.parametrize("damage", ["strategy flipped", "strategy removed", "file sha256 edited",
                                    "tensor digest edited"])
def test_a_rerun_into_a_complete_directory_damaged_outside_its_rank_files_repairs_it(tmp_path, damage):
    """'nothing to do' was said over a damaged strategy.ckpt and over a manifest whose digests had
    been edited (adopted, recorded in the lineage database, and kept)."""
    out, args = _completed(tmp_path)
    strategy = out / "strategy.ckpt"
    want = strategy.read_bytes()
    if damage.startswith("strategy"):
        strategy.chmod(0o644)
        if damage == "strategy removed":
            strategy.unlink()
        else:
            strategy.write_bytes(want[:1000] + bytes([want[1000] ^ 1]) + want[1001:])
    elif damage == "file sha256 edited":
        _edit_manifest(out, lambda m: m["target"]["files"][0].update(sha256="0" * 64))
    else:
        _edit_manifest(out, lambda m: m["tensors"]["0"].update({next(iter(m["tensors"]["0"])): "0" * 64}))
    res = run_app(tmp_path, *args)
    assert res.returncode == 0, res.stderr
    assert "already done" not in res.stdout and "redoing what does not verify" in res.stderr
    assert strategy.read_bytes() == want
    _tensor_digests_hold(out)
    assert "all 6 files intact" in _audit_verify(tmp_path, out)
    again = run_app(tmp_path, *args)
    assert again.returncode == 0 and "completed (already done)" in again.stdout
