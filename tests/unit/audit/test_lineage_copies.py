"""A run's copy of an input ties nothing together: two saves converted to one target strategy.

Step A and step B are two saves of one network (same layout, different bytes). Both are converted
8 → 4 to the same target strategy file, which each run copies beside its outputs; then step B's
output is converted again 4 → 1, reading the ``strategy.ckpt`` beside it. Recorded as the job
records it: the given strategy is an input, each ``strategy.ckpt`` a copy. Ancestry and descendants
must list exactly the files of each chain, never the other save's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from reshard_job.audit.entities import ANCESTORS, DESCENDANTS
from reshard_job.audit.trace import trace_reference
from reshard_job.lineage import FileRecord


@dataclass
class TwoSaves:
    sources: dict  # step -> the 8 FileRecords of that save
    source_strategy: FileRecord  # the saves' strategy (the same bytes in each save folder)
    target_strategy: FileRecord  # the strategy file given to both conversions
    runs: dict  # "A", "B", "C" -> run id
    inputs: dict  # run -> its input records
    made: dict  # run -> the outputs it made (checkpoints and manifest)
    copies: dict  # run -> its copy of the target strategy


def _convert(store, make_file, name: str, root: Path, inputs: list, ranks: int, content: str, copy_of=None,
             copied: bool = True):
    run_id = store.start_run(config={"run": name}, overrides=[], tool_version="0.1.0", output_dir=str(root),
                             source_devices=len([f for f in inputs if f.kind == "source_checkpoint"]),
                             target_devices=ranks)
    store.record_inputs(run_id, inputs)
    made = [make_file(root / f"rank_{r}" / f"checkpoint_{r}.ckpt", f"{content} rank {r} ".encode() * 32,
                      "target_checkpoint", r) for r in range(ranks)]
    copy = None
    if copy_of is not None:
        copy = make_file(root / "strategy.ckpt", Path(copy_of.path).read_bytes(), "strategy")
        copy = FileRecord(copy.path, copy.sha256, copy.size, copy.kind, copied=copied)
    made.append(make_file(root / "manifest.json", f'{{"run_id": "{run_id}"}}'.encode(), "manifest"))
    store.complete_run(run_id, outputs=made + ([copy] if copy else []), plan={"ranks": []})
    return run_id, made, copy


def _record(store, make_file, root: Path, copied: bool = True) -> TwoSaves:
    sources, runs, inputs, made, copies = {}, {}, {}, {}, {}
    strategies = {}
    for step in ("A", "B"):
        sources[step] = [make_file(root / f"save_{step}" / f"rank_{r}" / f"checkpoint_{r}.ckpt",
                                   f"global_step {step} rank {r} ".encode() * 32, "source_checkpoint", r)
                         for r in range(8)]
        strategies[step] = make_file(root / f"save_{step}" / "strategy.ckpt", b"layout of 8 ranks", "strategy")
    target = make_file(root / "given" / "dst_strategy.ckpt", b"layout of 4 ranks", "strategy")
    for step in ("A", "B"):
        inputs[step] = sources[step] + [strategies[step]] + ([target] if copied else [])
        runs[step], made[step], copies[step] = _convert(store, make_file, step, root / f"out_{step}", inputs[step],
                                                        4, f"step {step} as 4", copy_of=target, copied=copied)
    read_back = [FileRecord(f.path, f.sha256, f.size, "source_checkpoint", f.rank) for f in made["B"][:4]]
    inputs["C"] = read_back + [FileRecord(copies["B"].path, copies["B"].sha256, copies["B"].size, "strategy")]
    runs["C"], made["C"], copies["C"] = _convert(store, make_file, "C", root / "out_C", inputs["C"], 1, "step B as 1")
    return TwoSaves(sources, strategies["A"], target, runs, inputs, made, copies)


@pytest.fixture
def saves(store, make_file, tmp_path) -> TwoSaves:
    return _record(store, make_file, tmp_path / "files")


def _trace(store, ref: str, direction: str) -> dict:
    with store.read_session() as session:
        return trace_reference(session, ref, direction).to_json()


def _digests(records) -> set[str]:
    return {f.sha256 for f in records}


def test_one_hop_back_lists_only_the_save_that_was_converted(store, saves):
    result = _trace(store, saves.made["B"][0].path, ANCESTORS)
    assert [run["run_id"] for run in result["runs"]] == [saves.runs["B"]]
    assert {a["sha256"] for a in result["ancestors"]} == _digests(saves.inputs["B"])
    assert {(o["path"], o["sha256"]) for o in result["original_sources"] if o["kind"] == "source_checkpoint"} == \
        {(f.path, f.sha256) for f in saves.sources["B"]}


def test_two_hops_back_through_the_copy_beside_the_outputs_never_reach_the_other_save(store, saves):
    result = _trace(store, saves.made["C"][0].path, ANCESTORS)
    assert [run["run_id"] for run in result["runs"]] == [saves.runs["C"], saves.runs["B"]]
    assert {a["sha256"] for a in result["ancestors"]} == _digests(saves.inputs["C"]) | _digests(saves.inputs["B"])
    assert not _digests(saves.sources["A"]) & {a["sha256"] for a in result["ancestors"]}
    # the strategy C read is the given one, copied by B: an original, not a product of A or B
    read = next(node for hop in result["root"]["produced_by"] for node in hop["inputs"]
                if node["path"] == saves.copies["B"].path)
    assert read["original"] and read["sha256"] == saves.target_strategy.sha256


def test_one_hop_forward_lists_only_what_that_run_made(store, saves):
    result = _trace(store, saves.sources["A"][3].path, DESCENDANTS)
    assert [run["run_id"] for run in result["runs"]] == [saves.runs["A"]]
    assert {d["sha256"] for d in result["descendants"]} == _digests(saves.made["A"])
    assert {f["path"] for f in result["final_outputs"]} == {f.path for f in saves.made["A"]}


def test_two_hops_forward_follow_the_converted_save_alone(store, saves):
    result = _trace(store, saves.sources["B"][0].path, DESCENDANTS)
    assert [run["run_id"] for run in result["runs"]] == [saves.runs["B"], saves.runs["C"]]
    assert {d["sha256"] for d in result["descendants"]} == _digests(saves.made["B"]) | _digests(saves.made["C"])
    # and from A's side nothing reaches C, though C read the same strategy bytes A copied
    from_a = _trace(store, saves.sources["A"][0].path, DESCENDANTS)
    assert saves.runs["C"] not in {run["run_id"] for run in from_a["runs"]}


def test_the_copy_is_listed_with_its_run_and_marked_a_copy(store, saves):
    result = _trace(store, saves.made["B"][0].path, ANCESTORS)
    hop = result["root"]["produced_by"][0]
    outputs = [f for f in hop["strategy_files"] if f["direction"] == "output"]
    assert [(f["path"], f.get("copied")) for f in outputs] == [(saves.copies["B"].path, True)]
    # the given strategy still reaches every run that read it, copies included
    from_given = _trace(store, saves.target_strategy.path, DESCENDANTS)
    assert {run["run_id"] for run in from_given["runs"]} == set(saves.runs.values())


def test_equal_strategies_two_runs_made_are_two_files_when_read_where_they_were_made(store, make_file, tmp_path):
    # target.layout instead of a file: each run *makes* its strategy.ckpt, and both make the same bytes
    saves = _record(store, make_file, tmp_path / "files", copied=False)
    back = _trace(store, saves.made["C"][0].path, ANCESTORS)
    assert [run["run_id"] for run in back["runs"]] == [saves.runs["C"], saves.runs["B"]]
    assert not _digests(saves.sources["A"]) & {a["sha256"] for a in back["ancestors"]}
    forward = _trace(store, saves.sources["A"][0].path, DESCENDANTS)
    assert [run["run_id"] for run in forward["runs"]] == [saves.runs["A"]]
    assert {d["sha256"] for d in forward["descendants"]} == _digests(saves.made["A"]) | _digests([saves.copies["A"]])
    # a copy made outside any run is crossed by content: to every run that made those bytes
    elsewhere = make_file(tmp_path / "elsewhere" / "strategy.ckpt", Path(saves.copies["B"].path).read_bytes(),
                          "strategy")
    copied_back = _trace(store, elsewhere.path, ANCESTORS)
    assert {run["run_id"] for run in copied_back["runs"]} == {saves.runs["A"], saves.runs["B"]}
