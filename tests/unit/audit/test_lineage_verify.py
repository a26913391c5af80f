"""Is the file on disk still the one we produced? Re-hash against the record."""

from __future__ import annotations

import os

import pytest

from reshard_job.lineage import LineageError
from reshard_job.audit.verify import verify


class queries:  # noqa: N801 - the JSON answers, as ``audit verify --json`` prints them
    @staticmethod
    def verify(session, ref, **options):
        return verify(session, ref, **options).to_json()


def _flip_one_byte(path: str, offset: int = 10) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def test_intact_outputs_pass(store, two_hop):
    with store.read_session() as session:
        report = queries.verify(session, two_hop.run_a)
    assert report["intact"] and report["checked"] == 6 and report["ok"] == 6
    assert {f["path"] for f in report["files"]} == {f.path for f in two_hop.outputs_a}


def test_one_flipped_byte_is_reported_by_name(store, two_hop):
    changed = two_hop.outputs_a[2]
    _flip_one_byte(changed.path)
    with store.read_session() as session:
        report = queries.verify(session, two_hop.run_a[:8])  # a unique prefix is enough
    assert not report["intact"] and report["changed"] == 1 and report["ok"] == 5
    bad = [f for f in report["files"] if f["state"] != "ok"]
    assert [(f["path"], f["state"]) for f in bad] == [(changed.path, "changed")]
    assert bad[0]["expected_sha256"] == changed.sha256 and bad[0]["actual_sha256"] != changed.sha256


def test_a_missing_file_is_reported_by_name(store, two_hop):
    manifest = two_hop.outputs_b[-1]
    os.remove(manifest.path)
    with store.read_session() as session:
        report = queries.verify(session, two_hop.run_b)
    assert not report["intact"] and report["missing"] == 1
    assert [f["path"] for f in report["files"] if f["state"] == "missing"] == [manifest.path]


def test_verify_a_path_against_what_was_recorded_there(store, two_hop):
    with store.read_session() as session:
        assert queries.verify(session, two_hop.final.path)["intact"]
        _flip_one_byte(two_hop.final.path, offset=0)
        report = queries.verify(session, two_hop.final.path)
        assert not report["intact"] and report["files"][0]["run_ids"] == [two_hop.run_b]
        os.remove(two_hop.final.path)
        assert queries.verify(session, two_hop.final.path)["missing"] == 1


def test_inputs_are_checked_on_request(store, two_hop):
    os.remove(two_hop.sources[5].path)
    with store.read_session() as session:
        assert queries.verify(session, two_hop.run_a)["intact"]
        report = queries.verify(session, two_hop.run_a, include_inputs=True)
    assert report["checked"] == 6 + 9
    assert [f["path"] for f in report["files"] if f["state"] == "missing"] == [two_hop.sources[5].path]


def test_nothing_to_verify_is_an_error(store, two_hop, tmp_path):
    failed = store.start_run(config={}, overrides=[], tool_version="0.1.0", output_dir=str(tmp_path),
                             source_devices=8, target_devices=4)
    store.fail_run(failed, "out of memory")
    with store.read_session() as session:
        with pytest.raises(LineageError, match="failed and has no recorded outputs"):
            queries.verify(session, failed)
        with pytest.raises(LineageError, match="no file was ever recorded"):
            queries.verify(session, str(tmp_path / "never.ckpt"))
        with pytest.raises(LineageError, match="no run with id"):
            queries.verify(session, "not-a-run")


def test_a_digest_or_a_prefix_of_8_hex_verifies_that_content_at_every_path_it_was_recorded_at(store, two_hop):
    copied = two_hop.copied  # A's rank-0 output, recorded again where B read its copy
    with store.read_session() as session:
        by_prefix = queries.verify(session, copied.sha256[:12])
        by_whole = queries.verify(session, copied.sha256.upper())
        shortest = queries.verify(session, two_hop.final.sha256[:8])
    for report in (by_prefix, by_whole):
        assert report["intact"] and report["sha256"] == copied.sha256 and report["path"] is None
        assert {f["path"] for f in report["files"]} == {two_hop.outputs_a[0].path, copied.path}
    assert [f["path"] for f in shortest["files"]] == [two_hop.final.path]
    os.remove(copied.path)
    with store.read_session() as session:
        gone = queries.verify(session, copied.sha256[:12])
    assert not gone["intact"] and [f["path"] for f in gone["files"] if f["state"] == "missing"] == [copied.path]


def test_verify_by_digest_on_the_command_line_as_trace_takes_it(store, two_hop, capsys):
    from reshard_job.audit import main

    url = store.url.render_as_string(hide_password=False)
    assert main(["--db", url, "verify", two_hop.final.sha256[:12]]) == 0
    assert capsys.readouterr().out.startswith(f"sha256 {two_hop.final.sha256}: all 1 file intact")
    assert main(["--db", url, "verify", "0123456789ab"]) == 2
    assert "no run with id '0123456789ab', no file with a sha256 starting so" in capsys.readouterr().err
