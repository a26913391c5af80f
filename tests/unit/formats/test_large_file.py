"""A checkpoint over 2 GiB is indexed and a box read from it with bounded memory (slow: writes 3 GiB)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[3] / "benchmarks"))


@pytest.mark.slow
def test_3_gib_checkpoint_indexed_and_a_box_read_under_300_mib(tmp_path):
    import index_large

    path = tmp_path / "big.ckpt"
    rows = index_large.write_big(str(path), 3.0)
    result = index_large.measure(str(path), rows)
    print(result)
    assert result["file_bytes"] > 3 * (1 << 30)
    assert result["records_of_big_tensor"] == 6  # 512 MiB records, as MindSpore writes them
    assert result["peak_rss_mib"] < 300
