"""The source index cache: an index document read back gives the very reader a walk gives, a
document that does not fit the file is never used, and the cache answers only for unchanged files."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import numpy as np
import pytest

import reshard_job.sources.index_cache as index_cache
from reshard_job.sources.open_files import SourceFiles
from reshard_job.formats.ckpt import CheckpointReader, CheckpointWriter
from reshard_job.formats.ckpt import reader as ckpt_reader
from reshard_job.formats.rewrite import copy_checkpoint
from reshard_job.sources.index_cache import IndexCache

GOLDEN = Path(__file__).resolve().parents[2] / "golden"
GOLDEN_CKPTS = sorted(GOLDEN.glob("*/src_checkpoints/rank_*/*.ckpt"))[:12]


def _rich(path: Path, *, crc: bool = False) -> Path:
    """Every kind of record: chunked tensors, bfloat16, a str, a map tensor (not with the CRC
    trailer: MindSpore leaves map records out of the CRC, so such a file fails its own check), a
    scalar."""
    with CheckpointWriter(path, crc=crc, chunk_bytes=24) as w:
        w.add("w", np.arange(12, dtype=np.float32).reshape(3, 4))
        w.add("b", np.arange(5, dtype=np.uint16), "BFloat16")
        w.add_str("s", "hi")
        if not crc:
            part = [((2,), "int32", np.arange(2, dtype=np.int32).tobytes()),
                    ((2, 2), "float32", np.zeros(4, np.float32).tobytes()),
                    ((2,), "int32", bytes(8))]
            w.add_map("m", [part, part])
        w.add("w2", np.ones(3, dtype=np.float16))
        w.add("step", np.array(7, dtype=np.int64))
    return path


def _twice(path: Path) -> Path:
    """A name given twice, apart: the later group wins, at the end of the entries."""
    with CheckpointWriter(path, chunk_bytes=8) as w:
        w.add("a", np.arange(4, dtype=np.float32))
        w.add("b", np.arange(3, dtype=np.int32))
    data = path.read_bytes()
    with CheckpointWriter(path.with_name("tail.ckpt")) as w:
        w.add("a", np.ones(2, dtype=np.float16))
    path.write_bytes(data + path.with_name("tail.ckpt").read_bytes())
    return path


def _state(r: CheckpointReader) -> dict:
    """Everything a reader knows after indexing, as plain values."""
    return {"entries": list(r.entries), "groups": [(e.name, e.kind, e.dtype, tuple(e.shape), e.nbytes)
                                                  for e in r.groups],
            "crc": r.crc_stored, "doc": r.index_document()}


def _files(tmp_path: Path) -> list[Path]:
    return [_rich(tmp_path / "rich.ckpt"), _rich(tmp_path / "crc.ckpt", crc=True),
            _twice(tmp_path / "twice.ckpt")] + GOLDEN_CKPTS


@pytest.fixture
def keep_all(monkeypatch):
    """Keep the index of every file, however small its records (the mechanics under test)."""
    monkeypatch.setattr(index_cache, "LARGE_RECORDS", 1)


def _large(path: Path, count: int = 4) -> Path:
    """A file of large records (64 KiB tensors), whose index is worth keeping."""
    with CheckpointWriter(path) as w:
        for i in range(count):
            w.add(f"layer.{i}.weight", np.full((128, 256), i, dtype=np.float16))
    return path


@pytest.fixture
def walks(monkeypatch) -> list[str]:
    """The files walked (rather than taken from a document)."""
    seen: list[str] = []
    real = CheckpointReader._walk

    def walk(self):
        seen.append(self.path)
        return real(self)

    monkeypatch.setattr(CheckpointReader, "_walk", walk)
    return seen


def test_an_index_document_read_back_is_the_walked_reader(tmp_path, walks):
    assert len(GOLDEN_CKPTS) >= 8
    for path in _files(tmp_path):
        with CheckpointReader(path) as walked:
            doc = json.loads(json.dumps(walked.index_document()))  # through JSON, as the cache keeps it
            want = _state(walked)
        walks.clear()
        # readers of equal columns share them: forget the walked one's, so nothing is borrowed
        ckpt_reader._SHARED_NAMES.clear()
        ckpt_reader._SHARED_COLUMNS.clear()
        with CheckpointReader(path, known_index=doc) as known:
            assert walks == [], f"{path}: walked although the document fits"
            assert _state(known) == want
            if path.name == "twice.ckpt":
                assert list(known.entries) == ["b", "a"] and known.read("a").dtype == np.float16
            if path.name == "crc.ckpt":
                assert known.crc_stored is not None
                known.verify_crc()
            copy_checkpoint(known, tmp_path / "copy.ckpt")  # every byte served through the document
        assert (tmp_path / "copy.ckpt").read_bytes() == Path(path).read_bytes()


def _spoiled(doc: dict) -> list[dict]:
    """Documents that must not be used for the file `doc` was made from."""
    out = []

    def edit(fn):
        d = json.loads(json.dumps(doc))
        fn(d)
        out.append(d)

    edit(lambda d: d.update(format=ckpt_reader.INDEX_FORMAT + 1))
    edit(lambda d: d.update(size=d["size"] + 1))
    edit(lambda d: d["off"].__setitem__(0, d["size"]))          # bytes beyond the file
    edit(lambda d: d["len"].__setitem__(-1, -5))
    edit(lambda d: d["names"].pop())                             # columns of unequal length
    edit(lambda d: d["kind"].__setitem__(0, 7))
    edit(lambda d: d["shape"].__setitem__(0, ["x"]))
    edit(lambda d: d["dtype"].__setitem__(0, 3))
    edit(lambda d: d["multi"][0][1][0].__setitem__(5, d["size"]))  # a chunk beyond the file
    edit(lambda d: d["multi"].append([len(d["names"]), []]))
    edit(lambda d: d.update(crc="0"))
    edit(lambda d: d.pop("rec"))
    return out


def test_a_document_that_does_not_fit_the_file_is_not_used(tmp_path, walks):
    path = _rich(tmp_path / "rich.ckpt")
    with CheckpointReader(path) as r:
        want = _state(r)
    for doc in _spoiled(want["doc"]):
        walks.clear()
        with CheckpointReader(path, known_index=doc) as r:
            assert walks == [str(path)], f"document used: {doc}"
            assert _state(r) == want


def test_the_cache_answers_for_the_same_file_unchanged_only(tmp_path):
    cache = IndexCache(str(tmp_path / "cache"))
    path = _rich(tmp_path / "a.ckpt")
    with CheckpointReader(path) as r:
        identity, doc = r.identity, r.index_document()
    assert cache.get(str(path), identity) is None
    cache.put(str(path), identity, doc)
    assert cache.get(str(path), identity) == doc
    assert cache.get(str(path), tuple(identity[:-1]) + (identity[-1] + 1,)) is None  # changed since
    assert cache.get(str(tmp_path / "b.ckpt"), identity) is None  # another path
    (stored,) = list((tmp_path / "cache").iterdir())
    assert stored.stat().st_mode & 0o077 == 0  # the user's own
    stored.write_bytes(stored.read_bytes()[:-3])  # damaged: zlib's checksum refuses it
    assert cache.get(str(path), identity) is None
    stored.write_bytes(zlib.compress(b"[1, 2]"))
    assert cache.get(str(path), identity) is None
    # an integer of absurd length anywhere in the document: not read (the file is walked)
    text = json.dumps({"path": os.path.abspath(path), "identity": list(identity), "index": doc})
    stored.write_bytes(zlib.compress(text.encode()))
    assert cache.get(str(path), identity) == doc
    stored.write_bytes(zlib.compress(text.replace('"index": {', '"index": {"x": %s, ' % ("9" * 21), 1).encode()))
    assert cache.get(str(path), identity) is None


@pytest.mark.parametrize("limit", ["files", "bytes"])
def test_the_cache_keeps_the_most_recently_used_documents(tmp_path, monkeypatch, limit):
    cache = IndexCache(str(tmp_path / "cache"))
    for i in range(5):
        cache.put(f"/data/{i}.ckpt", (1, i), {"names": []})
        os.utime(cache._file(f"/data/{i}.ckpt"), ns=(i * 10**9, i * 10**9))
    one = os.path.getsize(cache._file("/data/0.ckpt"))
    if limit == "files":
        monkeypatch.setattr(index_cache, "MAX_FILES", 3)
    else:
        monkeypatch.setattr(index_cache, "MAX_BYTES", 3 * one + one // 2)
    cache.put("/data/5.ckpt", (1, 5), {"names": []})
    kept = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert kept == sorted(Path(cache._file(f"/data/{i}.ckpt")).name for i in (3, 4, 5))


def test_a_cache_that_cannot_be_written_costs_nothing_but_the_walk(tmp_path, keep_all):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    cache = IndexCache(str(blocker / "cache"))
    path = _rich(tmp_path / "a.ckpt")
    with SourceFiles({0: str(path)}, index_cache=cache) as files:
        assert list(files.index()[0]) == ["w", "b", "s", "m", "w2", "step"]


def test_source_files_walk_a_file_once_and_again_when_it_changes(tmp_path, walks, keep_all):
    cache = IndexCache(str(tmp_path / "cache"))
    path = _rich(tmp_path / "a.ckpt")
    indexes = []
    for _ in range(2):
        with SourceFiles({0: str(path)}, verify_crc=False, index_cache=cache) as files:
            indexes.append(files.index())
    assert walks == [str(path)]
    assert indexes[0] == indexes[1]
    # rewritten with other content: a new identity, walked again, the new content indexed
    with CheckpointWriter(path) as w:
        w.add("other", np.zeros(2, dtype=np.float32))
    with SourceFiles({0: str(path)}, verify_crc=False, index_cache=cache) as files:
        assert list(files.index()[0]) == ["other"]
    assert walks == [str(path), str(path)]


def test_a_job_plans_from_cached_indexes_as_from_walked_ones(tmp_path, walks, keep_all):
    """prepare() with the cache: the second time no source is walked, and the plan is the same."""
    from reshard_job.job.stages.prepare import prepare
    from reshard_job.job.config.spec import SourceSpec, TargetSpec

    d = GOLDEN / "S2_block_mp4dp2opt_to_mp4"
    cache = IndexCache(str(tmp_path / "cache"))
    plans = []
    for _ in range(2):
        walks.clear()
        ckpt_reader._SHARED_NAMES.clear()
        ckpt_reader._SHARED_COLUMNS.clear()
        with prepare(SourceSpec(str(d / "src_checkpoints"), str(d / "src_strategy.ckpt")),
                     TargetSpec(strategy=str(d / "dst_strategy.ckpt")), index_cache=cache) as prepared:
            plans.append((json.dumps(prepared.plan.to_json(), sort_keys=True), prepared.index))
        if not plans[1:]:
            assert len(walks) == 8
    assert walks == []
    assert plans[0] == plans[1]


def test_only_indexes_of_large_records_are_kept(tmp_path, walks):
    """A walk of large records reads each head on its own (worth keeping); one of small records is
    parsed from large windows as fast as a document is read back (not kept)."""
    cache = IndexCache(str(tmp_path / "cache"))
    large, small = _large(tmp_path / "large.ckpt"), _rich(tmp_path / "small.ckpt")
    for _ in range(2):
        with SourceFiles({0: str(large), 1: str(small)}, verify_crc=False, index_cache=cache) as files:
            files.index()
    assert walks == [str(large), str(small), str(small)]


def test_the_command_line_keeps_indexes_only_with_the_hash_cache(tmp_path):
    import subprocess
    import sys

    (tmp_path / "src" / "rank_0").mkdir(parents=True)
    _large(tmp_path / "src" / "rank_0" / "checkpoint_0.ckpt")
    args = [f"source.checkpoints={tmp_path / 'src'}", "source=checkpoints", "target=single", "job.mode=plan",
            "hydra.run.dir=run"]
    env = dict(os.environ, RESHARD_JOB_CACHE_DIR=str(tmp_path / "cache"))
    folder = tmp_path / "cache" / "source-index.d"
    for extra, kept in ((["job.hash_cache=false"], 0), ([], 1)):
        res = subprocess.run([sys.executable, "-m", "reshard_job", *args, *extra], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=180)
        assert res.returncode == 0, res.stderr
        assert len(list(folder.glob("*.json.z")) if folder.exists() else []) == kept


def test_a_kept_document_that_does_not_fit_is_replaced_by_the_walk(tmp_path, walks, keep_all):
    cache = IndexCache(str(tmp_path / "cache"))
    path = _rich(tmp_path / "a.ckpt")
    with CheckpointReader(path) as r:
        identity, doc = r.identity, r.index_document()
    cache.put(str(path), identity, dict(doc, format=ckpt_reader.INDEX_FORMAT + 1))  # e.g. an older version's
    walks.clear()
    for _ in range(2):
        with SourceFiles({0: str(path)}, verify_crc=False, index_cache=cache) as files:
            files.index()
    assert walks == [str(path)]
    assert cache.get(str(path), identity) == doc
