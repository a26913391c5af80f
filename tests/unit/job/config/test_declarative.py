"""Declarative target layouts (``job.config.declarative.compile_layout``): a named mesh and
per-parameter rules compiled into the layouts a MindSpore strategy file records.

Tensor maps count mesh axes from the innermost: with mesh ``{dp: 2, mp: 2}``, ``mp`` is 0 and
``dp`` is 1, and -1 means "not split".
"""

from __future__ import annotations

import pytest

from reshard_job.errors import ConfigError, LayoutError
from reshard_job.job.config.declarative import NODE_NAME, compile_layout

MESH = {"dp": 2, "mp": 2}
PARAMS = {"layer1.weight": (8, 4), "layer2.weight": (4, 8), "layer1.bias": (4,), "global_step": (1,)}


def _layout(*rules, **settings) -> dict:
    return {"mesh": dict(MESH), "rules": list(rules), **settings}


def test_the_first_rule_that_matches_the_whole_name_wins():
    compiled = compile_layout(_layout({"match": r"layer1\.weight", "dims": ["mp", None]},
                                      {"match": r".*\.weight", "dims": [None, "mp"]},
                                      {"match": r"layer\d\.bias", "dims": []},
                                      {"match": r"layer", "dims": []}),  # a prefix: never a whole name
                              4, PARAMS)
    layouts = compiled.strategy.layouts
    assert compiled.rule_of == {"layer1.weight": 0, "layer2.weight": 1, "layer1.bias": 2}
    assert layouts["layer1.weight"].tensor_map == (0, -1) and layouts["layer2.weight"].tensor_map == (-1, 0)
    assert layouts["layer1.bias"].tensor_map == (-1,)  # dims: [] is replicated whatever the rank
    assert {layout.dev_matrix for layout in layouts.values()} == {(2, 2)}  # the first axis varies slowest
    assert "global_step" not in layouts  # no rule: left out of the strategy
    assert compiled.notes == ["target.layout.rules[3] (match 'layer') matches no parameter of this checkpoint"]
    assert [item.node_name for item in compiled.strategy.items] == [NODE_NAME]


def test_a_dimension_split_over_several_axes_lists_them_slowest_first():
    compiled = compile_layout(_layout({"match": ".*", "dims": [["dp", "mp"], None]}), 4, {"w": (8, 4)})
    # one nested entry makes the whole map nested, as MindSpore records it
    assert compiled.strategy.layouts["w"].tensor_map == ((1, 0), (-1,))
    assert compiled.strategy.layouts["w"].nested


def test_optimizer_state_follows_its_parameter_unless_a_rule_names_it():
    params = {"layer1.weight": (8, 4), "adam_m.layer1.weight": (8, 4), "adam_v.layer1.weight": (8, 4)}
    compiled = compile_layout(_layout({"match": r"layer1\.weight", "dims": ["mp", None]},
                                      {"match": r"adam_v\..*", "dims": []},
                                      optimizer_prefixes=["adam_m.", "adam_v."]), 4, params)
    layouts = compiled.strategy.layouts
    assert layouts["adam_m.layer1.weight"] == layouts["layer1.weight"]
    assert compiled.rule_of["adam_m.layer1.weight"] == 0
    assert compiled.rule_of["adam_v.layer1.weight"] == 1 and layouts["adam_v.layer1.weight"].tensor_map == (-1, -1)


def test_without_its_prefix_declared_optimizer_state_is_just_another_name():
    compiled = compile_layout(_layout({"match": r"layer1\.weight", "dims": ["mp", None]}), 4,
                              {"layer1.weight": (8, 4), "adam_m.layer1.weight": (8, 4)})
    assert "adam_m.layer1.weight" not in compiled.strategy.layouts


def test_optimizer_shard_uses_the_axes_a_parameter_does_not():
    compiled = compile_layout(_layout({"match": r".*\.weight", "dims": [None, "mp"]}, {"match": ".*", "dims": []},
                                      optimizer_shard="dp"), 4, {"w.weight": (8, 4), "bias": (8,), "odd": (3,)})
    layouts = compiled.strategy.layouts
    assert (layouts["w.weight"].opt_shard_step, layouts["w.weight"].opt_shard_size) == (2, 2)  # over dp
    assert (layouts["bias"].opt_shard_step, layouts["bias"].opt_shard_size) == (1, 4)  # over dp x mp
    assert (layouts["odd"].opt_shard_step, layouts["odd"].opt_shard_size) == (0, 0)
    assert any(note.startswith("odd: dimension 0 (3) does not divide into 4 parts") for note in compiled.notes)


