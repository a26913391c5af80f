"""The entry point over a stubbed job: what it prints, writes and exits with, decided without converting."""

from __future__ import annotations

import json
import sys

import pytest

import reshard_job.__main__ as entry
import reshard_job.job.runner as runner
from reshard_job.errors import ConfigError
from reshard_job.job.runner import JobResult
from reshard_job.job.run.signals import Interrupted


def _main(monkeypatch, tmp_path, *args):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["reshard_job", *args])
    with pytest.raises(SystemExit) as done:
        entry.main()
        raise SystemExit(0)
    return done.value.code or 0


def _stub(monkeypatch, outcome):
    seen = {}

    def fake(spec, emit=print):
        seen["spec"] = spec
        if isinstance(outcome, BaseException):
            outcome.run_id = "run-1"
            raise outcome
        return outcome

    monkeypatch.setattr(runner, "run_job", fake)
    return seen


def test_success_prints_the_summary_and_writes_result_json(monkeypatch, tmp_path, capsys):
    seen = _stub(monkeypatch, JobResult("completed", str(tmp_path / "o"), "run-1", "ab" * 32, 4))
    assert _main(monkeypatch, tmp_path, "hydra.run.dir=run", "target.devices=2") == 0
    out = capsys.readouterr().out
    assert f"completed: outputs in {tmp_path / 'o'}" in out and f"(file sha256 {'ab' * 32})" in out
    assert seen["spec"].target.devices == 2
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["status"] == "completed" and result["run_id"] == "run-1"


def test_the_summary_keeps_one_line_per_item_whatever_the_output_folder_is_named(monkeypatch, tmp_path, capsys):
    """A newline in output.dir is shown as \\x0a: the summary's first line names the whole folder."""
    _stub(monkeypatch, JobResult("completed", str(tmp_path / "o\nut"), None, "ab" * 32, 4))
    assert _main(monkeypatch, tmp_path, "hydra.run.dir=run") == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == f"completed: outputs in {tmp_path}/o\\x0aut"
    assert lines[1].startswith(f"  manifest: {tmp_path}/o\\x0aut/manifest.json")


def test_a_job_error_is_one_line_exit_2_and_result_json_keeps_the_run_id(monkeypatch, tmp_path, capsys):
    _stub(monkeypatch, ConfigError("something is wrong with postgresql://u:pw@h/db"))
    assert _main(monkeypatch, tmp_path, "hydra.run.dir=run") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "reshard_job: error: something is wrong with postgresql://u:***@h/db"
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["status"] == "failed" and result["run_id"] == "run-1" and "pw" not in json.dumps(result)
    assert "something is wrong" in (tmp_path / "run" / "reshard_job.log").read_text()


@pytest.mark.parametrize("signum,code", [(2, 130), (15, 143)])
def test_an_interrupt_is_one_line_and_the_signal_exit_status(monkeypatch, tmp_path, capsys, signum, code):
    _stub(monkeypatch, Interrupted(signum))
    assert _main(monkeypatch, tmp_path, "hydra.run.dir=run") == code
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("rerun the same command to resume")
    assert json.loads((tmp_path / "run" / "result.json").read_text())["status"] == "interrupted"


def test_configuration_errors_exit_2_with_a_hint(monkeypatch, tmp_path, capsys):
    _stub(monkeypatch, JobResult("completed"))
    assert _main(monkeypatch, tmp_path, "job.ranks=0,1") == 2
    assert "for a list write job.ranks=[0,1]" in capsys.readouterr().err
    assert _main(monkeypatch, tmp_path, "no_such_group=x") == 2


def test_version(monkeypatch, tmp_path, capsys):
    from reshard_job import __version__

    assert _main(monkeypatch, tmp_path, "--version") == 0
    assert capsys.readouterr().out.strip() == f"reshard_job {__version__}"
