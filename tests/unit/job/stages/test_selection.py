"""target.include / target.exclude / target.rename on golden S2 (MindSpore 2.10, block model with
Adam states, mp4 dp2 with optimizer parallel -> mp4), through the Python API.

What is kept must come out byte-equal to a full conversion; what is renamed must come out as
the same bytes under its new name, given a target strategy whose names were renamed alike.
"""

from __future__ import annotations

import fnmatch
import logging
import re
from dataclasses import replace
from pathlib import Path

import pytest

from reshard_job import api
from reshard_job.errors import ConfigError, PlanError
from reshard_job.formats.ckpt import CheckpointReader
from reshard_job.formats.strategy import read_strategy, write_strategy
from reshard_job.plan.export_shards import is_training_state
from reshard_job.plan.selection import Selection, select

S2 = Path(__file__).parents[3] / "golden" / "S2_block_mp4dp2opt_to_mp4"
SRC, SRC_STRATEGY, DST_STRATEGY = S2 / "src_checkpoints", S2 / "src_strategy.ckpt", S2 / "dst_strategy.ckpt"


def convert(out: Path, dst_strategy=DST_STRATEGY, **selection) -> dict:
    return api.transform_checkpoints(SRC, out, "checkpoint_", SRC_STRATEGY, dst_strategy, **selection)


def names_in(path: str) -> list[str]:
    with CheckpointReader(path) as r:
        return r.names()


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> dict:
    return convert(tmp_path_factory.mktemp("full"))


def test_include_patterns_write_only_those_parameters_byte_equal(tmp_path, full):
    written = convert(tmp_path, include=["layers.*", "head.*"], exclude=["*.bias"])
    for rank, f in written.items():
        names = names_in(f.path)
        assert names and all(n.startswith(("layers.", "head.")) and not n.endswith(".bias") for n in names)
        assert set(names) == {n for n in full[rank].tensors if n.startswith(("layers.", "head."))
                              and not n.endswith(".bias")}
        assert f.tensors == {n: full[rank].tensors[n] for n in names}  # the same bytes as the full conversion


def test_weights_drops_optimizer_state(tmp_path, full):
    written = convert(tmp_path, include="weights")
    for rank, f in written.items():
        dropped = [n for n in full[rank].tensors if is_training_state(n)]
        assert any(n.startswith("adam_m.") for n in dropped) and "global_step" in dropped
        assert set(names_in(f.path)) == set(full[rank].tensors) - set(dropped)
        assert f.tensors == {n: d for n, d in full[rank].tensors.items() if n not in dropped}


def blk(name: str) -> str:
    """``layers.`` renamed ``blk.``, in a parameter's name and in its optimizer states'."""
    return re.sub(r"^(adam_m\.|adam_v\.)?layers\.", r"\1blk.", name)


def renamed_dst(folder: Path) -> Path:
    """S2's target strategy with ``layers.`` renamed ``blk.``, as a renamed network's would be."""
    sf = read_strategy(DST_STRATEGY)
    renamed = {blk(n): lay for n, lay in sf.layouts.items()}
    assert renamed.keys() != sf.layouts.keys()
    write_strategy(replace(sf, layouts=renamed), folder / "dst_renamed.ckpt")
    return folder / "dst_renamed.ckpt"


def test_rename_with_a_renamed_target_strategy_converts_byte_equal(tmp_path, full):
    written = convert(tmp_path / "out", renamed_dst(tmp_path), rename={"layers.": "blk."})
    for rank, f in written.items():
        assert f.tensors == {blk(n): d for n, d in full[rank].tensors.items()}
        assert {"blk.0.ffn.w1.weight", "adam_m.blk.0.ffn.w1.weight"} <= set(names_in(f.path))
        assert not any("layers." in n for n in names_in(f.path))


def test_rename_onto_an_existing_name_is_refused_naming_both():
    with pytest.raises(PlanError, match=r"'head.weight' and 'layers.0.ffn.w1.weight' would both be named"):
        select(Selection(rename=(("layers.0.ffn.w1.", "head."),)), ["layers.0.ffn.w1.weight", "head.weight", "x"])
    with pytest.raises(PlanError, match=r"'a.w' and 'b.w' would both be named 'c.w'"):
        select(Selection(rename=(("a.", "c."), ("b.", "c."))), ["a.w", "b.w"])


def test_collision_refused_before_anything_is_written(tmp_path):
    with pytest.raises(PlanError, match="would both be named"):
        convert(tmp_path / "out", rename={"adam_m.": "adam_v."})
    assert not (tmp_path / "out").exists()


def test_nothing_left_is_refused(tmp_path):
    with pytest.raises(PlanError, match="leave none of the"):
        convert(tmp_path / "out", include=["nothing.*"])


