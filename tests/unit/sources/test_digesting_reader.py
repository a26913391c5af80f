"""Indexing and hashing a source in one front-to-back read (``hashing.DigestingReader``).

The reader wraps any ``RandomAccess`` (here a local file, which reads the same bytes as an
object); what it reports must equal a separate hash pass, byte for byte, or be left out.
"""

from __future__ import annotations

import hashlib
import zlib

import numpy as np
import pytest

from reshard_job.formats.ckpt import CRC_TRAILER_LEN, CheckpointReader, CheckpointWriter
from reshard_job.formats.safetensors import SafetensorsReader
from reshard_job.sources.file_digests import DigestingReader, HashRequest, digest_file, usable_digest
from reshard_job.storage.local import LocalFile

MIB = 1024 * 1024


class CountingFile(LocalFile):
    """A local file that counts the bytes asked of it (what an object store would be sent)."""

    def __init__(self, path):
        super().__init__(path)
        self.bytes_read = 0

    def pread_into(self, offset, view):
        n = super().pread_into(offset, view)
        self.bytes_read += n
        return n


def model_ckpt(path, *, crc=True, chunk=None):
    """Small tensors between large ones (a layer's norms, biases and weights), some chunked."""
    rng = np.random.default_rng(7)
    kwargs = {"crc": crc} if chunk is None else {"crc": crc, "chunk_bytes": chunk}
    with CheckpointWriter(path, **kwargs) as w:
        for layer in range(6):
            w.add(f"l{layer}.norm", rng.standard_normal(126).astype(np.float16))
            w.add(f"l{layer}.bias", rng.standard_normal(1000).astype(np.float32))
            w.add(f"l{layer}.w", rng.standard_normal((700, 1200)).astype(np.float16))  # 1.6 MiB
            w.add(f"l{layer}.big", rng.standard_normal((1100, 1000)).astype(np.float32))  # 4.2 MiB
        w.add("global_step", np.array([12], dtype=np.int32))
    return path


def pieces_of(reader):
    return [piece for e in reader.entries.values() for piece in e.pieces]


@pytest.mark.parametrize("crc,chunk", [(True, None), (False, None), (True, 3 * MIB)])
def test_one_read_gives_the_index_and_every_digest_a_hash_pass_would(tmp_path, crc, chunk):
    path = model_ckpt(tmp_path / "m.ckpt", crc=crc, chunk=chunk)
    data = path.read_bytes()
    raw = CountingFile(str(path))
    stream = DigestingReader(raw, crc_end=len(data) - CRC_TRAILER_LEN, block=4 * MIB)
    with CheckpointReader(stream, verify_crc=False) as reader:
        streamed = stream.finish()
        with CheckpointReader(str(path), verify_crc=False) as plain:
            assert list(reader.entries) == list(plain.entries)
            assert [e.pieces for e in reader.entries.values()] == [e.pieces for e in plain.entries.values()]
        assert raw.bytes_read == len(data)  # each byte fetched once: the walk was served from the blocks
        assert streamed.digest.sha256 == hashlib.sha256(data).hexdigest()
        assert streamed.trailer_crc == zlib.crc32(data[:-CRC_TRAILER_LEN])
        assert streamed.all_noted
        pieces = pieces_of(reader)
        assert len(pieces) > len(reader.entries) or chunk is None
        for offset, length in pieces:
            assert streamed.content_crcs[(offset, length)] == zlib.crc32(data[offset:offset + length])
        # what the hash pass would be asked, answered without a read, equal to a read
        segments = ((0, len(data) - CRC_TRAILER_LEN), *pieces[::3])
        request = HashRequest(str(path), segments, tuple(raw.identity))
        assert usable_digest(streamed, request) == digest_file(str(path), segments=segments)
        # a range it did not take, or another identity, is left to the hash pass
        assert usable_digest(streamed, HashRequest(str(path), ((1, 10),), tuple(raw.identity))) is None
        assert usable_digest(streamed, HashRequest(str(path), None, ("other",))) is None
        # after the stream, reads go to the file itself
        before = raw.bytes_read
        e = reader.entries["l3.norm"]
        assert reader.read("l3.norm").tobytes() == data[e.pieces[0][0]:e.pieces[0][0] + e.pieces[0][1]]
        assert raw.bytes_read > before


