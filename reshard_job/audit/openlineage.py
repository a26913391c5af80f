"""Recorded runs as OpenLineage run events, so existing lineage tools (Marquez, DataHub, ...) show them.

Chosen: an *export* of what the database holds (``audit openlineage``, one event per line: the
format of OpenLineage's file transport), not an emitter inside the job. The database stays the one
record; an export can be taken at any time, of any runs, and replayed into any tool, and a job never
fails or waits because a lineage endpoint is down. The price is that a tool sees runs when they are
exported, not as they happen.

Mapping (OpenLineage 2-0-2): a run is a ``RunEvent`` with its UUID and final state (completed →
``COMPLETE``, failed → ``FAIL``, interrupted or abandoned → ``ABORT``, still started → ``RUNNING``);
the job is ``reshard_job`` / ``convert`` for a conversion, ``load`` for a load, and the consumer's
name for a recorded use; every file is a dataset named by the naming conventions (``file`` and the
absolute path; ``s3://bucket`` and the key), with a ``reshardJobContent`` facet carrying its sha256,
size, kind and rank: content identity is what joins our runs, and the standard facets have no
checksum. A copied output (``Event.copied``) is not listed as an output: the run did not make it.
"""

from __future__ import annotations

from typing import Any, Iterable

from reshard_job.audit.entities import FileUse, RunInfo, iso
from reshard_job.lineage.status import RunStatus

SCHEMA_URL = "https://openlineage.io/spec/2-0-2/OpenLineage.json#/$defs/RunEvent"
FACET_SCHEMA_URL = "https://openlineage.io/spec/2-0-2/OpenLineage.json#/$defs/DatasetFacet"
ERROR_FACET_SCHEMA_URL = ("https://openlineage.io/spec/facets/1-0-1/ErrorMessageRunFacet.json"
                          "#/$defs/ErrorMessageRunFacet")
PRODUCER = "https://pypi.org/project/reshard_job/"
NAMESPACE = "reshard_job"
EVENT_TYPES = {RunStatus.COMPLETED: "COMPLETE", RunStatus.FAILED: "FAIL", RunStatus.INTERRUPTED: "ABORT",
               RunStatus.ABANDONED: "ABORT", RunStatus.STARTED: "RUNNING"}


def dataset(f: FileUse, producer: str) -> dict[str, Any]:
    """A file as an OpenLineage dataset, with its content identity as a facet."""
    if "://" in f.path:
        scheme, _, rest = f.path.partition("://")
        bucket, _, key = rest.partition("/")
        namespace, name = f"{scheme}://{bucket}", key
    else:
        namespace, name = "file", f.path
    content = {"_producer": producer, "_schemaURL": FACET_SCHEMA_URL, "hashAlgorithm": f.hash_algo,
               "digest": f.digest, "size": f.size, "kind": f.kind, "rank": f.rank}
    return {"namespace": namespace, "name": name, "facets": {"reshardJobContent": content}}


def job_name(config: Any) -> str:
    if isinstance(config, dict) and isinstance(config.get("use"), dict):
        return str(config["use"].get("consumer") or "use")
    if isinstance(config, dict) and isinstance(config.get("load"), dict):
        return "load"
    return "convert"


def run_event(run: RunInfo, config: Any, files: Iterable[FileUse], tool_version: str) -> dict[str, Any]:
    """The OpenLineage ``RunEvent`` of one recorded run."""
    producer = f"{PRODUCER}{tool_version}"
    files = list(files)
    facets: dict[str, Any] = {}
    if run.error:
        facets["errorMessage"] = {"_producer": producer, "_schemaURL": ERROR_FACET_SCHEMA_URL,
                                  "message": run.error, "programmingLanguage": "python"}
    return {
        "eventType": EVENT_TYPES.get(run.status, "OTHER"),
        "eventTime": iso(run.ended_at or run.started_at),
        "run": {"runId": run.id, "facets": facets},
        "job": {"namespace": NAMESPACE, "name": job_name(config), "facets": {}},
        "inputs": [dataset(f, producer) for f in files if f.direction == "input"],
        "outputs": [dataset(f, producer) for f in files if f.direction == "output" and not f.copied],
        "producer": producer,
        "schemaURL": SCHEMA_URL,
    }
