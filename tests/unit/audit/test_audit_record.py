"""Uses by other programs: ``record_use`` and ``audit record`` join a model to the conversion it came from.

source → conversion A → copy → conversion B → output folder → a fine-tuning run (recorded here)
that read the folder and wrote a model file: the model's ancestry reaches the sources, and the
sources' descendants reach the model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from reshard_job.audit.entities import ANCESTORS, DESCENDANTS
from reshard_job.audit.trace import trace_reference


def _url(store) -> str:
    return store.url.render_as_string(hide_password=False)


def _trace(store, ref: str, direction: str) -> dict:
    with store.read_session() as session:
        return trace_reference(session, ref, direction).to_json()


def test_a_recorded_use_joins_the_model_to_the_sources_both_ways(store, two_hop, tmp_path):
    import reshard_job

    model = tmp_path / "finetuned" / "model.ckpt"
    model.parent.mkdir()
    model.write_bytes(b"weights trained from hop B's output")
    out_b = os.path.dirname(os.path.dirname(two_hop.final.path))
    run_id = reshard_job.record_use("finetune-llama", [out_b], [str(model)], lineage_url=_url(store))

    back = _trace(store, str(model), ANCESTORS)
    assert [run["run_id"] for run in back["runs"]] == [run_id, two_hop.run_b, two_hop.run_a]
    originals = {o["sha256"] for o in back["original_sources"] if o["kind"] == "source_checkpoint"}
    assert originals == {f.sha256 for f in two_hop.sources}

    forward = _trace(store, two_hop.sources[0].path, DESCENDANTS)
    assert run_id in [run["run_id"] for run in forward["runs"]]
    finals = {(f["path"], f["kind"]) for f in forward["final_outputs"]}
    assert (str(model), "target_checkpoint") in finals
    assert two_hop.final.path not in {path for path, _ in finals}  # read by the consumer: no longer final


def test_the_use_is_recorded_with_its_consumer_kinds_and_ranks(store, two_hop, tmp_path, get_run):
    from reshard_job.lineage.uses import record_use

    out_b = os.path.dirname(os.path.dirname(two_hop.final.path))
    run_id = record_use("eval", [out_b], lineage_url=_url(store))
    run = get_run(store, run_id)
    assert run["status"] == "completed" and run["config"]["use"]["consumer"] == "eval"
    kinds = {(os.path.relpath(f["path"], out_b), f["kind"], f["rank"]) for f in run["inputs"]}
    assert kinds == {("rank_0/checkpoint_0.ckpt", "source_checkpoint", 0),
                     ("rank_1/checkpoint_1.ckpt", "source_checkpoint", 1),
                     ("strategy.ckpt", "strategy", None), ("manifest.json", "manifest", None)}
    assert run["outputs"] == []


def _audit(cwd, *args, env=None):
    environment = {k: v for k, v in os.environ.items() if k not in ("RESHARD_JOB_LINEAGE_URL", "RESHARD_LINEAGE_URL")}
    environment.update(env or {})
    return subprocess.run([sys.executable, "-m", "reshard_job.audit", *args], cwd=cwd, env=environment,
                          capture_output=True, text=True, timeout=120)


def test_audit_record_on_the_command_line_reads_the_database_from_the_environment(tmp_path, make_file):
    from reshard_job.lineage import LineageStore

    url = f"sqlite:///{tmp_path / 'team' / 'lineage.db'}"
    source = make_file(tmp_path / "converted" / "rank_0" / "checkpoint_0.ckpt", b"converted rank 0",
                       "target_checkpoint", 0)
    with LineageStore(url) as store:
        store.ensure_schema()
        conversion = store.start_run(config={}, overrides=[], tool_version="0.1.0",
                                     output_dir=str(tmp_path / "converted"), source_devices=1, target_devices=1)
        store.complete_run(conversion, outputs=[source], plan={"ranks": []})
    (tmp_path / "model.ckpt").write_bytes(b"a model")

    recorded = _audit(tmp_path, "record", "--consumer", "finetune", "--inputs", "converted",
                      "--outputs", "model.ckpt", "--json", env={"RESHARD_JOB_LINEAGE_URL": url})
    assert recorded.returncode == 0, recorded.stderr
    run_id = json.loads(recorded.stdout)["run_id"]
    traced = _audit(tmp_path, "trace", "model.ckpt", "--json", env={"RESHARD_JOB_LINEAGE_URL": url})
    assert traced.returncode == 0, traced.stderr
    assert [run["run_id"] for run in json.loads(traced.stdout)["runs"]] == [run_id, conversion]


def test_audit_record_refuses_a_missing_path_in_one_line(tmp_path):
    res = _audit(tmp_path, "--db", str(tmp_path / "lineage.db"), "record", "--consumer", "x",
                 "--inputs", "nowhere")
    assert res.returncode == 2
    assert res.stderr.strip() == f"error: {tmp_path / 'nowhere'}: no such file or folder (given as an input)"
    assert not (tmp_path / "lineage.db").exists()


def test_links_to_folders_are_not_followed_when_a_folder_is_recorded(tmp_path):
    """Two links to the folder's own parent made the walk exponential (killed at 60 s), one link
    recorded one file under 41 ever longer paths: folders reached by a link are not walked (as
    ``find`` does not), a linked file is recorded as the file it is."""
    from reshard_job.lineage.uses import expand

    folder = tmp_path / "model"
    (folder / "a").mkdir(parents=True)
    (folder / "a" / "f.ckpt").write_bytes(b"y")
    (folder / "a" / "up1").symlink_to("..")
    (folder / "a" / "up2").symlink_to("..")
    (tmp_path / "outside.ckpt").write_bytes(b"z")
    (folder / "linked.ckpt").symlink_to(tmp_path / "outside.ckpt")
    found = sorted(path for path, _, _ in expand([folder], "input"))
    assert found == [str(folder / "a" / "f.ckpt"), str(folder / "linked.ckpt")]


def test_a_name_that_is_not_utf8_is_one_line_before_anything_is_recorded(tmp_path):
    """audit record of a folder holding such a file, and verify or trace naming one, ended in an
    encoding traceback (the record's run left 'started')."""
    folder = tmp_path / "in"
    folder.mkdir()
    odd = os.fsdecode(bytes(folder) + b"/bad\xff\xfe")
    with open(odd, "wb") as f:
        f.write(b"y")
    db = tmp_path / "lineage.db"
    shown = f"{folder}/bad\\xff\\xfe: the name is not valid UTF-8"
    res = _audit(tmp_path, "--db", str(db), "record", "--consumer", "x", "--inputs", str(folder))
    assert res.returncode == 2 and res.stderr.startswith(f"error: {shown}") and res.stderr.count("\n") == 1
    assert not db.exists()
    for command in ("verify", "trace"):
        res = _audit(tmp_path, "--db", str(db), command, odd)
        assert res.returncode == 2 and res.stderr.startswith(f"error: {shown}") and "Traceback" not in res.stderr