@pytest.mark.parametrize("block", [4096, 100_000, 1 * MIB])
def test_blocks_smaller_than_the_walk_never_give_a_wrong_crc(tmp_path, block):
    """Blocks smaller than the walk's window leave memory before the walk has parsed all their
    records: those records' CRCs are missing (the hash pass reads the file again), never wrong."""
    path = model_ckpt(tmp_path / "m.ckpt")
    data = path.read_bytes()
    stream = DigestingReader(LocalFile(str(path)), crc_end=len(data) - CRC_TRAILER_LEN, block=block)
    with CheckpointReader(stream, verify_crc=False) as reader:
        streamed = stream.finish()
        assert streamed.digest.sha256 == hashlib.sha256(data).hexdigest()
        for (offset, length), crc in streamed.content_crcs.items():
            assert crc == zlib.crc32(data[offset:offset + length])
        if block < 1 * MIB:
            assert not streamed.all_noted  # the walk's window outran the blocks
        if not streamed.all_noted:
            request = HashRequest(str(path), tuple(pieces_of(reader)), ())
            assert usable_digest(streamed, request) is None


def test_safetensors_tensors_are_noted_from_the_header(tmp_path):
    from safetensors.numpy import save_file

    rng = np.random.default_rng(3)
    tensors = {f"t{i}": rng.standard_normal((i * 300 + 1, 700)).astype(np.float32) for i in range(8)}
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path))
    data = path.read_bytes()
    stream = DigestingReader(LocalFile(str(path)), block=4 * MIB)
    with SafetensorsReader(stream, verify_crc=False) as reader:
        streamed = stream.finish()
        assert streamed.trailer_crc is None and streamed.all_noted
        assert streamed.digest.sha256 == hashlib.sha256(data).hexdigest()
        spans = [(e.pieces[0][0], e.pieces[0][1]) for e in reader.entries.values()]
        for offset, length in spans:
            assert streamed.content_crcs[(offset, length)] == zlib.crc32(data[offset:offset + length])


def test_an_empty_and_a_tiny_file(tmp_path):
    for content in (b"", b"x" * 10):
        p = tmp_path / f"f{len(content)}"
        p.write_bytes(content)
        stream = DigestingReader(LocalFile(str(p)))
        got = bytearray(len(content))
        assert stream.pread_into(0, memoryview(got)) == len(content) and bytes(got) == content
        streamed = stream.finish()
        assert streamed.digest.sha256 == hashlib.sha256(content).hexdigest() and streamed.digest.size == len(content)
        stream.close()


GOLDEN = __import__("pathlib").Path(__file__).parents[2] / "golden"
SCENARIOS = [  # (scenario, source strategy, target strategy, target ranks)
    ("S1_mlp_tutorial_8to4", "src_strategy.ckpt", "dst_strategy.ckpt", None),
    ("S1_mlp_tutorial_8to4", "src_strategy.ckpt", "dst_strategy.ckpt", (2,)),
    ("S2_block_mp4dp2opt_to_mp4", "src_strategy.ckpt", "dst_strategy.ckpt", None),
    ("S3_pipeline2x4opt_to_4", "src_strategy_dir", "dst_strategy.ckpt", (1, 3)),
    ("S5a_merge_8to1", "src_strategy.ckpt", None, None),
    ("S5c_merge_pipeline2x4_to1", "src_strategy_merged.ckpt", None, None),
]


@pytest.mark.parametrize("scenario,src,dst,ranks", SCENARIOS)
def test_the_ranks_foreseen_from_the_strategies_are_those_the_plan_reads(scenario, src, dst, ranks):
    """Which remote sources to hash while indexing is decided before the index exists; a wrong
    guess would cost a read of a whole object the plan does not need, or a second read."""
    from reshard_job.job.stages.prepare import prepare, ranks_likely_read
    from reshard_job.job.config.spec import SourceSpec, TargetSpec
    from reshard_job.job.stages.target import settle_target

    d = GOLDEN / scenario
    source = SourceSpec(str(d / "src_checkpoints"), str(d / src))
    target = TargetSpec(strategy=str(d / dst) if dst else None)
    with prepare(source, target, ranks=ranks) as prepared:
        settled = settle_target(target, prepared.strategy, {}) if dst else None
        foreseen = ranks_likely_read(prepared.strategy, source, target, settled, ranks)
        assert foreseen == set(prepared.plan.source_ranks), (foreseen, prepared.plan.source_ranks)


def test_a_lone_object_streams_in_blocks_of_several_requests_and_many_share_the_budget():
    from reshard_job.sources.file_digests import REMOTE_BLOCK, STREAM_BLOCK, STREAM_BUDGET, stream_block

    assert stream_block(1) == REMOTE_BLOCK  # as the hash pass read one object: several GETs in flight
    assert stream_block(8) * 8 <= STREAM_BUDGET and stream_block(8) >= STREAM_BLOCK
    assert stream_block(1000) == STREAM_BLOCK  # never below one request
