"""Which file of a rank folder is the source: MindSpore's rule, the latest step, or a glob."""

from __future__ import annotations

import os

import pytest

from reshard_job.errors import ConfigError
from reshard_job.sources.rank_folders import choose, discover


NAMES = ["net-3_1875.ckpt", "net-10_1875.ckpt", "net-9_2000.ckpt", "net-10_200.ckpt", "net_graph.ckpt"]


def test_last_is_mindsporess_lexicographic_rule():
    # MindSpore sorts plain strings: '-9_' sorts after '-10_'
    assert choose(NAMES, "last") == "net_graph.ckpt"
    assert choose(["net-9_100.ckpt", "net-10_100.ckpt"], "last") == "net-9_100.ckpt"


def test_latest_step_parses_epoch_and_step():
    assert choose(NAMES, "latest_step") == "net-10_1875.ckpt"
    assert choose(["a-1_5.ckpt", "a-1_40.ckpt"], "latest_step") == "a-1_40.ckpt"
    # names without <epoch>_<step> lose to any that have one
    assert choose(["z.ckpt", "a-2_1.ckpt"], "latest_step") == "a-2_1.ckpt"


def test_glob_takes_the_last_match():
    assert choose(NAMES, "net-10_*.ckpt") == "net-10_200.ckpt"
    assert choose(NAMES, "nothing-*.ckpt") is None


def _tree(root, files):
    for rel in files:
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"\x0a")
    return root


def test_discover_applies_the_rule_per_rank_and_reports_the_others(tmp_path):
    _tree(tmp_path, ["rank_0/net-9_1.ckpt", "rank_0/net-10_1.ckpt", "rank_1/net-9_1.ckpt", "rank_1/net-10_1.ckpt",
                     "rank_1/.net-11_1.ckpt.1a2b.tmp", "not_a_rank/x.ckpt", "rank_x/y.ckpt"])
    found = discover(tmp_path, "latest_step")
    assert {r: os.path.basename(p) for r, p in found.files.items()} == {0: "net-10_1.ckpt", 1: "net-10_1.ckpt"}
    assert found.ignored == {0: ["net-9_1.ckpt"], 1: ["net-9_1.ckpt"]}
    assert found.format == "ckpt"
    # MindSpore's lexicographic rule on request; the newest step by default
    assert {r: os.path.basename(p) for r, p in discover(tmp_path, "last").files.items()} == \
        {0: "net-9_1.ckpt", 1: "net-9_1.ckpt"}
    assert {r: os.path.basename(p) for r, p in discover(tmp_path).files.items()} == \
        {0: "net-10_1.ckpt", 1: "net-10_1.ckpt"}


def test_ranks_whose_newest_saves_differ_are_refused(tmp_path):
    from reshard_job.errors import PlanError

    _tree(tmp_path, ["rank_0/net-1_9.ckpt", "rank_0/net-1_10.ckpt", "rank_1/net-1_9.ckpt"])
    with pytest.raises(PlanError, match=r"saves of different steps: rank 1 has at most net-1_9.ckpt .* step 10"):
        discover(tmp_path)
    found = discover(tmp_path, "*-1_9.ckpt")  # one step for every rank, chosen by the user
    assert {r: os.path.basename(p) for r, p in found.files.items()} == {0: "net-1_9.ckpt", 1: "net-1_9.ckpt"}


def test_mindformers_rank_names_parse(tmp_path):
    _tree(tmp_path, ["rank_0/llama_rank_0-3_100.ckpt", "rank_0/llama_rank_0-10_50.ckpt",
                     "rank_1/llama_rank_1-3_100.ckpt", "rank_1/llama_rank_1-10_50.ckpt"])
    assert {r: os.path.basename(p) for r, p in discover(tmp_path).files.items()} == \
        {0: "llama_rank_0-10_50.ckpt", 1: "llama_rank_1-10_50.ckpt"}


@pytest.mark.parametrize("files,select,message", [
    ([], "last", "is empty"),
    (["flat.ckpt"], "last", "has no rank_<r>/ directories"),
    (["rank_0/a.ckpt", "rank_1/readme.txt"], "last", "no checkpoint file in rank directory rank_1"),
    (["rank_0/a.ckpt", "rank_0/a.safetensors"], "last", "holds both .ckpt and .safetensors"),
    (["rank_0/a.ckpt", "rank_1/b.safetensors"], "last", "some ranks hold .ckpt files and others .safetensors"),
    (["rank_0/a.ckpt"], "b-*.ckpt", "no checkpoint files matching 'b-*.ckpt'"),
])
def test_discover_errors_name_the_directory(tmp_path, files, select, message):
    root = _tree(tmp_path / "src", files) if files else (tmp_path / "src")
    root.mkdir(exist_ok=True)
    with pytest.raises(ConfigError) as e:
        discover(root, select)
    assert message in str(e.value) and str(root) in str(e.value)
