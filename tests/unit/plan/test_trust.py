"""Inputs that disagree are refused before any output: a source strategy that does not describe
the checkpoints (another network, another layout, lying or missing pipeline stages, optimizer-shard
fields missing for one parameter) must never plan into a wrong checkpoint.

Everything here works at the planner level on the golden scenarios (MindSpore 2.10's own files),
mixed and altered. Refusal comes in two forms: a ``ReshardError`` from the planner, or a group of
``Plan.identical`` whose tensors differ, which the job hashes (done here by ``hash_refusal``).
"""

from __future__ import annotations

import hashlib
import re
import json
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import pytest

from reshard_job.errors import PlanError, ReshardError, StrategyFormatError
from reshard_job.sources.open_files import SourceFiles
from reshard_job.formats.ckpt import CheckpointReader
from reshard_job.core.strategy_model import StrategyFile, StrategyItem
from reshard_job.formats.strategy import merge_strategy_files, read_strategy, to_json_bytes, write_strategy
from reshard_job.plan.checks import CHECK_IDENTICAL, CHECK_OPTIMIZER, CHECK_STAGES, identical_mismatch
from reshard_job.plan.model import Plan
from reshard_job.plan.planner import Planner
from reshard_job.sources.rank_folders import discover, load_strategy
from reshard_job.core.topology import Topology, optimizer_base

GOLDEN = Path(__file__).parents[2] / "golden"
SCENARIOS = sorted(p.name for p in GOLDEN.iterdir() if (p / "manifest.json").is_file() and (p / "src_checkpoints").is_dir())


@lru_cache(maxsize=None)
def scenario_files(name: str):
    """({rank: path}, index) of a golden scenario's source checkpoints (read once per session)."""
    files = discover(GOLDEN / name / "src_checkpoints").files
    with SourceFiles(files) as sources:
        return files, sources.index()


def manifest(name: str) -> dict:
    return json.loads((GOLDEN / name / "manifest.json").read_text())


def own_strategy(name: str) -> str | None:
    src = manifest(name)["src"]
    rel = src.get("strategy_file") or src.get("strategy_dir")
    return str(GOLDEN / name / rel) if rel else None


def strategy_variants() -> list[tuple[str, str]]:
    """(label, path) of every strategy in the golden set: source ones (files, stage directories,
    merged files) and target ones, each usable as a (possibly wrong) source strategy."""
    out = []
    for name in SCENARIOS:
        m = manifest(name)
        for rel in (m["src"].get("strategy_file"), m["src"].get("strategy_dir"), m["src"].get("merged_strategy_file"),
                    m["dst"].get("strategy_file")):
            if rel:
                out.append((f"{name[:3]}/{rel}", str(GOLDEN / name / rel)))
    return out


def digest(path: str, name: str) -> str:
    with CheckpointReader(path) as r:
        h = hashlib.sha256()
        for block in r.iter_content(name):
            h.update(block)
        return h.hexdigest()


def hash_refusal(plan: Plan, files: dict[int, str], strategy: str | None = None) -> PlanError | None:
    """What the job does with ``plan.identical``: hash each listed tensor in each listed rank and
    refuse on the first group whose copies differ."""
    for name, groups in plan.identical.items():
        for group in groups:
            if len({digest(files[r], name) for r in group}) > 1:
                return identical_mismatch(name, group, strategy)
    return None


def plan_with(strategy: str | Topology | None, scenario: str, dst=None, **kw) -> Plan:
    """Plan the checkpoints of `scenario` with a given source strategy, as the job does: only the
    rank folders the strategy describes are sources."""
    topo = strategy if isinstance(strategy, Topology) else load_strategy(strategy).topology
    _, index = scenario_files(scenario)
    index = {r: m for r, m in index.items() if r < topo.devices}
    return Planner(topo, dst, index, **kw).plan()


def same_layouts(a: Topology, b: Topology) -> bool:
    return (a.stage_devices, a.num_stages, a.layouts) == (b.stage_devices, b.num_stages, b.layouts)


# ================================================================================ another strategy


