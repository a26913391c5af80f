"""The sources' fingerprints taken while a remote file streams past to be indexed and hashed
(``proof.stream_taps``, ``proof.record_boxes``).

Each golden rank-folder source is read as a remote object is: through ``DigestingReader`` with a
``StreamTap`` forecasting every record's box from the strategy. The one-device plan's file taps
made afterwards are then served from what streamed, all of them, and give exactly the fingerprints
the independent read by pieces gives. A forecast that differs from the plan (another box, dtype,
offset or a tensor of several records) is not used: that tap is fed from its records as before.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from reshard_job.api import transform_checkpoints
from reshard_job.formats.ckpt import CRC_TRAILER_LEN, CheckpointWriter
from reshard_job.formats.registry import open_reader
from reshard_job.job.config.spec import SourceSpec, TargetSpec
from reshard_job.job.stages.prepare import prepare
from reshard_job.job.stages.proof import checkpoint_fingerprints, converted_names, source_taps
from reshard_job.proof.record_boxes import RecordBoxes
from reshard_job.proof.stream_taps import StreamTap, serve_taps
from reshard_job.sources.file_digests import DigestingReader
from reshard_job.storage.local import LocalFile

GOLDEN = Path(__file__).parents[2] / "golden"
RANK_FOLDERS = ["S1_mlp_tutorial_8to4", "S2_block_mp4dp2opt_to_mp4", "S3_pipeline2x4opt_to_4", "S5a_merge_8to1",
                "S5b_split_1to8", "S5c_merge_pipeline2x4_to1"]
JOB = SimpleNamespace(run=SimpleNamespace(fingerprints=True), storage=None)
MIB = 1 << 20


def _source(name: str) -> tuple[SourceSpec, TargetSpec]:
    d = GOLDEN / name
    strategy = next((str(p) for p in (d / "src_strategy.ckpt", d / "src_strategy_dir") if p.exists()), None)
    dst = d / "dst_strategy.ckpt"
    return SourceSpec(str(d / "src_checkpoints"), strategy), TargetSpec(strategy=str(dst)) if dst.exists() else \
        TargetSpec(devices=1)


def _streamed(path: str, boxes, block: int = 4 * MIB):
    """What indexing and hashing `path` as a remote object gives, with a record tap on the way."""
    raw = LocalFile(path)
    crc_end = raw.size - CRC_TRAILER_LEN if path.endswith(".ckpt") else None
    stream = DigestingReader(raw, crc_end=crc_end, block=block, tap=StreamTap(boxes))
    with open_reader(stream, verify_crc=False):
        return stream.finish()


def _served(source: SourceSpec, target: TargetSpec, boxes_of, **kwargs):
    """(taps served from the stream, taps in all, digests after feeding the rest, converted names)."""
    with prepare(source, target) as prepared:
        streamed = {prepared.readers.paths[r]: _streamed(prepared.readers.paths[r], boxes_of(prepared, r), **kwargs)
                    for r in prepared.plan.source_ranks}
        taps = source_taps(JOB, prepared)
        served = serve_taps(taps, streamed)
        taps.feed(taps.unfed())
        digests, residual = taps.digests()
        assert residual == set()
        return served, len(taps.files), digests, converted_names(prepared)


def _forecast(prepared, rank):
    return RecordBoxes(prepared.strategy.topology, rank)


@pytest.mark.parametrize("name", RANK_FOLDERS)
def test_every_tap_of_a_golden_source_is_served_from_the_stream_with_the_fingerprints_read_by_pieces(name):
    source, target = _source(name)
    served, count, digests, names = _served(source, target, _forecast)
    assert served == count > 0  # no file read a second time
    expected = checkpoint_fingerprints(source, wanted=names).digests
    assert dict(digests) == expected and len(expected) > 0


@pytest.mark.parametrize("block", [4096, 100_000])
def test_blocks_smaller_than_the_walk_give_the_same_fingerprints_or_leave_the_tap_to_its_reads(block):
    source, target = _source("S2_block_mp4dp2opt_to_mp4")
    served, count, digests, names = _served(source, target, _forecast, block=block)
    assert dict(digests) == checkpoint_fingerprints(source, wanted=names).digests


def _shifted(prepared, rank):
    """A forecast one row off for every record: the sums it takes are of other boxes."""
    right = RecordBoxes(prepared.strategy.topology, rank)

    def boxes(name, dims):
        shape, box = right(name, dims)
        if box:
            box = ((box[0][0] + 1, box[0][1] + 1),) + box[1:]
            shape = (shape[0] + 1,) + shape[1:]
        return shape, box
    return boxes


def _no_forecast(prepared, rank):
    return lambda name, dims: None


def _failing(prepared, rank):
    def boxes(name, dims):
        raise OverflowError("a layout the forecast cannot work out")
    return boxes


@pytest.mark.parametrize("forecast", [_shifted, _no_forecast, _failing])
def test_a_forecast_the_plan_does_not_confirm_is_not_used(forecast):
    source, target = _source("S2_block_mp4dp2opt_to_mp4")
    served, count, digests, names = _served(source, target, forecast)
    assert served == 0 and count > 0  # fed from their records instead
    assert dict(digests) == checkpoint_fingerprints(source, wanted=names).digests


def test_safetensors_rank_files_are_served_from_the_stream(tmp_path):
    """Per-rank safetensors files: every tensor is noted from the header, then streams past."""
    s1 = GOLDEN / "S1_mlp_tutorial_8to4"
    strategy = str(s1 / "src_strategy.ckpt")
    transform_checkpoints(str(s1 / "src_checkpoints"), str(tmp_path / "st"), "checkpoint_", strategy, strategy,
                          output_format="safetensors")
    source = SourceSpec(str(tmp_path / "st"), strategy)
    served, count, digests, names = _served(source, TargetSpec(strategy=str(s1 / "dst_strategy.ckpt")), _forecast)
    assert served == count > 0
    assert dict(digests) == checkpoint_fingerprints(source, wanted=names).digests


@pytest.mark.parametrize("block", [4096, 100_000, 4 * MIB])
def test_a_tensor_of_several_chunk_records_is_fed_across_them(tmp_path, block):
    """A tensor cut into chunk records (each with the full dims, as MindSpore writes tensors over
    512 MiB) is one partial fingerprint fed across its records; with blocks smaller than the walk's
    window some records pass before they are noted, and the file is then read, never wrong."""
    rng = np.random.default_rng(3)
    folder = tmp_path / "src" / "rank_0"
    folder.mkdir(parents=True)
    with CheckpointWriter(folder / "checkpoint_0.ckpt", chunk_bytes=1 << 16) as w:
        w.add("norm", rng.standard_normal(100).astype(np.float32))
        w.add("w", rng.standard_normal((300, 200)).astype(np.float32))  # 240 KB: 4 chunk records
        w.add("v", rng.standard_normal((20, 3)).astype(np.float16))
    source = SourceSpec(str(tmp_path / "src"))
    served, count, digests, names = _served(source, TargetSpec(devices=1), _forecast, block=block)
    assert count == 1 and (served == 1 or block < 4 * MIB)
    assert dict(digests) == checkpoint_fingerprints(source, wanted=names).digests


def test_a_chunk_the_stream_did_not_see_leaves_the_file_to_its_reads():
    """Records of one tensor here must be the tap's records of it, all of them."""
    tap = StreamTap(lambda name, dims: (dims, tuple((0, n) for n in dims)))
    tap.note(10, 8, "w", "Float32", (4,))  # the first half of a 16-byte tensor
    tap.note(30, 8, "w", "Float32", (4,))
    tap.update(0, memoryview(bytes(range(40))))
    streamed = tap.finish()
    assert streamed.taken.tolist() == [True]
    from array import array
    from reshard_job.proof.tapped import Tapped, TappedColumns
    tensors = TappedColumns()
    tensors.append(Tapped("w", "Float32", (4,), None))
    both = (array("q", [10, 30]), array("q", [8, 8]), array("q", [0, 0]))
    assert streamed.serve(both, tensors) is not None
    assert streamed.serve((array("q", [10]), array("q", [8]), array("q", [0])), tensors) is None
    other = TappedColumns()
    other.append(Tapped("w", "Float32", (4,), None))
    other.append(Tapped("u", "Float32", (2,), None))  # the second record as a tensor of its own
    assert streamed.serve((array("q", [10, 30]), array("q", [8, 8]), array("q", [0, 1])), other) is None


def test_the_forecast_is_the_box_the_one_device_plan_reads_for_each_record():
    source, target = _source("S3_pipeline2x4opt_to_4")
    with prepare(source, target) as prepared:
        topology = prepared.strategy.topology
        for rank in prepared.plan.source_ranks:
            reader = prepared.readers.raw_reader(rank)
            boxes = RecordBoxes(topology, rank)
            for name in reader.names():
                entry = reader.entries[name]
                if entry.kind != "tensor":
                    continue
                shape, box = boxes(name, tuple(entry.shape))
                layout = topology.layouts.get(name)
                if layout is None:
                    assert box == tuple((0, n) for n in entry.shape)
                else:
                    assert tuple(hi - lo for lo, hi in box) == tuple(entry.shape)
                    assert all(hi <= n for (_, hi), n in zip(box, shape))
