"""The job's stages around ``convert``, run in its order, for tests of one stage on real files."""

from __future__ import annotations

from reshard_job.job.output.directory import OutputDir
from reshard_job.job.stages.convert import Outputs, convert
from reshard_job.job.stages.integrity import hash_sources
from reshard_job.job.stages.prepare import prepare
from reshard_job.job.stages.record import NoRecorder
from reshard_job.storage import storage_for


def convert_stages(spec, recorder=None, before_convert=lambda prepared: None) -> Outputs:
    """prepare, lock, hash, convert, unlock: the job's stages around convert, in its order."""
    recorder = recorder or NoRecorder()
    with prepare(spec.source, spec.target) as prepared:
        out = OutputDir(spec.output.dir, storage_for(spec.output.dir, spec.storage))
        out.lock()
        try:
            digests = hash_sources(prepared, use_cache=False, progress=False)
            before_convert(prepared)
            return convert(spec, prepared, out, digests, recorder)
        finally:
            out.unlock()