@pytest.mark.parametrize("rule,params,error,message", [
    ({"match": r"layer1\.weight", "dims": ["mp"]}, {"layer1.weight": (8, 4)}, LayoutError,
     r"parameter 'layer1\.weight' has 2 dimension\(s\) \[8, 4\] but target\.layout\.rules\[0\] "
     r"\(match 'layer1\\\\\.weight'\) gives 1 dims entries"),
    ({"match": "w", "dims": [None, ["dp", "mp"]]}, {"w": (8, 6)}, LayoutError,
     r"parameter 'w': dimension 1 of size 6 is not divisible by dp x mp = 4 \(target\.layout\.rules\[0\], match 'w'\)"),
    ({"match": "w", "dims": ["tp"]}, {"w": (8,)}, ConfigError,
     r"target\.layout\.rules\[0\]: unknown axis 'tp' \(mesh axes: dp, mp\)"),
    ({"match": "w", "dims": ["mp", "mp"]}, {"w": (8, 8)}, ConfigError,
     r"target\.layout\.rules\[0\]: axis 'mp' splits more than one dimension"),
    ({"match": "w[", "dims": []}, {"w": (8,)}, ConfigError,
     r"target\.layout\.rules\[0\]: match 'w\[' is not a valid regular expression"),
    ({"dims": []}, {"w": (8,)}, ConfigError, r"target\.layout\.rules\[0\]: needs a 'match' regular expression"),
    ({"match": "w", "dims": "mp"}, {"w": (8,)}, ConfigError, r"target\.layout\.rules\[0\]: dims must be a list"),
    ({"match": "v", "dims": []}, {"w": (8,)}, ConfigError, r"target\.layout\.rules match none of the checkpoint's"),
])
def test_errors_name_the_rule_and_the_parameter(rule, params, error, message):
    with pytest.raises(error, match=message):
        compile_layout(_layout(rule), 4, params)


@pytest.mark.parametrize("settings,devices,message", [
    ({"mesh": {"dp": 2, "mp": 2}}, 8, r"target\.layout\.mesh dp=2 x mp=2 has 4 devices but target\.devices is 8"),
    ({"mesh": {}}, 4, r"target\.layout\.mesh is empty"),
    ({"mesh": {"dp": 0}}, 4, r"target\.layout\.mesh\.dp: size must be a positive integer, got 0"),
    ({"mesh": {"dp": 4}, "optimizer_shard": "zp"}, 4, r"target\.layout\.optimizer_shard: unknown axis 'zp'"),
])
def test_a_mesh_that_does_not_fit_is_refused(settings, devices, message):
    with pytest.raises(ConfigError, match=message):
        compile_layout({"rules": [{"match": ".*", "dims": []}], **settings}, devices, {"w": (8,)})


RULE_SETS = [
    [r"layer1\.weight", r".*\.weight", r"layer\d\.bias", r"layer"],
    [r"a", r"ab", r"a.*b|c", r"(?:x|y)+", r".*"],  # a later rule that matches where an earlier one stops short
    [r"(a)(b)\2?", r"ab", r".*b"],  # capturing groups (a back reference): tried rule by rule
    [r"(?i)AB", r"ab", r"[a-z]+"],  # inline flags: tried rule by rule
    [r"adam_m\..*", r"layer\d\.weight", r"adam_v\.layer1\.weight"],
]
NAMES = ["layer1.weight", "layer2.weight", "layer1.bias", "layer", "a", "ab", "abb", "acb", "c", "xyx", "AB", "Ab",
         "zz", "", "adam_m.layer1.weight", "adam_v.layer1.weight", "adam_v.layer2.weight", "x.weight\n"]


@pytest.mark.parametrize("rules", RULE_SETS)
def test_many_names_find_the_rule_each_would_find_rule_by_rule(rules):
    """The rules are found for many names at once through one pattern of them all where their
    patterns capture nothing, else rule by rule: either way the first rule that matches."""
    from reshard_job.job.config.declarative import _parse_rules, _rule_for, _RuleFinder

    parsed = _parse_rules([{"match": r, "dims": []} for r in rules], MESH)
    for prefixes in ((), ("adam_m.", "adam_v.")):
        find = _RuleFinder(parsed, prefixes)
        assert (find._all is not None) == all("(" not in r or "(?:" in r for r in rules)
        for name in NAMES:
            assert find(name) is _rule_for(name, parsed, prefixes), (rules, name)


def test_parameters_of_one_shape_and_rule_get_one_tensor_map_and_keep_their_own_notes():
    params = {f"e.{i}.w": (6, 4) for i in range(5)} | {f"e.{i}.b": (3,) for i in range(3)}
    compiled = compile_layout(_layout({"match": r".*\.w", "dims": [None, "mp"]}, {"match": r".*", "dims": []},
                                      optimizer_shard="dp"), 4, params)
    layouts = compiled.strategy.layouts
    assert all(layouts[f"e.{i}.w"].tensor_map == (-1, 0) for i in range(5))
    assert all(layouts[f"e.{i}.b"].tensor_map == (-1,) for i in range(3))
    assert [n for n in compiled.notes if "does not divide" in n] == \
        [f"e.{i}.b: dimension 0 (3) does not divide into 4 parts; no optimizer sharding for it" for i in range(3)]
