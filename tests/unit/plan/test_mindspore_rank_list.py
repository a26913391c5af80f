"""``rank_list_for_transform(..., minimal=False)``: MindSpore 2.10's own list, which its
``transform_checkpoint_by_rank`` requires in full, next to ours (``minimal=True``, the default),
which is a subset of it.

The expected lists are MindSpore's "required" columns of spec/resharding-semantics.md §10 (each
checked there against MindSpore 2.10), §6.3's example, and, where marked, derived by hand from the
§7 algorithm (also checked there against MindSpore in ~6 200 queries). The golden scenarios'
lists, recorded from MindSpore itself, are compared in tests/e2e/golden/test_golden_scenarios.py.
"""

from __future__ import annotations

import pytest

from reshard_job import rank_list_for_convert, rank_list_for_transform
from reshard_job.core.strategy_model import ParamLayout, StrategyFile, StrategyItem
from reshard_job.errors import PlanError
from reshard_job.formats.strategy import write_strategy


def strategy(path, layouts: dict, stages=(0,)) -> str:
    write_strategy(StrategyFile(layouts, [StrategyItem(f"op{s}", s, ()) for s in stages]), path)
    return str(path)


def both(rank, src, dst):
    ours = rank_list_for_transform(rank, src, dst)
    theirs = rank_list_for_transform(rank, src, dst, minimal=False)
    assert set(ours) <= set(theirs), (rank, ours, theirs)
    assert theirs == sorted(theirs, reverse=True) and all(type(r) is int for r in theirs)
    return ours, theirs


@pytest.mark.parametrize("opt", [False, True])
def test_spec_10_1(tmp_path, opt):
    """[784, 512], dev [2,4] map [1,-1] (8 ranks) -> dev [4] map [-1,0]: MindSpore requires
    [t+4, t]; with optimizer sharding (size -1, step 1) every rank."""
    step, size = (1, -1) if opt else (0, 0)
    src = strategy(tmp_path / "src.ckpt", {"w": ParamLayout((2, 4), (1, -1), step, size)})
    dst = strategy(tmp_path / "dst.ckpt", {"w": ParamLayout((4,), (-1, 0))})
    for t in range(4):
        ours, theirs = both(t, src, dst)
        assert theirs == ([7, 6, 5, 4, 3, 2, 1, 0] if opt else [t + 4, t])
        assert ours == theirs  # here MindSpore reads every rank it requires


@pytest.mark.parametrize("opt_size", [-1, 2])
def test_spec_10_2_tutorial(tmp_path, opt_size):
    src = strategy(tmp_path / "src.ckpt", {"layer1.weight": ParamLayout((2, 1, 2, 2), (2, 1))})
    dst = strategy(tmp_path / "dst.ckpt", {"layer1.weight": ParamLayout((2, 2, 1), (1, 0), 2, opt_size)})
    assert [both(t, src, dst)[1] for t in range(4)] == [[2, 0], [3, 1], [2, 0], [3, 1]]


def test_spec_10_3_pipeline_to_flat(tmp_path):
    src = strategy(tmp_path / "src.ckpt", {"0-layer1.weight": ParamLayout((2, 2), (-1, 0), 2, -1),
                                           "1-layer2.weight": ParamLayout((2, 2), (0, -1), 2, -1)}, stages=(0, 1))
    dst = strategy(tmp_path / "dst.ckpt", {"layer1.weight": ParamLayout((4,), (0, -1)),
                                           "layer2.weight": ParamLayout((4,), (-1, 0))})
    for t in range(4):
        assert both(t, src, dst)[1] == [7, 6, 5, 4, 3, 2, 1, 0]


def test_whole_groups_are_gathered_spec_6_3(tmp_path):
    """dev [8] map [0,-1] -> dev [2] map [0,-1]: each target rank reads 4 ranks, MindSpore requires all 8."""
    src = strategy(tmp_path / "src.ckpt", {"w": ParamLayout((8,), (0, -1))})
    dst = strategy(tmp_path / "dst.ckpt", {"w": ParamLayout((2,), (0, -1))})
    for t in range(2):
        ours, theirs = both(t, src, dst)
        assert theirs == [7, 6, 5, 4, 3, 2, 1, 0]
        # the 4 holding its rows, and rank t, that parameters outside the strategies are copied from
        assert ours == sorted({4 * t + 3, 4 * t + 2, 4 * t + 1, 4 * t, t}, reverse=True)


