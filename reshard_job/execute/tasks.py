"""The unit of work: one target file, as plain data that can be pickled and shipped anywhere.

A ``RankTask`` carries everything needed to produce one target rank's file: its slice of the
plan, where each source file it reads lives (paths or URLs) and what those files looked like
when the job hashed them, where to write, and how. Running it (``execute.run_rank_task``) needs
no configuration, database or job state, so the same object is run by the local process pool,
by the Python API, and by a Ray worker on another machine. It returns a ``RankResult``: plain
paths, sizes and digests that the driver journals and records.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from reshard_job.execute.writer_tap import PartialFingerprints
from reshard_job.plan.model import RankPlan
from reshard_job.storage import StorageOptions

FORMAT_CKPT = "ckpt"
FORMAT_SAFETENSORS = "safetensors"
OUTPUT_FORMATS = (FORMAT_CKPT, FORMAT_SAFETENSORS)  # formats of one target file
# the full model as size-bounded safetensors shards plus model.safetensors.index.json (export.py)
FORMAT_SAFETENSORS_INDEX = "safetensors_index"
TARGET_FORMATS = OUTPUT_FORMATS + (FORMAT_SAFETENSORS_INDEX,)


@dataclass(frozen=True)
class WriteOptions:
    format: str = FORMAT_CKPT  # "ckpt" | "safetensors"
    max_memory: int = 32 * 1024 * 1024  # bound on in-flight tensor buffers
    crc: bool = False  # MindSpore's CRC (ckpt trailer / safetensors crc_num)
    # safetensors __metadata__ to write instead of MindSpore's {"format": "ms"} (e.g. {"format": "pt"},
    # which transformers requires); None: the format's own
    metadata: dict[str, str] | None = field(default=None, hash=False)
    # fingerprint the tensors the rank counts from the bytes written (``execute.writer_tap``)
    fingerprints: bool = False


@dataclass(frozen=True)
class RankTask:
    target_rank: int
    plan: RankPlan
    sources: dict[int, str | tuple[str, ...]]  # source rank -> its file(s), path or URL (only ranks read)
    out_path: str
    options: WriteOptions = field(default_factory=WriteOptions)
    # source rank -> FileInfo.identity seen when the job hashed it; a source whose identity
    # differs when the task reads it has changed under the job, and the task fails
    source_identities: dict[int, tuple] = field(default_factory=dict)
    storage: StorageOptions = field(default_factory=StorageOptions)
    part: int | None = None  # which file of the target rank (an export's shard number); None: its only file
    # target.rename: the plan's new name -> the source files' name, for the renamed parameters it reads
    names: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RankResult:
    target_rank: int
    path: str
    size: int
    sha256: str
    tensors: dict[str, str]  # parameter name -> sha256 of its bytes
    bytes_read: int = 0
    seconds: float = 0.0
    host: str = ""  # the machine that wrote the file
    part: int | None = None  # as in the task
    # the partial fingerprints of the tensors this rank counts (``execute.writer_tap``); None: not
    # asked for, or not known (the job then reads the file back)
    fingerprints: PartialFingerprints | None = None