@pytest.mark.parametrize("label,strategy", strategy_variants(), ids=[v[0] for v in strategy_variants()])
def test_any_golden_strategy_with_any_golden_checkpoints(label, strategy):
    """Every strategy of the golden set (source and target ones) against every scenario's source
    checkpoints: planned and content-checked, it is accepted only where it is the strategy those
    checkpoints were saved with (the same layouts; S2/S5a and S3/S5c share a source layout)."""
    topo = load_strategy(strategy).topology
    for scenario in SCENARIOS:
        files, index = scenario_files(scenario)
        truth = own_strategy(scenario)
        truth_topo = load_strategy(truth).topology
        legit = same_layouts(topo, truth_topo)
        try:
            plan = plan_with(topo, scenario)
        except ReshardError as e:
            assert not legit, f"{label} with {scenario}: refused although it is their strategy: {e}"
            assert "\n" not in str(e) and len(str(e)) < 600
            continue
        refusal = hash_refusal(plan, files, strategy)
        if legit:
            assert refusal is None, f"{label} with {scenario}: {refusal}"
            continue
        if refusal is not None:
            assert "was source.strategy saved with these checkpoints?" in str(refusal)
            continue
        # Accepted although wrong: only possible when rank folders beyond the strategy's devices
        # were left out, each remaining rank holding a distinct block under the wrong layout.
        # Nothing in these ranks' files contradicts it; the job refuses the left-out folders.
        assert max(index) >= topo.devices, f"{label} with {scenario}: a wrong strategy was accepted"


def test_golden_plans_list_replicas_and_whole_tensors_that_hold_the_same_bytes():
    """On MindSpore's own files the groups of ``identical`` do hold identical bytes (no false
    refusal), and they name what they should: global_step on every rank read, and replicas of
    laid-out parameters (S1's source keeps every weight on 2 or 8 replicas)."""
    for scenario in SCENARIOS:
        files, _ = scenario_files(scenario)
        m = manifest(scenario)
        dst = m["dst"].get("strategy_file")
        plan = plan_with(own_strategy(scenario), scenario,
                         load_strategy(str(GOLDEN / scenario / dst)).topology if dst else None)
        assert hash_refusal(plan, files) is None, scenario
        read = set(plan.source_ranks)
        if len(read) > 1:
            assert plan.identical["global_step"] == (tuple(sorted(read)),), scenario
            assert CHECK_IDENTICAL in plan.checks
        for groups in plan.identical.values():
            assert all(len(g) > 1 and set(g) <= read for g in groups)
    s1 = "S1_mlp_tutorial_8to4"
    plan = plan_with(own_strategy(s1), s1, load_strategy(str(GOLDEN / s1 / "dst_strategy.ckpt")).topology)
    assert plan.source_ranks == [0, 1, 2, 3]  # MindSpore's replicas: target rank r reads ranks r mod 8
    assert plan.identical["layer2.weight"] == ((0, 1, 2, 3),)  # replicated on all ranks
    assert plan.identical["layer1.weight"] == ((0, 1), (2, 3))  # columns split by one device axis


def test_a_rank_local_slice_is_never_taken_for_a_whole_tensor():
    """A parameter (and its optimizer states) left out of the source strategy is taken whole;
    since each rank holds a slice, the slices differ and the plan's content check refuses."""
    scenario = "S2_block_mp4dp2opt_to_mp4"
    files, _ = scenario_files(scenario)
    sf = read_strategy(own_strategy(scenario))
    laid_out = [n for n in sf.layouts if optimizer_base(n) is None]
    for victim in laid_out:
        family = {victim} | {n for n in sf.layouts if optimizer_base(n) == victim}
        cut = StrategyFile({n: lay for n, lay in sf.layouts.items() if n not in family}, sf.items, path="cut.ckpt")
        plan = plan_with(Topology.from_strategy(cut), scenario)
        assert set(plan.identical[victim]) == {tuple(range(8))}, victim
        err = hash_refusal(plan, files, "cut.ckpt")
        assert err is not None and repr(victim) in str(err), victim


