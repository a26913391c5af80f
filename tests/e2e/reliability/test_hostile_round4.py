"""Hostile inputs of a fourth round, as a user runs them: each ends in one line (exit 2) naming
what is wrong, with the names it prints shown, not obeyed, and nothing left that it must not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from reliability_helpers import app_env, copy_s1, run_app, s1_args, the_error

ESC = "\x1b[2J"


def test_control_characters_in_a_file_name_are_shown_in_the_error_and_the_log(tmp_path):
    """A rank file named with ESC[2J and a newline: the error names it on one line, escaped; so does
    the log line about a second file in a rank folder."""
    ckpts, src, dst = copy_s1(tmp_path / "s1")
    rank3 = ckpts / "rank_3" / "checkpoint_3.ckpt"
    data = rank3.read_bytes()[:100]
    rank3.unlink()
    (ckpts / "rank_3" / f"checkpoint_3\nFAKE: {ESC}.ckpt").write_bytes(data)
    (ckpts / "rank_4" / f"a{ESC}\x07.ckpt").write_bytes((ckpts / "rank_4" / "checkpoint_4.ckpt").read_bytes())
    res = run_app(tmp_path, *s1_args(ckpts, src, dst, tmp_path / "out"), "lineage.enabled=false")
    line = the_error(res)
    assert "checkpoint_3\\x0aFAKE: \\x1b[2J.ckpt: record at offset 0" in line
    assert "\x1b" not in res.stderr and "\x07" not in res.stderr
    assert res.stderr.count("\n") == 1  # refused: its one line alone on the console; the log file has the rest
    log = next((tmp_path / "runs").rglob("reshard_job.log")).read_text()
    assert "ignoring a\\x1b[2J\\x07.ckpt" in log and "\x1b" not in log and "\x07" not in log


def test_an_export_index_that_maps_no_tensor_is_refused(tmp_path):
    (tmp_path / "exp").mkdir()
    (tmp_path / "exp" / "model.safetensors.index.json").write_text('{"metadata": {"total_size": 0}, "weight_map": {}}')
    res = run_app(tmp_path, "source.checkpoints=exp", "target=single", "output.dir=out", "lineage.enabled=false")
    assert "'weight_map' names no tensor" in the_error(res)


def test_a_strategy_padded_with_hundreds_of_megabytes_is_read_once(tmp_path):
    """A protobuf strategy with a 300 MiB field of a newer schema, a JSON one with 300 MiB of
    spaces: converted, each within 512 MiB (a file read whole three times over took 950 MiB)."""
    from reshard_job.formats.strategy import read_strategy, to_json_bytes
    from reshard_job.formats.wire import encode_varint

    ckpts, src, dst = copy_s1(tmp_path / "s1")
    text = to_json_bytes(read_strategy(src))
    cut = text.rindex(b"}")
    padded_files = {  # (head, padding byte, tail): made one at a time, so the test holds 300 MiB of disk, not 600
        tmp_path / "padded.ckpt": (src.read_bytes() + bytes([(15 << 3) | 2]) + encode_varint(300 << 20), b"\0", b""),
        tmp_path / "padded.json": (text[:cut], b" ", text[cut:]),
    }
    for path, (head, pad, tail) in padded_files.items():
        with open(path, "wb") as f:
            f.write(head)
            for _ in range(300):
                f.write(pad * (1 << 20))
            f.write(tail)
        measured = tmp_path / f"{path.name}.rss"
        res = subprocess.run([sys.executable, "-S", str(Path(__file__).parents[3] / "benchmarks" / "measure_child.py"),
                              str(measured), "--", sys.executable, "-m", "reshard_job",
                              *s1_args(ckpts, path, dst, tmp_path / f"out_{path.suffix[1:]}"), "lineage.enabled=false"],
                             cwd=tmp_path, env=app_env(), capture_output=True, text=True, timeout=300)
        path.unlink()
        assert res.returncode == 0, res.stderr
        assert json.loads(measured.read_text())["maxrss_kib"] < 512 * 1024



def test_a_lineage_database_whose_driver_is_not_installed_is_one_line_without_its_password(tmp_path):
    ckpts, src, dst = copy_s1(tmp_path / "s1")
    res = run_app(tmp_path, *s1_args(ckpts, src, dst, tmp_path / "out"), "lineage.url='mysql://bob:Zpw9@127.0.0.1:1/db'",
                  "hydra.run.dir=run")
    line = the_error(res)
    assert "mysql://bob:***@127.0.0.1:1/db: its driver is not installed" in line
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and "Zpw9" in p.read_text(errors="replace")]


def test_a_hundred_thousand_character_path_is_refused_at_once(tmp_path):
    """Masking credentials in a long value rescanned it from every position (minutes)."""
    ckpts, src, dst = copy_s1(tmp_path / "s1")
    res = run_app(tmp_path, *s1_args(ckpts, src, dst, tmp_path / ("a" * 100_000)), "lineage.enabled=false",
                  timeout=60)
    assert "File name too long" in the_error(res)


def test_an_output_folder_named_with_escapes_is_named_not_obeyed_on_stdout_and_stderr(tmp_path):
    ckpts, src, dst = copy_s1(tmp_path / "s1")
    out = tmp_path / f"af{ESC}ile"
    for _ in range(2):  # the conversion, then the rerun that has nothing to do
        args = [*s1_args(ckpts, src, dst, out)[:-1], f"output.dir='{out}'", "lineage.enabled=false"]
        res = run_app(tmp_path, *args)
        assert res.returncode == 0, res.stderr
        assert "\x1b" not in res.stdout + res.stderr
        assert "af\\x1b[2Jile" in res.stdout + res.stderr


def test_sqlite_url_arguments_the_driver_would_ignore_are_refused_not_warned_about(tmp_path):
    """``?mode=ro`` was ignored with two lines of SQLAlchemy's warning, and the database written."""
    ckpts, src, dst = copy_s1(tmp_path / "s1")
    res = run_app(tmp_path, *s1_args(ckpts, src, dst, tmp_path / "out"), f"lineage.url='sqlite:///{tmp_path}/x.db?mode=ro'")
    assert "'mode' are not accepted" in the_error(res)
    assert not (tmp_path / "x.db").exists()


def test_rank_folders_are_ascii_numbers_of_any_length(tmp_path):
    """rank_999999999999 is refused as lying beyond the strategy's ranks, as rank_8 is (it was
    ignored); rank_\u0661 (an Arabic-Indic one) is no rank folder (it was taken for rank 1)."""
    import shutil

    ckpts, src, dst = copy_s1(tmp_path / "s1")
    shutil.copytree(ckpts / "rank_0", ckpts / "rank_999999999999")
    res = run_app(tmp_path, *s1_args(ckpts, src, dst, tmp_path / "out"), "lineage.enabled=false")
    assert "rank folders rank_999999999999 lie beyond the 8 rank(s)" in the_error(res)
    shutil.rmtree(ckpts / "rank_999999999999")
    (ckpts / "rank_1").rename(ckpts / "rank_\u0661")
    res = run_app(tmp_path, *s1_args(ckpts, src, dst, tmp_path / "out"), "lineage.enabled=false")
    assert "missing source checkpoint" in the_error(res) and "rank 1 " in the_error(res)


def test_a_mindformers_save_whose_files_are_a_fifo_or_a_device_says_so(tmp_path):
    """A FIFO metadata.json, a shard linked to /dev/zero: refused as what they are (they were "not found")."""
    import os
    import shutil

    m1a = Path(__file__).parents[2] / "golden" / "M1a_mf_llama_dp2mp2os_bf16_to_mp4" / "src_mindformers"
    for case in ("fifo", "device"):
        save = tmp_path / case
        shutil.copytree(m1a, save)
        folder = next(save.glob("iteration_*"))
        target = folder / "metadata.json" if case == "fifo" else sorted(folder.glob("*-model-*.safetensors"))[0]
        target.unlink()
        os.mkfifo(target) if case == "fifo" else target.symlink_to("/dev/zero")
        res = run_app(tmp_path, f"source.checkpoints={save}", "target.devices=1", f"output.dir={tmp_path / case}_out",
                      "lineage.enabled=false", timeout=60)
        assert the_error(res).startswith(f"{target}: is not a regular file (a FIFO or a device")
