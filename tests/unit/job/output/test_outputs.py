"""The output directory's states, journal and guards, tested directly (no job runs here)."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from reshard_job.errors import OutputError
from reshard_job.job.output.journal import JournalEntry
from reshard_job.job.output.manifest import build_manifest, job_fingerprint, manifest_digest
from reshard_job.job.output.directory import COMPLETE, FRESH, PARTIAL, OutputDir
from reshard_job.storage import LOCAL


def _out(tmp_path, **kw) -> OutputDir:
    return OutputDir(str(tmp_path / "out"), LOCAL, **kw)


def _file(path, data: bytes) -> JournalEntry:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return JournalEntry(0, f"{path.parent.name}/{path.name}", len(data), hashlib.sha256(data).hexdigest())


def test_states_fresh_partial_complete_and_foreign(tmp_path):
    out = _out(tmp_path)
    assert out.state("fp") == FRESH
    out.journal.start("fp", keep=False)
    assert out.state("fp") == PARTIAL
    with pytest.raises(OutputError, match="holds the partial outputs of a different conversion"):
        out.state("other")
    out.write_manifest({"fingerprint": "fp", "run_id": "r1"})
    assert out.state("fp") == COMPLETE
    with pytest.raises(OutputError, match=r"holds the outputs of a different conversion \(run r1\)"):
        out.state("other")
    foreign = _out(tmp_path / "x")
    os.makedirs(foreign.path)
    (tmp_path / "x" / "out" / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match=r"files this tool did not produce \(notes.txt\)"):
        foreign.check_not_foreign()


def test_journal_keeps_identities_and_tensor_digests(tmp_path):
    out = _out(tmp_path)
    out.journal.start("fp", keep=False)
    e = _file(tmp_path / "out" / "rank_0" / "c0.ckpt", b"abc")
    e.identity = tuple(LOCAL.info(str(tmp_path / "out" / "rank_0" / "c0.ckpt")).identity)
    e.tensors = {"w": "00" * 32}
    out.journal.append(e)
    fp, entries = out.journal.read()
    assert fp == "fp" and [(x.rank, x.path, x.size, x.sha256, x.identity) for x in entries] == \
        [(0, "rank_0/c0.ckpt", 3, e.sha256, e.identity)]
    assert out.journal.tensors(entries[0]) == {"w": "00" * 32}
    kept = out.reusable({0: str(tmp_path / "out" / "rank_0" / "c0.ckpt")})
    assert kept[0].tensors == {"w": "00" * 32}
    with open(tmp_path / "out" / ".reshard_job" / "journal.jsonl", "a") as f:
        f.write('{"rank": 1, "path": "rank_1/c1.ck')  # a line cut short by a crash is skipped
    assert len(out.journal.read()[1]) == 1


def _journal_lines(tmp_path) -> list[dict]:
    return [json.loads(x) for x in (tmp_path / "out" / ".reshard_job" / "journal.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("damage", ["sha256", "size", "identity", "path", "check", "no_check"])
def test_an_edited_or_damaged_journal_line_is_not_trusted(tmp_path, damage):
    """A journal line whose fields were changed (or that lacks its check) does not count: its rank is
    redone, never listed with a digest the file does not have."""
    out = _out(tmp_path)
    out.journal.start("fp", keep=False)
    path = tmp_path / "out" / "rank_0" / "c0.ckpt"
    e = _file(path, b"abc")
    e.identity = tuple(LOCAL.info(str(path)).identity)
    out.journal.append(e)
    assert list(out.reusable({0: str(path)})) == [0]
    header, line = _journal_lines(tmp_path)
    if damage == "no_check":
        del line["check"]
    elif damage == "identity":
        line["identity"][1] += 1
    elif damage in ("size",):
        line[damage] += 1
    else:
        line[damage] = ("0" * 64) if damage != "path" else "rank_0/other.ckpt"
    (tmp_path / "out" / ".reshard_job" / "journal.jsonl").write_text(
        json.dumps(header) + "\n" + json.dumps(line) + "\n")
    assert out.journal.read()[1] == []
    assert out.reusable({0: str(path)}) == {}


def test_an_edited_per_tensor_record_is_not_trusted(tmp_path):
    out = _out(tmp_path)
    out.journal.start("fp", keep=False)
    path = tmp_path / "out" / "rank_0" / "c0.ckpt"
    e = _file(path, b"abc")
    e.identity = tuple(LOCAL.info(str(path)).identity)
    e.tensors = {"w": "00" * 32}
    out.journal.append(e)
    record = tmp_path / "out" / ".reshard_job" / "tensors" / "rank_0.json"
    record.write_text(json.dumps({"w": "11" * 32}))
    assert out.reusable({0: str(path)}) == {}
    record.unlink()
    assert out.reusable({0: str(path)}) == {}


def test_verify_trusts_an_unchanged_identity_and_rehashes_a_changed_one(tmp_path):
    out = _out(tmp_path)
    path = tmp_path / "out" / "rank_0" / "c0.ckpt"
    e = _file(path, b"x" * 100)
    e.identity = tuple(LOCAL.info(str(path)).identity)
    assert out.verify(e)
    path.chmod(0o644)
    path.write_bytes(b"y" * 100)  # same size, one byte... all bytes changed; ctime moves
    assert not out.verify(e)
    e2 = _file(path, b"z" * 100)  # a copied directory: no identity journaled, so the bytes are re-read
    assert out.verify(e2) and not out.verify(JournalEntry(0, e2.path, 100, "0" * 64))


def test_a_symlink_inside_the_output_dir_cannot_lead_writes_out_of_it(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = _out(tmp_path)
    os.makedirs(out.path)
    os.symlink(elsewhere, os.path.join(out.path, "rank_0"))
    planned = [os.path.join(out.path, "rank_0", "checkpoint_0.ckpt")]
    with pytest.raises(OutputError, match=r"rank_0/checkpoint_0.ckpt would be written to .*elsewhere/checkpoint_0.ckpt, "
                                          r"outside output.dir"):
        out.check_planned(planned, [], [])


def test_clearing_a_previous_conversion_never_deletes_through_a_link(tmp_path):
    victim = tmp_path / "elsewhere" / "checkpoint_0.ckpt"
    victim.parent.mkdir()
    victim.write_bytes(b"precious")
    out = _out(tmp_path, overwrite=True)
    os.makedirs(out.path)
    os.symlink(victim.parent, os.path.join(out.path, "rank_0"))
    out.write_manifest({"fingerprint": "old", "target": {"files": [{"rank": 0, "path": "/old/rank_0/checkpoint_0.ckpt"}]}})
    assert out.state("new") == FRESH  # overwrite: the old conversion is cleared
    assert victim.read_bytes() == b"precious" and not os.path.exists(out.manifest_path)


def test_fingerprint_is_stable_and_manifest_digest_covers_everything_but_itself():
    key = dict(source_files=[{"rank": 1, "sha256": "b"}, {"rank": 0, "sha256": "a"}], source_strategy=None,
               target_strategy_sha256="t", target={"devices": 4})
    same = dict(key, source_files=list(reversed(key["source_files"])))
    assert job_fingerprint(**key) == job_fingerprint(**same)
    assert job_fingerprint(**key) != job_fingerprint(**dict(key, target={"devices": 2}))
    m = build_manifest(run_id="r", tool_version="v", fingerprint="f", config={}, source={}, target={}, tensors={},
                       plan_summary={}, checks=["c"])
    assert m["manifest_sha256"] == manifest_digest(m) and m["checks"] == ["c"] and m["digest_algorithm"] == "sha256"
    m["run_id"] = "other"
    assert m["manifest_sha256"] != manifest_digest(m)


@pytest.mark.parametrize("filler", [b"x" * 1000 + b"\n", b"y" * (1 << 20)])
def test_a_huge_journal_is_read_in_blocks(tmp_path, filler):
    """A journal grown to tens of MB (or replaced by one endless line) costs memory for its valid
    entries only, not for its size; the valid entry among the junk still counts."""
    import tracemalloc

    out = _out(tmp_path)
    out.journal.start("fp", keep=False)
    path = tmp_path / "out" / "rank_0" / "c0.ckpt"
    e = _file(path, b"abc")
    out.journal.append(e)
    with open(tmp_path / "out" / ".reshard_job" / "journal.jsonl", "ab") as f:
        for _ in range((48 << 20) // len(filler)):
            f.write(filler)
        f.write(b"\n")
    tracemalloc.start()
    try:
        fingerprint, entries = out.journal.read()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert fingerprint == "fp" and [x.rank for x in entries] == [0]
    assert peak < 8 << 20, peak


class _CountingReads(type(LOCAL)):
    """The local store, counting the opens of each path (to see what is read again)."""

    def __init__(self):
        self.opened: list[str] = []

    def open_read(self, path):
        self.opened.append(path)
        return super().open_read(path)


def test_the_manifest_is_read_again_only_when_it_changed(tmp_path):
    store = _CountingReads()
    out = OutputDir(str(tmp_path / "out"), store)
    out.write_manifest({"fingerprint": "fp", "run_id": "r1"})
    for _ in range(3):
        assert out.read_manifest()["run_id"] == "r1"
    assert store.opened.count(out.manifest_path) == 1
    out.write_manifest({"fingerprint": "fp", "run_id": "r2"})  # replaced: another identity
    assert out.read_manifest()["run_id"] == "r2"
    os.remove(out.manifest_path)
    assert out.read_manifest() is None