def test_optimizer_shard_fields_missing_for_one_parameter():
    """Drop the optimizer-shard fields (step and size) from one entry whose optimizer states keep
    them, or from one optimizer state: the two imply different global shapes, refused naming
    both. Dropping them from a whole family (parameter and its states) makes the strategy claim
    replicas where ranks hold distinct rows, which the content check refuses."""
    for scenario in ("S2_block_mp4dp2opt_to_mp4", "S3_pipeline2x4opt_to_4"):
        files, _ = scenario_files(scenario)
        topo = load_strategy(own_strategy(scenario)).topology
        sharded = [n for n, per in topo.layouts.items()
                   if any(lay.opt_shard_size for lay in per.values()) and not n.startswith("accu_grads.")]
        assert len(sharded) > 10
        for victim in sharded:
            base = optimizer_base(victim) or victim
            states = [n for n in topo.layouts if optimizer_base(n) == base]
            if not states:
                continue
            bare = {s: replace(lay, opt_shard_step=0, opt_shard_size=0) for s, lay in topo.layouts[victim].items()}
            lying = Topology(topo.stage_devices, topo.num_stages, {**topo.layouts, victim: bare}, "lying.ckpt")
            with pytest.raises(PlanError) as ei:
                plan_with(lying, scenario)
            msg = str(ei.value)
            assert "optimizer-shard fields disagree" in msg and repr(victim) in msg, msg
            if victim == base:  # the whole family
                family = {base, *states}
                layouts = {n: ({s: replace(lay, opt_shard_step=0, opt_shard_size=0) for s, lay in per.items()}
                               if n in family else per) for n, per in topo.layouts.items()}
                plan = plan_with(Topology(topo.stage_devices, topo.num_stages, layouts, "lying.ckpt"), scenario)
                assert CHECK_OPTIMIZER in plan.checks
                assert hash_refusal(plan, files) is not None, victim


def test_optimizer_states_left_out_of_the_strategies_follow_their_parameters(tmp_path, helpers):
    """MindSpore saves only trainable parameters' layouts by default. Without adam_m.*/adam_v.* in
    either strategy, they are still resharded like their parameters: the output is MindSpore's
    (which had them in its strategies), byte for byte."""
    scenario = "S2_block_mp4dp2opt_to_mp4"
    m = manifest(scenario)
    paths = []
    for which, rel in (("src", m["src"]["strategy_file"]), ("dst", m["dst"]["strategy_file"])):
        sf = read_strategy(GOLDEN / scenario / rel)
        trainable = StrategyFile({n: lay for n, lay in sf.layouts.items() if optimizer_base(n) is None}, sf.items)
        assert len(trainable.layouts) < len(sf.layouts)
        write_strategy(trainable, tmp_path / f"{which}.ckpt")
        paths.append(str(tmp_path / f"{which}.ckpt"))
    from reshard_job import transform_checkpoints

    out = transform_checkpoints(GOLDEN / scenario / "src_checkpoints", tmp_path / "out", "checkpoint_", *paths)
    for rank, written in out.items():
        want = {n: e["sha256"] for n, e in m["expected"][str(rank)].items()}
        assert written.tensors == want  # same tensors, same order


# ================================================================================ pipeline stages


def stage_files_as_json(tmp_path: Path, stages: dict[str, int], scenario="S3_pipeline2x4opt_to_4") -> Path:
    """The scenario's per-stage strategy files rewritten as JSON, each claiming the given stage
    (file name -> stage number)."""
    out = tmp_path / "stages"
    out.mkdir()
    for path in sorted((GOLDEN / scenario / "src_strategy_dir").iterdir()):
        sf = read_strategy(path)
        claim = stages.get(path.stem, sf.file_stage)
        if claim is None:
            continue  # dropped
        sf.items = [replace(it, stage=claim) for it in sf.items]
        (out / f"{path.stem}.json").write_bytes(to_json_bytes(sf))
    return out


def test_a_per_stage_file_claiming_stage_minus_one(tmp_path):
    stages = stage_files_as_json(tmp_path, {"stage1": -1})
    with pytest.raises(StrategyFormatError) as ei:
        load_strategy(stages)
    assert "stage1.json" in str(ei.value) and "pipeline stage -1 is out of range" in str(ei.value)


@pytest.mark.parametrize("claims,needle", [
    ({"stage0": 1, "stage1": 0}, "but the source strategy places it in stage"),  # swapped
    ({"stage1": 0}, "claims pipeline stage 0, like"),  # both claim 0, layouts differ
    ({"stage1": 5}, "missing for stage(s) [1, 2, 3, 4]"),  # a gap
    ({"stage0": None}, "missing for stage(s) [0]"),  # a dropped stage
    ({"stage0": 10**12}, "out of range"),  # huge
])
def test_lying_or_missing_stage_numbers(tmp_path, claims, needle):
    stages = stage_files_as_json(tmp_path, claims)
    with pytest.raises(ReshardError) as ei:
        plan_with(str(stages), "S3_pipeline2x4opt_to_4")
    assert needle in str(ei.value)