def test_device_matrices_without_a_common_refinement(tmp_path):
    """dev [2,3] map [1,-1] -> dev [3,2] map [1,-1]: the cut points {1,3,6} and {1,2,6} make no
    divisibility chain, so MindSpore keeps only the source's unused axis (size 3) and gathers the
    rest (§7.3.2): target rank t requires {t mod 3, t mod 3 + 3} (derived from §7)."""
    src = strategy(tmp_path / "src.ckpt", {"w": ParamLayout((2, 3), (1, -1))})
    dst = strategy(tmp_path / "dst.ckpt", {"w": ParamLayout((3, 2), (1, -1))})
    for t in range(6):
        assert both(t, src, dst)[1] == [t % 3 + 3, t % 3]


def test_no_target_strategy_takes_rank_id_as_the_local_rank(tmp_path):
    """Without a target strategy MindSpore uses rank_id itself as the local rank (§7.2): for the
    10.1 source, rank 1 requires the replicas on unused position 1 equal to 1, i.e. [5, 1]
    (derived from §7); rank 0 requires [4, 0]."""
    src = strategy(tmp_path / "src.ckpt", {"w": ParamLayout((2, 4), (1, -1))})
    assert both(0, src, None)[1] == [4, 0]
    assert both(1, src, None)[1] == [5, 1]
    assert rank_list_for_transform(3, None, None, minimal=False) == [0]


def test_multi_axis_dimensions(tmp_path):
    """A dimension split over two axes: MindSpore keeps the ranks that agree on the axes both sides
    step alike. dev [2,2,2], map [[2,1],-1] -> dev [2,2,2] map [-1,[2,1]]: every source axis used is gathered,
    the unused innermost one kept: rank t requires the 4 ranks with t's last digit (from §7)."""
    src = strategy(tmp_path / "src.ckpt", {"w": ParamLayout((2, 2, 2), ((2, 1), -1))})
    dst = strategy(tmp_path / "dst.ckpt", {"w": ParamLayout((2, 2, 2), (-1, (2, 1)))})
    for t in range(8):
        assert both(t, src, dst)[1] == sorted((q for q in range(8) if q % 2 == t % 2), reverse=True)


def test_optimizer_sharding_on_an_inner_replicated_axis(tmp_path):
    """dev [2,2,2] map [2,-1], optimizer shard 2 (two replicated positions: MindSpore's general
    rule, which takes the innermost) -> 8 replicas: a target rank needs one optimizer chunk, the
    ranks sharing its middle digit (from §7; the same as what it reads)."""
    src = strategy(tmp_path / "src.ckpt", {"w": ParamLayout((2, 2, 2), (2, -1), 1, 2)})
    dst = strategy(tmp_path / "dst.ckpt", {"w": ParamLayout((8,), (-1, -1))})
    for t in range(8):
        ours, theirs = both(t, src, dst)
        assert theirs == sorted((q for q in range(8) if q // 2 % 2 == t // 2 % 2), reverse=True)
        assert ours == theirs


def test_alias_and_keyword_only(tmp_path):
    src = strategy(tmp_path / "src.ckpt", {"w": ParamLayout((8,), (0, -1))})
    dst = strategy(tmp_path / "dst.ckpt", {"w": ParamLayout((2,), (0, -1))})
    assert rank_list_for_convert(1, src, dst, minimal=False) == rank_list_for_transform(1, src, dst, minimal=False)
    with pytest.raises(TypeError):
        rank_list_for_transform(0, src, dst, "omit")  # MindSpore's three positional arguments only


def test_optimizer_sharding_without_a_replicated_axis_is_refused_in_one_line(tmp_path):
    src = strategy(tmp_path / "src.ckpt", {"w": ParamLayout((2, 2), (1, 0), 1, 2)})
    dst = strategy(tmp_path / "dst.ckpt", {"w": ParamLayout((4,), (0, -1))})
    with pytest.raises(PlanError, match=r"parameter 'w': .*optimizer") as ei:
        rank_list_for_transform(0, src, dst, minimal=False)
    assert "\n" not in str(ei.value)


def test_mindspores_list_costs_its_length(tmp_path):
    """65,536 source ranks gathered for one target rank, and 300 parameters sharing the split:
    built once (well within a second)."""
    layouts = {f"w{i}": ParamLayout((256, 256), (1, 0)) for i in range(300)}
    src = strategy(tmp_path / "src.ckpt", layouts)
    ranks = rank_list_for_transform(0, src, None, minimal=False)
    assert len(ranks) == 65536 and ranks[0] == 65535
