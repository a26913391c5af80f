"""Ancestry across runs by content: a copied output of run A, converted again by run B."""

from __future__ import annotations

import pytest

from reshard_job.lineage import LineageError
from reshard_job.audit.trace import trace_reference


class queries:  # noqa: N801 - the JSON answers, as ``audit trace --json`` prints them
    @staticmethod
    def trace(session, ref):
        return trace_reference(session, ref).to_json()


def _walk(node, depth=0):
    yield node, depth
    for hop in node["produced_by"]:
        for child in hop["inputs"]:
            yield from _walk(child, depth + 1)


def test_final_file_traces_back_to_all_eight_original_sources(store, two_hop):
    with store.read_session() as session:
        result = queries.trace(session, two_hop.final.path)

    root = result["root"]
    assert root["sha256"] == two_hop.final.sha256
    assert [hop["run_id"] for hop in root["produced_by"]] == [two_hop.run_b]
    assert [run["run_id"] for run in result["runs"]] == [two_hop.run_b, two_hop.run_a]

    # The copy that B read is the same artifact as A's rank-0 output, so the walk reaches A.
    hop_b = root["produced_by"][0]
    copied = next(child for child in hop_b["inputs"] if child["path"] == two_hop.copied.path)
    assert copied["sha256"] == two_hop.outputs_a[0].sha256
    assert [hop["run_id"] for hop in copied["produced_by"]] == [two_hop.run_a]
    assert two_hop.outputs_a[0].path in copied["paths"]

    originals = {a["sha256"] for a in result["original_sources"] if a["kind"] == "source_checkpoint"}
    assert originals == {f.sha256 for f in two_hop.sources}
    ancestor_hashes = {a["sha256"] for a in result["ancestors"]}
    assert {f.sha256 for f in two_hop.sources} | {two_hop.source_strategy.sha256} <= ancestor_hashes

    leaves = {node["sha256"] for node, _ in _walk(root) if node["original"]}
    assert {f.sha256 for f in two_hop.sources} <= leaves


def test_hops_carry_run_date_sources_and_strategies(store, two_hop):
    with store.read_session() as session:
        result = queries.trace(session, two_hop.final.path)
    hop_a = next(run for run in result["runs"] if run["run_id"] == two_hop.run_a)
    assert hop_a["started_at"] and (hop_a["source_devices"], hop_a["target_devices"]) == (8, 4)
    assert [f["rank"] for f in hop_a["source_checkpoints"]] == list(range(8))
    assert [f["sha256"] for f in hop_a["source_checkpoints"]] == [f.sha256 for f in two_hop.sources]
    strategies = {(f["direction"], f["sha256"]) for f in hop_a["strategy_files"]}
    assert ("input", two_hop.source_strategy.sha256) in strategies
    assert ("output", two_hop.outputs_a[4].sha256) in strategies


def test_shared_ancestors_are_expanded_once(store, two_hop):
    with store.read_session() as session:
        result = queries.trace(session, two_hop.final.path)
    mentions = [hop for node, _ in _walk(result["root"]) for hop in node["produced_by"]
                if hop["run_id"] == two_hop.run_a]
    assert len(mentions) == 4 + 1  # four checkpoints and the strategy of A, as read by B
    assert sum(not hop["expanded_elsewhere"] for hop in mentions) == 1


def test_trace_by_sha256_and_by_copied_path(store, two_hop):
    with store.read_session() as session:
        by_hash = queries.trace(session, two_hop.final.sha256.upper())
        by_copy = queries.trace(session, two_hop.copied.path)
    assert by_hash["root"]["sha256"] == two_hop.final.sha256
    assert by_hash["query"] == {"sha256": two_hop.final.sha256, "path": None}
    assert [run["run_id"] for run in by_copy["runs"]] == [two_hop.run_a]


def test_an_original_source_is_its_own_origin(store, two_hop):
    with store.read_session() as session:
        result = queries.trace(session, two_hop.sources[3].path)
    assert result["root"]["original"] and result["runs"] == [] and result["ancestors"] == []