def test_a_dropped_last_stage_leaves_ranks_the_strategy_does_not_describe(tmp_path):
    """Without the last stage's file the strategy describes ranks 0-3 only. Within them it is
    consistent; what gives it away is rank folders 4-7, which the job refuses since they hold
    parameters no described rank holds (reliability tests). The planner sees no stage-1 parameter."""
    stages = stage_files_as_json(tmp_path, {"stage1": None})
    topo = load_strategy(stages).topology
    assert topo.devices == 4
    _, index = scenario_files("S3_pipeline2x4opt_to_4")
    held = set().union(*(index[r] for r in range(4, 8)))
    assert not held <= set().union(*(index[r] for r in range(4)))


def test_a_lone_per_stage_file_of_a_later_stage_is_not_taken_for_stage_zero():
    with pytest.raises(ReshardError, match="stage1.ckpt: is the strategy of pipeline stage 1 alone"):
        load_strategy(GOLDEN / "S3_pipeline2x4opt_to_4" / "src_strategy_dir" / "stage1.ckpt")


def test_an_operator_of_another_stage_in_a_per_stage_file(tmp_path):
    files = [read_strategy(p) for p in sorted((GOLDEN / "S3_pipeline2x4opt_to_4" / "src_strategy_dir").iterdir())]
    files[0].items.append(StrategyItem("stray", 1, ()))
    with pytest.raises(StrategyFormatError, match=r"operators claim pipeline stages \[0, 1\]"):
        merge_strategy_files(files)


def test_a_merged_file_that_moves_one_parameter_to_another_stage():
    sf = read_strategy(GOLDEN / "S3_pipeline2x4opt_to_4" / "src_strategy_merged.ckpt")
    key = next(k for k in sf.layouts if k.startswith("1-") and "ln" in k)
    layouts = {("0-" + k[2:] if k == key else k): v for k, v in sf.layouts.items()}
    lying = Topology.from_strategy(StrategyFile(layouts, sf.items, path="lying.ckpt"))
    with pytest.raises(PlanError) as ei:
        plan_with(lying, "S3_pipeline2x4opt_to_4")
    assert repr(key[2:]) in str(ei.value) and "stage [0] only" in str(ei.value)


def test_checks_and_identical_survive_the_plan_json():
    plan = plan_with(own_strategy("S1_mlp_tutorial_8to4"), "S1_mlp_tutorial_8to4")
    again = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again.identical == plan.identical and again.checks == plan.checks
    assert CHECK_STAGES in plan.checks and CHECK_OPTIMIZER in plan.checks
    old = plan.to_json()
    del old["identical"], old["checks"]  # a version-2 plan
    assert Plan.from_json(old).identical == {}


def test_messages_are_one_bounded_line_even_for_huge_names():
    name = "layers." + "x" * 5000 + "\n.weight"
    err = identical_mismatch(name, [3, 1, 2], "/s.ckpt")
    assert "\n" not in str(err) and len(str(err)) < 400 and "1-3" in str(err)


# ================================================================================== the target side

# (source folder, source strategy, network) of each golden source; the target strategies per network
GOLDEN_SOURCES = {
    "S1": ("S1_mlp_tutorial_8to4/src_checkpoints", "S1_mlp_tutorial_8to4/src_strategy.ckpt", "mlp"),
    "S2": ("S2_block_mp4dp2opt_to_mp4/src_checkpoints", "S2_block_mp4dp2opt_to_mp4/src_strategy.ckpt", "block2"),
    "S3": ("S3_pipeline2x4opt_to_4/src_checkpoints", "S3_pipeline2x4opt_to_4/src_strategy_dir", "block4"),
    "S5b": ("S5b_split_1to8/src_checkpoints", None, "block2"),
    "M1a": ("M1a_mf_llama_dp2mp2os_bf16_to_mp4/src_mindformers", None, "llama"),
    "M1b": ("M1b_mf_llama_pp2dp2mp2os2_to_mp4/src_mindformers", None, "llama"),
}
GOLDEN_TARGETS = {
    "S1": ("S1_mlp_tutorial_8to4/dst_strategy.ckpt", "mlp"),
    "S2": ("S2_block_mp4dp2opt_to_mp4/dst_strategy.ckpt", "block2"),
    "S3": ("S3_pipeline2x4opt_to_4/dst_strategy.ckpt", "block4"),
    "S5b": ("S5b_split_1to8/dst_strategy.ckpt", "block2"),
    "M1a": ("M1a_mf_llama_dp2mp2os_bf16_to_mp4/dst_strategy.ckpt", "llama"),
    "M1b": ("M1b_mf_llama_pp2dp2mp2os2_to_mp4/dst_strategy.ckpt", "llama"),
}


