"""Runs of records alike but for their names are indexed in bulk (``formats.ckpt.runs``): the index
is the one the record-by-record walk builds, and a bad record is refused the same way, whatever
interrupts a run (a name given twice or twice in a row, a name holding the tail's bytes, a name
that is not UTF-8, a long name, another shape, the end of a window); and written in one call
(``CheckpointWriter.add_alike``) they are the bytes written one by one."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reshard_job.formats.ckpt.walk as walk
from reshard_job.formats.ckpt.runs import take_run as run_of
from reshard_job.errors import CheckpointFormatError
from reshard_job.formats import wire
from reshard_job.formats.ckpt import CheckpointReader, CheckpointWriter, record_header
from reshard_job.formats.ckpt.records import tensor_header

FAST = settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])

SHAPES = [((1,), "Float32", 4), ((2, 3), "Float16", 12), ((), "Int32", 4)]
TAIL = record_header("x", (1,), "Float32", 4)[5:]  # the bytes after a name of one Float32 element


def raw_record(name: bytes, dims, dtype: str, content: bytes) -> bytes:
    """A record as MindSpore writes it, from a name's raw bytes (which need not be UTF-8)."""
    tensor = tensor_header(dims, dtype, len(content))
    value = wire.len_field(1, len(name)) + name + wire.len_field(2, len(tensor) + len(content)) + tensor + content
    return wire.len_field(1, len(value)) + value


@st.composite
def files(draw):
    """Records in runs alike, with what breaks a run drawn in between."""
    out, used, i = [], [], 0
    for _ in range(draw(st.integers(1, 6))):
        dims, dtype, size = draw(st.sampled_from(SHAPES))
        for _ in range(draw(st.integers(0, 120))):
            i += 1
            what = draw(st.sampled_from(["new"] * 20 + ["again", "twice", "tail", "sep", "é", "long", "bad"]))
            name = {"new": f"p{i}".encode(), "tail": b"t" + TAIL + b"%d" % i, "sep": b"s\x12%d" % i,
                    "é": f"é{i}".encode(), "long": b"L" * 130 + b"%d" % i, "bad": b"\xff%d" % i,
                    "again": draw(st.sampled_from(used)) if used else b"a",
                    "twice": out[-1][0] if out else b"b"}[what]
            if what == "bad" and draw(st.integers(0, 3)):
                continue  # a bad name is rare: the file is refused at it
            used.append(name)
            out.append((name, dims, dtype, bytes([i % 256]) * size))
    return out


def index_of(path: str, run_after: int, window: int):
    """The reader's index (or its error) with runs taken after `run_after` records alike."""
    saved = walk.RUN_AFTER, walk.WINDOW
    walk.RUN_AFTER, walk.WINDOW = run_after, window
    try:
        with CheckpointReader(path) as r:
            return r.index_document(), list(r.entries)
    except CheckpointFormatError as e:
        return str(e)
    finally:
        walk.RUN_AFTER, walk.WINDOW = saved


@FAST
@given(records=files(), window=st.sampled_from([1 << 10, 1 << 12, 4 << 20]), run_after=st.integers(0, 3))
def test_runs_taken_at_once_index_as_one_by_one(tmp_path_factory, records, window, run_after):
    path = tmp_path_factory.mktemp("runs") / "r.ckpt"
    path.write_bytes(b"".join(raw_record(*r) for r in records))
    assert index_of(str(path), run_after, window) == index_of(str(path), 1 << 60, window)


def test_a_long_run_is_taken_at_once_and_reads_its_own_bytes(tmp_path, monkeypatch):
    records = [(f"expert.{i}.w".encode(), (1,), "Float32", i.to_bytes(4, "little")) for i in range(5000)]
    path = tmp_path / "r.ckpt"
    path.write_bytes(b"".join(raw_record(*r) for r in records))
    assert index_of(str(path), 16, 4 << 20) == index_of(str(path), 1 << 60, 4 << 20)
    taken = []
    monkeypatch.setattr(walk, "take_run", lambda *a: taken.append(run_of(*a)) or taken[-1])
    with CheckpointReader(str(path)) as r:
        assert taken and taken[0] is not None  # the run was taken at once
        assert [int(r.read(f"expert.{i}.w")[0].view("<u4")) for i in (0, 17, 4999)] == [0, 17, 4999]


def test_a_run_that_begins_with_the_name_before_it_is_a_chunk_of_that_tensor(tmp_path):
    """The first record of a run under the name of the record before it continues that tensor
    (here into 8 bytes that its dims do not hold: refused as such, not taken for a new tensor)."""
    records = [(name, (1,), "Float32", bytes([i]) * 4) for i, name in enumerate([b"a", b"a", b"c", b"d", b"e"])]
    path = tmp_path / "r.ckpt"
    path.write_bytes(b"".join(raw_record(*r) for r in records))
    for run_after in (0, 1, 2):
        assert index_of(str(path), run_after, 4 << 20) == index_of(str(path), 1 << 60, 4 << 20)
    assert "parameter 'a': 8 bytes of data but dims [1]" in index_of(str(path), 0, 4 << 20)


@FAST
@given(names=st.lists(st.one_of(st.text(min_size=0, max_size=6), st.just("L" * 200)), min_size=1, max_size=40),
       shape=st.sampled_from(SHAPES), crc=st.booleans())
def test_records_written_alike_are_the_bytes_written_one_by_one(tmp_path_factory, names, shape, crc):
    """``add_alike`` writes what ``add_bytes`` of each writes (names of any length, CRC or not),
    with the same per-tensor digests."""
    dims, dtype, size = shape
    contents = [bytes([i % 256]) * size for i in range(len(names))]
    folder = tmp_path_factory.mktemp("alike")
    results = []
    for way in ("one_by_one", "alike"):
        with CheckpointWriter(folder / f"{way}.ckpt", crc=crc) as w:
            w.add("before", np.arange(3, dtype=np.float32))
            if way == "alike":
                w.add_alike(names, dtype, dims, contents)
            else:
                for name, data in zip(names, contents):
                    w.add_bytes(name, dtype, dims, data)
            w.add("after", np.arange(2, dtype=np.float32))
        results.append(((folder / f"{way}.ckpt").read_bytes(), dict(w.result.tensors.items())))
    assert results[0] == results[1]


def test_a_name_twice_in_a_row_inside_a_run_is_a_chunk_of_that_tensor(tmp_path):
    names = [b"p%d" % i for i in range(40)]
    names.insert(21, names[20])
    path = tmp_path / "r.ckpt"
    path.write_bytes(b"".join(raw_record(n, (1,), "Float32", b"\1" * 4) for n in names))
    for run_after in (0, 4, 16):
        assert index_of(str(path), run_after, 4 << 20) == index_of(str(path), 1 << 60, 4 << 20)
    assert "parameter 'p20': 8 bytes of data but dims [1]" in index_of(str(path), 4, 4 << 20)
