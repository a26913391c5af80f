"""Whole small tensors are copied a run at a time (``execute.small_copies``): the output is the file
the tensors were written to one by one, whatever breaks the runs (another shape or dtype, a string,
a tensor in two records, a large tensor), and a source entry that changed since it was planned is
still refused naming it."""

from __future__ import annotations

import numpy as np
import pytest

from reshard_job.core.topology import Topology
from reshard_job.errors import FormatError
from reshard_job.execute import small_copies
from reshard_job.execute.rank_task import execute_rank
from reshard_job.formats.ckpt import CheckpointReader, CheckpointWriter
from reshard_job.formats.index import reader_index
from reshard_job.plan.planner import Planner
from reshard_job.sources.open_files import SourceFiles


def write_source(path, changed: bool = False) -> None:
    with CheckpointWriter(path, mode=0o644) as w:
        for i in range(300):
            w.add(f"expert.{i}.w", np.full(3, i, np.float32))
            if i % 97 == 5:
                w.add(f"expert.{i}.b", np.full((2, 2), i, np.float16))
            if i % 113 == 7:
                w.add_str(f"note.{i}", "kept")
        w.add_bytes("chunked", "Float32", (4,), np.arange(4, dtype=np.float32).view(np.uint8), chunk_sizes=[8, 8])
        w.add("large", np.arange(70_000, dtype=np.float32))
        w.add("expert.299.m", np.zeros(3, np.float64 if changed else np.float32))
        for i in range(50):
            w.add(f"tail.{i}", np.full(3, -i, np.float32))


def convert(src: str, out: str, before_run=None):
    with SourceFiles({0: src}) as sources:
        plan = Planner(Topology.unsharded(), None, {0: reader_index(sources.reader(0))}).plan()
        if before_run is not None:
            before_run()
        return execute_rank(plan.ranks[0], SourceFiles({0: src}), out)


@pytest.mark.parametrize("run", [1, 7, 2048])
def test_runs_write_the_file_written_one_by_one(tmp_path, monkeypatch, run):
    src = str(tmp_path / "src.ckpt")
    write_source(src)
    monkeypatch.setattr(small_copies, "RUN", run)
    written = convert(src, str(tmp_path / "out.ckpt"))
    with CheckpointReader(src) as r, CheckpointReader(written.path) as out:
        assert list(out.entries) == list(r.entries)
        assert all(out.value(n) == r.value(n) if out.kind(n) == "str" else np.array_equal(out.read(n), r.read(n))
                   for n in r.entries)
    with CheckpointWriter(tmp_path / "by_hand.ckpt") as w:  # the same tensors, one add each
        with CheckpointReader(src) as r:
            for name in r.entries:
                if r.kind(name) == "str":
                    w.add_str(name, r.read_str(name))
                else:
                    w.add(name, r.read(name), r.entries[name].dtype)
    assert (tmp_path / "by_hand.ckpt").read_bytes() == (tmp_path / "out.ckpt").read_bytes()
    assert dict(written.tensors.items()) == dict(w.result.tensors.items())


def test_an_entry_changed_since_planning_is_refused_by_name(tmp_path):
    src = str(tmp_path / "src.ckpt")
    write_source(src)

    def change():  # another dtype than planned, same name and place in the order
        (tmp_path / "src.ckpt").unlink()
        write_source(src, changed=True)

    with pytest.raises(FormatError, match="expert.299.m"):
        convert(src, str(tmp_path / "out.ckpt"), before_run=change)


@pytest.mark.parametrize("run", [1, 7, 2048])
def test_the_fingerprints_taken_while_writing_runs_are_those_of_the_file_read_back(tmp_path, monkeypatch, run):
    """Runs hand the tap their tensors' specs instead of an expectation each; a tensor handed back
    to be written the long way (``chunked``: two records), one too large for a run, and strings
    in between are counted as before."""
    from reshard_job.execute.writer_tap import WriterTap, fingerprint_written

    from reshard_job.execute import rank_task

    src = str(tmp_path / "src.ckpt")
    write_source(src)
    monkeypatch.setattr(small_copies, "RUN", run)
    monkeypatch.setattr(rank_task, "KNOWN_FACTS", run)  # the facts kept per slice, forgotten and found again
    with SourceFiles({0: src}) as sources:
        rank_plan = Planner(Topology.unsharded(), None, {0: reader_index(sources.reader(0))}).plan().ranks[0]
    assert rank_plan.counting is not None
    tap = WriterTap()
    with SourceFiles({0: src}) as sources:
        written = execute_rank(rank_plan, sources, str(tmp_path / "out.ckpt"), tap=tap)
    tapped = tap.result()
    with CheckpointReader(written.path) as r:
        read_back = fingerprint_written(rank_plan, r)
    assert tapped is not None and read_back is not None
    assert sorted(tapped) == sorted(read_back)
    names = {name for name, _, _ in tapped}
    assert {"chunked", "large", "expert.0.w", "expert.5.b", "tail.49"} <= names and "note.7" not in names
    assert len(names) == len(tapped) == 300 + 4 + 3 + 50


def test_a_run_written_after_expectations_counts_as_a_run_given_its_specs(tmp_path):
    """``add_alike`` without specs (its tensors ``expect``-ed one by one) and with them count the
    same tensors the same way; an unexpected one (no spec) is not counted either way."""
    from reshard_job.execute.writer_tap import WriterTap

    names = [f"p{i}" for i in range(20)]
    contents = [np.full(3, i, np.float32).tobytes() for i in range(20)]
    specs = [None if i % 7 == 3 else WriterTap.spec_for("Float32", "tensor", (3,), (3,), (0,)) for i in range(20)]
    results = []
    for given in (False, True):
        tap = WriterTap()
        with CheckpointWriter(tmp_path / f"{given}.ckpt") as w:
            w.fingerprint_tap = tap
            if given:
                w.add_alike(names, "Float32", (3,), contents, specs)
            else:
                for name, spec in zip(names, specs):
                    tap.expect_spec(name, spec)
                w.add_alike(names, "Float32", (3,), contents)
        results.append(sorted(tap.result()))
    assert results[0] == results[1] and len(results[0]) == 17