def _prepare(source: str, target: str, **target_settings):
    from reshard_job.job.stages.prepare import prepare
    from reshard_job.job.config.spec import SourceSpec, TargetSpec

    folder, strategy, _ = GOLDEN_SOURCES[source]
    return prepare(SourceSpec(str(GOLDEN / folder), str(GOLDEN / strategy) if strategy else None),
                   TargetSpec(str(GOLDEN / GOLDEN_TARGETS[target][0]), **target_settings))


@pytest.mark.parametrize("target", sorted(GOLDEN_TARGETS))
@pytest.mark.parametrize("source", sorted(GOLDEN_SOURCES))
def test_a_target_strategy_of_another_network_is_refused(source, target):
    """Every golden target strategy against every golden source: refused in one line naming the target
    strategy when the networks differ (whatever target.unmapped says), planned when they are one."""
    if GOLDEN_SOURCES[source][2] == GOLDEN_TARGETS[target][1]:
        with _prepare(source, target) as prepared:
            assert prepared.plan.ranks
            assert all(o["name"].startswith("accu_grads.") for o in prepared.plan.omitted)
        return
    # a four-layer source for a two-layer target: the layers left over need target.unmapped=full or drop
    subset = GOLDEN_SOURCES[source][2] == "block4" and GOLDEN_TARGETS[target][1] == "block2"
    for unmapped in ("omit",) if subset else ("omit", "full", "drop"):
        with pytest.raises(PlanError) as refused:
            _prepare(source, target, unmapped=unmapped).close()
        message = str(refused.value)
        assert "\n" not in message and GOLDEN_TARGETS[target][0].split("/")[0] in message, message
        assert ("lays out none of" in message or "the outputs would lack them" in message
                or ("not laid out by the target strategy" in message and unmapped == "omit")), message


def test_parameters_the_target_leaves_out_need_a_choice():
    """S3's four-layer sources with S2's two-layer target strategy: refused by default (the layers the
    target lacks are named); target.unmapped=full keeps them whole, drop leaves them out, each listed."""
    with pytest.raises(PlanError, match=r"parameter\(s\) of .*src_strategy_dir are not laid out by the target "
                                        r"strategy .*S2_block.*: 'layers\.\d.*set target.unmapped=full"):
        _prepare("S3", "S2")
    with _prepare("S3", "S2", unmapped="drop") as prepared:
        omitted = {o["name"]: o["reason"] for o in prepared.plan.omitted}
    dropped = {n for n in omitted if not n.startswith("accu_grads.")}
    assert len(dropped) == 39 and len(omitted) > len(dropped)
    assert all("target.unmapped=drop" in omitted[n] for n in dropped)
    with _prepare("S3", "S2", unmapped="full") as prepared:
        assert prepared.plan.omitted == []
        kept = {p.name for p in prepared.plan.ranks[0].params}
    assert dropped <= kept


def _kept_part(tmp_path: Path, target: str, fraction: float) -> str:
    """A golden target strategy with only the first `fraction` of its layouts (at least one)."""
    sf = read_strategy(str(GOLDEN / GOLDEN_TARGETS[target][0]))
    names = list(sf.layouts)
    kept = names[:max(1, int(len(names) * fraction))]
    path = tmp_path / f"{target}_{fraction}.ckpt"
    write_strategy(replace(sf, layouts={n: sf.layouts[n] for n in kept}), path)
    return str(path)


def _prepare_with(source: str, target_path: str, **target_settings):
    from reshard_job.job.config.spec import SourceSpec, TargetSpec
    from reshard_job.job.stages.prepare import prepare

    folder, strategy, _ = GOLDEN_SOURCES[source]
    return prepare(SourceSpec(str(GOLDEN / folder), str(GOLDEN / strategy) if strategy else None),
                   TargetSpec(target_path, **target_settings))