def test_unmatched_pattern_is_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="reshard_job"):
        convert(tmp_path / "out", exclude=["adam_*", "no_such.*"])
    lines = [r.getMessage() for r in caplog.records if "matches no parameter" in r.getMessage()]
    assert lines == ["target.include/target.exclude pattern 'no_such.*' matches no parameter of the source"]


def test_many_unmatched_patterns_are_one_warning_line(tmp_path, caplog):
    """100,000 patterns that match nothing were 100,000 WARNING lines, and a 1 MB pattern was
    repeated whole in the log: one line, the first few shortened, and how many more."""
    long = "z" + "*a" * 2000  # (a longer pattern than MAX_PATTERN is refused)
    with caplog.at_level(logging.INFO, logger="reshard_job"):
        convert(tmp_path / "out", exclude=["adam_*", long, *(f"no_such_{i}.*" for i in range(1000))])
    lines = [r.getMessage() for r in caplog.records if "match no parameter" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(
        "1001 target.include/target.exclude patterns match no parameter of the source: 'z*a*a")
    assert lines[0].endswith("'no_such_3.*' and 996 more")
    assert max(len(r.getMessage()) for r in caplog.records) < 2000


def test_optimizer_states_follow_their_parameter_unless_a_prefix_names_them():
    selection = Selection(rename=(("layers.", "blk."), ("adam_v.head.", "adam_v.out.")))
    assert [selection.new_name(n) for n in ("adam_m.layers.0.w", "adam_v.head.w", "adam_m.head.w", "layers.1")] == \
        ["adam_m.blk.0.w", "adam_v.out.w", "adam_m.head.w", "blk.1"]


def test_first_matching_prefix_wins_and_patterns_see_both_names():
    chosen = select(Selection(include=("model.*",), rename=(("backbone.", "model."), ("backbone.x", "other."))),
                    ["backbone.x", "backbone.y", "head.w"])
    assert chosen.stored == {"model.x": "backbone.x", "model.y": "backbone.y"}
    assert chosen.left_out == ["head.w"]


def test_20000_literal_and_prefix_patterns_are_looked_up_not_compiled(monkeypatch):
    """Each pattern was compiled as a regular expression (twice: all of them together, then each
    on every name to find those that match nothing); literal names and prefixes need none."""
    compiled = []
    translate = fnmatch.translate
    monkeypatch.setattr(fnmatch, "translate", lambda p: compiled.append(p) or translate(p))
    patterns = (*(f"nomatch{i}*" for i in range(10_000)), *(f"nomatch.{i}" for i in range(10_000)), "layers.*",
                "*.bias")
    names = ["layers.0.w", "layers.0.bias", "head.w", "head.bias"]
    chosen = select(Selection(include=patterns, exclude=("head.*", "layers.0.w")), names)
    assert chosen.stored == {"layers.0.bias": "layers.0.bias"}
    assert chosen.left_out == ["head.bias", "head.w", "layers.0.w"]
    assert len(chosen.unmatched) == 20_000 and chosen.unmatched[0] == "nomatch0*"
    assert chosen.unmatched[-1] == "nomatch.9999"
    assert set(compiled) == {"*.bias"}  # the one pattern that is neither


def test_a_rename_of_20000_prefixes_looks_up_a_name_s_prefixes_not_each_rename():
    """Every name (and every optimizer prefix of it) was tested against each rename in turn."""
    class Counted(str):
        tests = 0

        def startswith(self, prefix, *args):
            Counted.tests += 1
            return super().startswith(prefix, *args)

    rename = (*((f"nomatch{i}.", f"x{i}.") for i in range(20_000)), ("layers.", "blk."), ("layers.0.", "first."),
              ("head.", "out."), ("layers.", "twice."))
    selection = Selection(rename=rename)
    assert [selection.new_name(Counted(n)) for n in ("layers.0.w", "adam_m.head.b", "head", "nomatch7.q")] == \
        ["blk.0.w", "adam_m.out.b", "head", "x7.q"]  # the first that matches wins, as before
    assert Counted.tests < 100  # (the optimizer prefixes are still tested, a handful per name)


@pytest.mark.parametrize("kwargs, key", [
    ({"include": ["*a" * 2049]}, "include[0]"), ({"exclude": ["adam_*", "b" * 4097]}, "exclude[1]"),
    ({"rename": {"c" * 4097: "d."}}, "rename[0]'s prefix"), ({"rename": [["e.", "f" * 4097]]}, "rename[0]'s new prefix")])
def test_a_pattern_or_prefix_longer_than_any_name_is_refused_in_one_line(tmp_path, kwargs, key):
    """A 1 MB pattern of wildcards took 12 to 25 s and half a gigabyte to compile and match."""
    with pytest.raises(ConfigError) as refused:
        convert(tmp_path / "out", **kwargs)
    line = str(refused.value)
    assert line.startswith(f"target.{key} has ") and "; at most 4096" in line and "\n" not in line and len(line) < 200
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kwargs, key", [({"include": "weights_only"}, "include"), ({"exclude": "adam_*"}, "exclude"),
                                         ({"rename": ["layers."]}, "rename")])
