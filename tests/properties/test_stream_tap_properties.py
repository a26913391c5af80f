"""Property: over random layouts, the fingerprints a remote source's stream takes on the way
(``proof.stream_taps``, boxes foreseen by ``proof.record_boxes``) are those the independent read by
pieces gives, and every file whose tensors each have one record (or none, of zero bytes) is served from the stream.

The random sources are those of the round-trip properties: device matrices of 1–3 axes, multi-axis
maps, optimizer sharding, pipeline stages (a strategy file or a directory of stage files),
strategies as protobuf or JSON (flattened maps folded back), unsharded sides, zero-size dims and
several dtypes.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from types import SimpleNamespace

from hypothesis import HealthCheck, given, settings

from reshard_job.formats.ckpt import CRC_TRAILER_LEN, CheckpointReader
from reshard_job.job.config.spec import SourceSpec, TargetSpec
from reshard_job.job.stages.prepare import prepare
from reshard_job.job.stages.proof import checkpoint_fingerprints, converted_names, source_taps
from reshard_job.proof.record_boxes import RecordBoxes
from reshard_job.proof.stream_taps import StreamTap, serve_taps
from reshard_job.sources.file_digests import DigestingReader
from reshard_job.storage.local import LocalFile

from .test_roundtrip_properties import cases, write_sources

JOB = SimpleNamespace(run=SimpleNamespace(fingerprints=True), storage=None)


def _streamed(path: str, boxes, block: int):
    raw = LocalFile(path)
    stream = DigestingReader(raw, crc_end=raw.size - CRC_TRAILER_LEN, block=block, tap=StreamTap(boxes))
    with CheckpointReader(stream, verify_crc=False):
        return stream.finish()


@settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(case=cases(pipeline=True))
def test_the_stream_gives_the_fingerprints_read_by_pieces(helpers, case):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_sources(case, root / "src", helpers)
        strategy = case.src.write(root / "src_strategy", case.json, case.as_dir, case.shapes)
        source = SourceSpec(str(root / "src"), strategy)
        with prepare(source, TargetSpec(devices=1)) as prepared:
            topology = prepared.strategy.topology
            block = 4096 if case.seed % 2 else 1 << 20  # blocks smaller than a walk's window, or not
            streamed = {prepared.readers.paths[r]: _streamed(prepared.readers.paths[r], RecordBoxes(topology, r),
                                                             block)
                        for r in prepared.plan.source_ranks}
            taps = source_taps(JOB, prepared)
            served = serve_taps(taps, streamed)
            if block > 4096:  # a record each (or none, of zero bytes): all foreseen as the plan counts them
                assert served == len(taps.files)
            taps.feed(taps.unfed())
            digests, residual = taps.digests()
            names = converted_names(prepared)
        assert residual == set()
        assert dict(digests) == checkpoint_fingerprints(source, wanted=names).digests