@pytest.mark.parametrize("source", ["S2", "S5b"])
@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.4])
def test_a_target_strategy_laying_out_a_small_part_of_the_model_is_refused(tmp_path, source, fraction):
    """One layout of S2's 51 (or a tenth, or 40 %): the strategy of another network sharing a few names,
    refused whatever target.unmapped says; S5b's whole model (no source strategy) alike. With
    unmapped=drop it wrote ranks of 3 tensors, with full every tensor whole, exit 0."""
    target = _kept_part(tmp_path, "S2", fraction)
    for unmapped in ("omit", "full", "drop"):
        with pytest.raises(PlanError) as refused:
            _prepare_with(source, target, unmapped=unmapped).close()
        message = str(refused.value)
        assert "\n" not in message and f"the target strategy {target} lays out only " in message, message
        assert "of the 51 parameter(s) of" in message and "another network, or of a part of this one" in message


def test_a_whole_models_tensors_the_target_does_not_lay_out_follow_target_unmapped(tmp_path):
    """S5b's whole model (no source strategy) with 60 % of S2's target strategy: copied whole by default,
    as MindSpore copies tensors outside both strategies, and said in the plan; unmapped=drop leaves them
    out, listed (it wrote them all)."""
    target = _kept_part(tmp_path, "S2", 0.6)
    with _prepare_with("S5b", target) as prepared:
        assert prepared.plan.omitted == []
        (note,) = [n for n in prepared.plan.notes if "copied whole into every target rank" in n]
        assert note.startswith("21 tensor(s) the target strategy does not lay out")
    with _prepare_with("S5b", target, unmapped="drop") as prepared:
        dropped = [o["name"] for o in prepared.plan.omitted]
        kept = {p.name for p in prepared.plan.ranks[0].params}
    assert len(dropped) == 21 and not set(dropped) & kept
    assert {"global_step", "learning_rate"} <= kept  # scalars: one layout only, copied whole always


def test_optimizer_states_the_target_lays_out_and_no_source_holds_are_said(tmp_path, caplog):
    """S2's target strategy with pipeline buffers and moments added: the outputs cannot hold them; one
    WARNING and the manifest's plan.not_in_sources say so (they were absent without a word)."""
    import logging

    sf = read_strategy(str(GOLDEN / GOLDEN_TARGETS["S2"][0]))
    extra = {f"accu_grads.{n}": lay for n, lay in list(sf.layouts.items())[:3]}
    extra.update({f"moments.{n}": lay for n, lay in list(sf.layouts.items())[:2]})
    path = tmp_path / "with_states.ckpt"
    write_strategy(replace(sf, layouts={**sf.layouts, **extra}), path)
    with caplog.at_level(logging.WARNING, logger="reshard_job"), _prepare_with("S2", str(path)) as prepared:
        assert sorted(prepared.plan.target_only) == sorted(extra)
    (line,) = [r.getMessage() for r in caplog.records if "that no source holds" in r.getMessage()]
    assert line.startswith("the target strategy lays out 5 optimizer state(s) or buffer(s) that no source holds")


@pytest.mark.parametrize("side", ["target", "source"])
@pytest.mark.parametrize("change, needle", [
    ({"param_split_shape": (8, 24, 16, 16), "indices_offset": (0, 8, 32, 48)}, "an uneven split"),
    ({"field": 2}, "a field split (field 2)"),
])
def test_layouts_split_unevenly_or_by_field_are_refused_not_cut_evenly(tmp_path, side, change, needle):
    """MindSpore's manual uneven split of an embedding table (or its field split) in a strategy: the
    slices are not the tensor map's even ones. It converted as if they were, exit 0."""
    which = GOLDEN_TARGETS["S2"][0] if side == "target" else GOLDEN_SOURCES["S2"][1]
    sf = read_strategy(str(GOLDEN / which))
    sf = replace(sf, layouts={**sf.layouts, "embedding_table": replace(sf.layouts["embedding_table"], **change)})
    path = tmp_path / "split.ckpt"
    write_strategy(sf, path)
    from reshard_job.job.config.spec import SourceSpec, TargetSpec
    from reshard_job.job.stages.prepare import prepare

    folder, strategy, _ = GOLDEN_SOURCES["S2"]
    source = SourceSpec(str(GOLDEN / folder), str(path) if side == "source" else str(GOLDEN / strategy))
    target = TargetSpec(str(path) if side == "target" else str(GOLDEN / GOLDEN_TARGETS["S2"][0]))
    with pytest.raises(PlanError, match=re.escape(f"parameter 'embedding_table': {path} lays it out with {needle}")):
        prepare(source, target).close()