def test_unknown_content_and_changed_files_are_one_line_errors(store, two_hop, tmp_path):
    stranger = tmp_path / "stranger.ckpt"
    stranger.write_bytes(b"never recorded")
    with store.read_session() as session:
        with pytest.raises(LineageError, match="is not in the lineage database"):
            queries.trace(session, str(stranger))
        with pytest.raises(LineageError, match="no file with sha256"):
            queries.trace(session, "ab" * 32)
        with open(two_hop.final.path, "r+b") as f:
            f.write(b"X")
        with pytest.raises(LineageError, match="file changed since") as err:
            queries.trace(session, two_hop.final.path)
    assert "\n" not in str(err.value)


def test_a_deleted_file_is_traced_from_what_was_recorded_at_its_path(store, two_hop):
    import os

    os.remove(two_hop.final.path)
    with store.read_session() as session:
        result = queries.trace(session, two_hop.final.path)
    assert result["root"]["sha256"] == two_hop.final.sha256
    assert "not on disk" in result["query"]["note"]


def test_a_round_trip_that_reproduces_its_sources_terminates(store, tmp_path, make_file):
    # 1 -> 2 -> 1 can give back the original file bit for bit: the file is its own ancestor.
    original = make_file(tmp_path / "full.ckpt", b"full model", "source_checkpoint", 0)
    halves = [make_file(tmp_path / f"half_{r}.ckpt", f"half {r}".encode(), "target_checkpoint", r) for r in range(2)]
    split = store.start_run(config={}, overrides=[], tool_version="0.1.0", output_dir=str(tmp_path),
                            source_devices=1, target_devices=2)
    store.record_inputs(split, [original])
    store.complete_run(split, outputs=halves, plan={"ranks": []})
    merge = store.start_run(config={}, overrides=[], tool_version="0.1.0", output_dir=str(tmp_path),
                            source_devices=2, target_devices=1)
    store.record_inputs(merge, halves)
    store.complete_run(merge, outputs=[make_file(tmp_path / "merged.ckpt", b"full model", "target_checkpoint", 0)],
                       plan={"ranks": []})
    with store.read_session() as session:
        result = queries.trace(session, original.path)
    assert {run["run_id"] for run in result["runs"]} == {split, merge}


def test_byte_identical_replicas_are_each_an_original_file(store, tmp_path, make_file):
    # Data-parallel ranks often hold identical bytes: one artifact, but two files to account for.
    replicas = [make_file(tmp_path / f"src/rank_{r}/checkpoint_{r}.ckpt", b"replica", "source_checkpoint", r)
                for r in (0, 1)]
    output = make_file(tmp_path / "out/rank_0/checkpoint_0.ckpt", b"merged", "target_checkpoint", 0)
    run_id = store.start_run(config={}, overrides=[], tool_version="0.1.0", output_dir=str(tmp_path / "out"),
                             source_devices=2, target_devices=1)
    store.record_inputs(run_id, replicas)
    store.complete_run(run_id, outputs=[output], plan={"ranks": []})
    with store.read_session() as session:
        result = queries.trace(session, output.path)
    assert len(result["ancestors"]) == 1
    assert [(f["path"], f["rank"], f["sha256"]) for f in result["original_sources"]] == [
        (r.path, r.rank, r.sha256) for r in replicas]


def test_descendants_of_a_source_reach_the_final_files_of_both_runs(store, two_hop):
    from reshard_job.audit.entities import DESCENDANTS

    with store.read_session() as session:
        built = trace_reference(session, two_hop.sources[2].path, DESCENDANTS).to_json()
    root = built["root"]
    assert root["sha256"] == two_hop.sources[2].sha256 and not root["final"]
    assert [hop["run_id"] for hop in root["used_by"]] == [two_hop.run_a]
    assert [run["run_id"] for run in built["runs"]] == [two_hop.run_a, two_hop.run_b]
    # A's rank-0 output was read by B through a copy: the walk follows the content.
    hop_a = root["used_by"][0]
    rank0 = next(child for child in hop_a["outputs"] if child["sha256"] == two_hop.outputs_a[0].sha256)
    assert [hop["run_id"] for hop in rank0["used_by"]] == [two_hop.run_b]
    depth = {d["sha256"]: d["depth"] for d in built["descendants"]}
    assert all(depth[f.sha256] == 1 for f in two_hop.outputs_a)
    assert all(depth[f.sha256] == 2 for f in two_hop.outputs_b)
    finals = {(f["path"], f["kind"]) for f in built["final_outputs"]}
    assert finals == {(two_hop.outputs_a[5].path, "manifest")} | {(f.path, f.kind) for f in two_hop.outputs_b}


