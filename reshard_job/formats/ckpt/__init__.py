"""MindSpore `.ckpt` files: records (``records``), an indexing reader (``reader``) and a
streaming writer (``writer``)."""

from ..base import WrittenFile
from ..tensorfile import KIND_MAP, KIND_STR, KIND_TENSOR
from .reader import CheckpointReader, crc_of_file
from .records import CRC_MAGIC, CRC_TRAILER_LEN, SLICE_BYTES, Record, default_chunks, record_header
from .writer import CheckpointWriter, RecordSink

__all__ = [
    "CRC_MAGIC", "CRC_TRAILER_LEN", "CheckpointReader", "CheckpointWriter", "KIND_MAP", "KIND_STR", "KIND_TENSOR",
    "Record", "RecordSink", "SLICE_BYTES", "WrittenFile", "crc_of_file", "default_chunks", "record_header",
]
