"""``audit openlineage``: recorded runs as OpenLineage run events, one JSON object per line."""

from __future__ import annotations

import json
import uuid

from reshard_job.audit import main
from reshard_job.lineage import FileRecord
from reshard_job.lineage.uses import record_use

REQUIRED = {"eventType", "eventTime", "run", "job", "inputs", "outputs", "producer", "schemaURL"}


def test_every_run_becomes_a_run_event_with_its_files_as_datasets(store, two_hop, tmp_path, make_file):
    url = store.url.render_as_string(hide_password=False)
    model = make_file(tmp_path / "model.ckpt", b"trained", "target_checkpoint")
    used = record_use("finetune", [two_hop.final.path], [model.path], lineage_url=url)
    given = make_file(tmp_path / "given.ckpt", b"layout", "strategy")
    copy = make_file(tmp_path / "out_c" / "strategy.ckpt", b"layout", "strategy")
    run_c = store.start_run(config={}, overrides=[], tool_version="0.1.0", output_dir=str(tmp_path / "out_c"),
                            source_devices=1, target_devices=1)
    store.record_inputs(run_c, [given])
    store.complete_run(run_c, outputs=[FileRecord(copy.path, copy.sha256, copy.size, "strategy", copied=True)],
                       plan={"ranks": []})
    store.fail_run(store.start_run(config={}, overrides=[], tool_version="0.1.0", output_dir=str(tmp_path / "x"),
                                   source_devices=1, target_devices=1), "disk full")

    assert main(["--db", url, "openlineage", "--output", str(tmp_path / "events.jsonl")]) == 0
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["run"]["runId"] for e in events][:2] == [two_hop.run_a, two_hop.run_b]
    for event in events:
        assert REQUIRED <= set(event) and uuid.UUID(event["run"]["runId"])
        assert event["schemaURL"].endswith("#/$defs/RunEvent") and event["eventTime"].endswith("+00:00")
    by_run = {e["run"]["runId"]: e for e in events}
    a = by_run[two_hop.run_a]
    assert (a["eventType"], a["job"]) == ("COMPLETE", {"namespace": "reshard_job", "name": "convert", "facets": {}})
    assert {(d["namespace"], d["name"]) for d in a["inputs"]} >= {("file", f.path) for f in two_hop.sources}
    content = a["outputs"][0]["facets"]["reshardJobContent"]
    assert (content["digest"], content["size"]) in {(f.sha256, f.size) for f in two_hop.outputs_a}
    assert by_run[used]["job"]["name"] == "finetune"
    assert [d["name"] for d in by_run[used]["outputs"]] == [model.path]
    assert by_run[run_c]["outputs"] == []  # a copy of an input is not a product of the run
    failed = events[-1]
    assert failed["eventType"] == "FAIL" and failed["run"]["facets"]["errorMessage"]["message"] == "disk full"