def test_bad_values_are_refused(tmp_path, kwargs, key):
    with pytest.raises(ConfigError, match=f"^target.{key} must"):
        convert(tmp_path / "out", **kwargs)


def test_the_plan_shows_the_selection_and_what_it_left_out(tmp_path):
    from reshard_job.job.config.spec import SourceSpec, TargetSpec
    from reshard_job.job.stages.prepare import prepare

    target = TargetSpec(strategy=str(renamed_dst(tmp_path)), include="weights", exclude=("head.*",),
                        rename=(("layers.", "blk."),))
    with prepare(SourceSpec(str(SRC), str(SRC_STRATEGY)), target) as prepared:
        plan = prepared.plan.to_json()
        assert plan["selection"] == {"include": "weights", "exclude": ["head.*"], "rename": [["layers.", "blk."]],
                                     "left_out": 37, "renamed": 13, "left_out_first": [
                                         "adam_m.embedding_table", "adam_m.final_ln.beta", "adam_m.final_ln.gamma",
                                         "adam_m.head.weight", "adam_m.layers.0.attention.wk.weight"]}
        assert any(n.startswith("selection: include=weights exclude=['head.*'] rename='layers.'->'blk.'; "
                                "37 parameter(s) left out: 'adam_m.embedding_table'") for n in plan["notes"])
        names = {t[0] for t in plan["tensors"]}
        assert {"blk.0.ffn.w1.weight", "final_ln.beta", "embedding_table"} <= names
        assert not any(n.startswith(("layers.", "head.", "adam_")) for n in names)


def test_a_task_run_elsewhere_reads_renamed_parameters_by_their_source_names(tmp_path, full):
    """A task shipped to another process or machine (a Ray worker) opens the sources itself: it
    carries the renamed parameters' source names."""
    import pickle

    from reshard_job.execute.rank_task import run_rank_task
    from reshard_job.execute.tasks import WriteOptions
    from reshard_job.job.config.spec import SourceSpec, TargetSpec
    from reshard_job.job.stages.convert import rank_tasks
    from reshard_job.job.stages.prepare import prepare

    target = TargetSpec(strategy=str(renamed_dst(tmp_path)), rename=(("layers.", "blk."),))
    with prepare(SourceSpec(str(SRC), str(SRC_STRATEGY)), target) as prepared:
        tasks = rank_tasks(prepared, {r: str(tmp_path / f"r{r}.ckpt") for r in range(4)}, WriteOptions())
    task = pickle.loads(pickle.dumps(tasks[1]))
    assert task.names["blk.0.ffn.w1.weight"] == "layers.0.ffn.w1.weight"
    result = run_rank_task(task)
    assert task.names["adam_v.blk.0.ffn.w1.weight"] == "adam_v.layers.0.ffn.w1.weight"
    assert result.tensors == {blk(n): d for n, d in full[1].tensors.items()}


def test_load_rank_takes_the_same_selection(tmp_path, full, monkeypatch):
    from reshard_job.lineage.database import LEGACY_URL_ENV_VAR, URL_ENV_VAR
    from reshard_job.loading import load_rank

    for name in (URL_ENV_VAR, LEGACY_URL_ENV_VAR):  # not recorded: whatever the user's environment names
        monkeypatch.delenv(name, raising=False)
    arrays = load_rank(2, SRC, SRC_STRATEGY, renamed_dst(tmp_path), include="weights", rename={"layers.": "blk."})
    assert set(arrays) == {blk(n) for n in full[2].tensors if not is_training_state(n)}
    assert "blk.0.ffn.w1.weight" in arrays


def test_an_export_keeps_its_weights_default_and_takes_patterns_and_renames(tmp_path):
    import json

    def exported(out: Path, **selection) -> set[str]:
        api.transform_checkpoints(SRC, out, "", SRC_STRATEGY, None, output_format="safetensors_index", **selection)
        return set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"])

    weights = exported(tmp_path / "default", exclude=["head.*"])
    assert "embedding_table" in weights and not any(is_training_state(n) or n.startswith("head.") for n in weights)
    chosen = exported(tmp_path / "chosen", include=["layers.*", "adam_m.layers.*"], rename={"layers.": "blk."})
    assert "blk.0.ffn.w1.weight" in chosen and "adam_m.blk.0.ffn.w1.weight" in chosen
    assert not any(n.startswith(("layers.", "embedding", "adam_v.")) for n in chosen)