def test_a_file_no_run_read_has_no_descendants(store, two_hop):
    import reshard_job.audit.render as render
    from reshard_job.audit.entities import DESCENDANTS

    with store.read_session() as session:
        built = trace_reference(session, two_hop.final.path, DESCENDANTS)
    assert built.runs == [] and built.related == [] and built.roots[0].is_end
    assert render.trace_tree(built).splitlines()[-1] == "0 runs built on it; 0 final files"


def test_one_strategy_at_two_paths_is_one_original_file(store, tmp_path, make_file):
    import reshard_job.audit.render as render

    strategy = make_file(tmp_path / "strategies" / "src.ckpt", b"the same strategy", "strategy")
    copy = make_file(tmp_path / "copy_of_src.ckpt", b"the same strategy", "strategy")
    other = make_file(tmp_path / "dst.ckpt", b"another strategy", "strategy")
    source = make_file(tmp_path / "src" / "rank_0.ckpt", b"weights", "source_checkpoint", 0)
    middle = make_file(tmp_path / "a" / "rank_0.ckpt", b"converted once", "target_checkpoint", 0)
    final = make_file(tmp_path / "b" / "rank_0.ckpt", b"converted twice", "target_checkpoint", 0)
    first = store.start_run(config={}, overrides=[], tool_version="0.1.0", output_dir=str(tmp_path / "a"),
                            source_devices=1, target_devices=1)
    store.record_inputs(first, [source, strategy])
    store.complete_run(first, outputs=[middle], plan={"ranks": []})
    second = store.start_run(config={}, overrides=[], tool_version="0.1.0", output_dir=str(tmp_path / "b"),
                             source_devices=1, target_devices=1)
    store.record_inputs(second, [middle, copy, other])
    store.complete_run(second, outputs=[final], plan={"ranks": []})
    with store.read_session() as session:
        traced = trace_reference(session, final.path)
    strategies = [end for end in traced.ends if end.kind == "strategy"]
    assert sorted((end.digest, sorted(end.paths)) for end in strategies) == sorted([
        (strategy.sha256, sorted([strategy.path, copy.path])), (other.sha256, [other.path])])
    assert render.trace_tree(traced).splitlines()[-1] == (
        "2 runs in the ancestry; 3 original files: 1 source checkpoint, 2 strategies")
    assert render.plural(1, "strategy") == "1 strategy" and render.plural(2, "day") == "2 days"


def test_a_run_and_an_output_directory_are_traced_too(store, two_hop):
    import os

    out_b = os.path.dirname(two_hop.outputs_b[-1].path)
    with store.read_session() as session:
        by_run = trace_reference(session, two_hop.run_b).to_json()
        by_directory = trace_reference(session, out_b).to_json()
    assert by_run["query"] == {"run_id": two_hop.run_b}
    assert [root["sha256"] for root in by_run["roots"]] == [f.sha256 for f in sorted(
        two_hop.outputs_b, key=lambda f: ({"target_checkpoint": 1, "strategy": 3, "manifest": 4}[f.kind], f.rank or 0))]
    assert [run["run_id"] for run in by_run["runs"]] == [two_hop.run_b, two_hop.run_a]
    assert by_directory["query"]["manifest"] == os.path.join(out_b, "manifest.json")
    assert [root["path"] for root in by_directory["roots"]] == [f.path for f in two_hop.outputs_b[:3]]
    assert {f.sha256 for f in two_hop.sources} == {
        o["sha256"] for o in by_directory["original_sources"] if o["kind"] == "source_checkpoint"}
