"""The Python API refuses what the job refuses, before anything is written: no output over a source
file or into a source folder (whatever the paths say), none outside the destination, no merged
strategy into the folder it merges, and load_rank never reads a folder with ranks beyond its strategy."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

import reshard_job as rj
from reshard_job.errors import ConfigError, OutputError, PlanError, StrategyFormatError

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
S1 = GOLDEN / "S1_mlp_tutorial_8to4"


def digests(root: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def s1(tmp_path) -> Path:
    shutil.copytree(S1, tmp_path / "s1")
    return tmp_path / "s1"


def test_transform_checkpoints_never_writes_over_or_among_its_sources(s1, tmp_path):
    before = digests(s1)
    src, ss, ds = s1 / "src_checkpoints", s1 / "src_strategy.ckpt", s1 / "dst_strategy.ckpt"
    with pytest.raises(OutputError, match="dst_checkpoints_dir .* is inside the source directory"):
        rj.transform_checkpoints(src, src, "checkpoint_", ss, ds)
    (tmp_path / "view").symlink_to(src)  # the same folder under another path
    with pytest.raises(OutputError, match="inside the source directory"):
        rj.transform_checkpoints(src, tmp_path / "view", "checkpoint_", ss, ds)
    with pytest.raises(OutputError, match="would replace the source file"):
        rj.transform_checkpoint_by_rank(0, {r: src / f"rank_{r}" / f"checkpoint_{r}.ckpt" for r in range(8)},
                                        src / "rank_0" / "checkpoint_0.ckpt", ss, ds)
    assert digests(s1) == before


def test_a_prefix_is_the_start_of_a_file_name_and_counts_are_positive(s1, tmp_path):
    src, ss, ds = s1 / "src_checkpoints", s1 / "src_strategy.ckpt", s1 / "dst_strategy.ckpt"
    for prefix in ("../../evil_", "a/b", ".."):
        with pytest.raises(ConfigError, match="ckpt_prefix must be the start of a file name"):
            rj.transform_checkpoints(src, tmp_path / "out", prefix, ss, ds)
    for bad in (0, -4, 2.5, "two"):
        with pytest.raises(ConfigError, match="process_num must be a positive integer"):
            rj.transform_checkpoints(src, tmp_path / "out", "c_", ss, ds, bad)
    with pytest.raises(ConfigError, match="max_memory must be a positive integer"):
        rj.transform_checkpoints(src, tmp_path / "out", "c_", ss, ds, max_memory=0)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("evil*"))


def test_flags_are_true_or_false_a_string_such_as_no_is_refused_not_taken_as_true(s1, tmp_path):
    src, ss, ds = s1 / "src_checkpoints", s1 / "src_strategy.ckpt", s1 / "dst_strategy.ckpt"
    for bad in ("no", "false", None, 2, [False]):
        with pytest.raises(ConfigError, match="verify_replicas must be True or False"):
            rj.transform_checkpoints(src, tmp_path / "out", "c_", ss, ds, verify_replicas=bad)
        with pytest.raises(ConfigError, match="minimal must be True or False"):
            rj.rank_list_for_transform(0, ss, ds, minimal=bad)
    assert not (tmp_path / "out").exists()
    assert rj.rank_list_for_transform(0, ss, ds, minimal=0) == rj.rank_list_for_transform(0, ss, ds, minimal=False)


def test_a_merged_strategy_is_not_written_into_the_folder_it_merges(tmp_path):
    folder = tmp_path / "stages"
    shutil.copytree(GOLDEN / "S3_pipeline2x4opt_to_4" / "src_strategy_dir", folder)
    before = digests(folder)
    first = sorted(folder.iterdir())[0]
    for dst in (first, folder / "merged.ckpt"):
        with pytest.raises(StrategyFormatError, match="lies in the pipeline strategy directory it merges"):
            rj.merge_pipeline_strategies(folder, dst)
    assert digests(folder) == before


def test_load_rank_refuses_rank_folders_beyond_its_strategy_as_the_job_does(s1):
    """With the 4-rank strategy for an 8-rank folder, the first ranks' shapes fit it: the tensors
    came back wrong (3136 rows for 784) without a word."""
    src = s1 / "src_checkpoints"
    for target in (None, s1 / "src_strategy.ckpt"):
        with pytest.raises(PlanError, match="rank folders rank_4, rank_5, rank_6, rank_7 lie beyond the 4 rank"):
            rj.load_rank(0, src, s1 / "dst_strategy.ckpt", target)
        with pytest.raises(PlanError, match="lie beyond"):
            list(rj.iter_rank(0, src, s1 / "dst_strategy.ckpt", target))
    assert rj.load_rank(0, src, s1 / "src_strategy.ckpt", None)["layer1.weight"].shape == (784, 32)


def test_load_rank_with_a_lineage_url_that_is_no_database_url_is_one_lineage_error(s1):
    from reshard_job.lineage.errors import LineageError

    args = (1, s1 / "src_checkpoints", s1 / "src_strategy.ckpt", s1 / "dst_strategy.ckpt")
    with pytest.raises(LineageError, match="is not a database URL"):
        rj.load_rank(*args, lineage_url="notaurl")
    with pytest.raises(LineageError, match="no database of that kind is known"):
        rj.load_rank(*args, lineage_url="notaurl://x")


def test_an_unreachable_lineage_database_is_one_lineage_error_naming_it_without_its_password(s1):
    pytest.importorskip("psycopg")  # the postgres extra's driver: with it, nothing listens on port 1
    from reshard_job.lineage.errors import LineageError

    url = "postgresql+psycopg://bob:s3cret@127.0.0.1:1/lineage"
    for call in (lambda: rj.load_rank(1, s1 / "src_checkpoints", s1 / "src_strategy.ckpt", s1 / "dst_strategy.ckpt",
                                      lineage_url=url),
                 lambda: rj.record_use("trainer", [s1 / "src_strategy.ckpt"], lineage_url=url)):
        with pytest.raises(LineageError, match=r"cannot record in the lineage database "
                                               r"postgresql\+psycopg://bob:\*\*\*@127\.0\.0\.1:1/lineage: "
                                               r".*(refused|failed)") as got:
            call()
        assert "s3cret" not in str(got.value) and "\n" not in str(got.value)


@pytest.mark.parametrize("args,kwargs,needle", [
    ((1, 5), {}, "src_checkpoints must be a path"),
    ((1, ["ckpts"]), {}, "src_checkpoints must be a path"),
    ((1, b"ckpts"), {}, "src_checkpoints must be a path"),
    ((1, "ckpts", 7), {}, "src_strategy_file must be a path"),
    ((1, "ckpts"), {"storage_options": 5}, "storage_options must be a dict"),
    ((1, "ckpts"), {"consumer": 5}, "consumer must be a name"),
])
def test_load_rank_arguments_of_the_wrong_kind_are_one_config_error(args, kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        rj.load_rank(*args, **kwargs)


def test_the_api_does_not_write_into_an_output_dir_a_job_is_writing(s1, tmp_path):
    """A job holds the output.dir's lock: transform_checkpoints (and transform_checkpoint_by_rank)
    into it are refused, as a second job is; it wrote its files there, and the job then committed a
    manifest and a lineage record of bytes that were no longer on disk."""
    from reshard_job.storage import storage_for

    src, ss, ds = s1 / "src_checkpoints", s1 / "src_strategy.ckpt", s1 / "dst_strategy.ckpt"
    out = tmp_path / "out"
    out.mkdir()
    lock = storage_for(str(out)).lock(str(out), "pid 4242 on elsewhere")
    try:
        with pytest.raises(OutputError, match=r"out is being written by another job \(pid 4242 on elsewhere\)"):
            rj.transform_checkpoints(src, out, "checkpoint_", ss, ds)
        with pytest.raises(OutputError, match="being written by another job"):
            rj.transform_checkpoint_by_rank(0, {r: src / f"rank_{r}" / f"checkpoint_{r}.ckpt" for r in range(8)},
                                            out / "checkpoint_0.ckpt", ss, ds)
    finally:
        lock.release()
    assert [p.name for p in out.iterdir()] == [".reshard_job"]  # the lock's folder: nothing written
    rj.transform_checkpoints(src, out, "checkpoint_", ss, ds)  # once free


def test_a_job_refuses_to_commit_over_an_output_file_replaced_since_it_wrote_it(tmp_path):
    from reshard_job.job.output.directory import OutputDir
    from reshard_job.job.stages.convert import _check_unchanged_since_written
    from reshard_job.storage import storage_for

    (tmp_path / "rank_0").mkdir()
    path = tmp_path / "rank_0" / "checkpoint_0.ckpt"
    path.write_bytes(b"written by the job")
    out = OutputDir(str(tmp_path), storage_for(str(tmp_path)))
    written = {0: {"path": str(path), "size": 18, "identity": tuple(out.storage.info(str(path)).identity)}}
    _check_unchanged_since_written(out, written)  # as written: fine
    replacement = tmp_path / "other"
    replacement.write_bytes(b"written by someone")  # same size, another file renamed over it
    replacement.replace(path)
    with pytest.raises(OutputError, match="checkpoint_0.ckpt: replaced or changed since this job wrote it"):
        _check_unchanged_since_written(out, written)
