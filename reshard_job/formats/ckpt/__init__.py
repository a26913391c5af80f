"""MindSpore `.ckpt` files: records (``records``), an indexing reader (``reader``) and a
streaming writer (``writer``)."""

from reshard_job.formats.base import WrittenFile
from reshard_job.formats.tensorfile import KIND_MAP, KIND_STR, KIND_TENSOR
from reshard_job.formats.ckpt.reader import CheckpointReader, crc_of_file
from reshard_job.formats.ckpt.records import CRC_MAGIC, CRC_TRAILER_LEN, SLICE_BYTES, Record, default_chunks, record_header
from reshard_job.formats.ckpt.writer import CheckpointWriter, RecordSink

__all__ = [
    "CRC_MAGIC", "CRC_TRAILER_LEN", "CheckpointReader", "CheckpointWriter", "KIND_MAP", "KIND_STR", "KIND_TENSOR",
    "Record", "RecordSink", "SLICE_BYTES", "WrittenFile", "crc_of_file", "default_chunks", "record_header",
]
