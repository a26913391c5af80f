"""``manifest.json``: what a conversion read and wrote, by content, and its own hash.

Written last into the output directory, it is both the record a user can keep with the files
(config, every source and strategy file with size and sha256, every output file with size and
sha256, per-tensor sha256, per-parameter fingerprints) and the commit marker of the directory. ``manifest_sha256`` is the
sha256 of the canonical JSON (sorted keys, no whitespace) of everything else in it, so the
manifest can be checked on its own.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json

from reshard_job.jsonchunks import iter_json, plain

MANIFEST_VERSION = 1


def canonical_json(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=plain).encode("utf-8")


def manifest_digest(manifest: dict) -> str:
    """sha256 of ``canonical_json`` of the manifest without its own digest, hashed piece by piece
    (a manifest of a million per-tensor digests is hundreds of MB as one string)."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    h = hashlib.sha256()
    for piece in iter_json(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False):
        h.update(piece.encode("utf-8"))
    return h.hexdigest()


def job_fingerprint(*, source_files: list[dict], source_strategy: dict | None, target_strategy_sha256: str | None,
                    target: dict) -> str:
    """Identity of a conversion for resume and idempotence: same inputs by content, same target."""
    key = {
        "source": sorted((f["rank"], f["sha256"]) for f in source_files),
        "source_strategy": None if source_strategy is None else
        sorted(f["sha256"] for f in source_strategy.get("files", [source_strategy])),
        "target_strategy": target_strategy_sha256,
        "target": target,
    }
    return hashlib.sha256(canonical_json(key)).hexdigest()


def build_manifest(*, run_id: str, tool_version: str, fingerprint: str, config: dict, source: dict,
                   target: dict, tensors: dict, plan_summary: dict, checks: list[str] = (),
                   node: str | None = None, fingerprints: dict | None = None,
                   selection: dict | None = None) -> dict:
    """The manifest of a conversion; with `node`, of the files one target node holds
    (``output.placement=per_node``: ``target.files`` and ``tensors`` are then that node's)."""
    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "run_id": run_id,
        "tool_version": tool_version,
        "created_at": dt.datetime.now(dt.timezone.utc).isoformat(),
        "fingerprint": fingerprint,
        "config": config,
        "source": source,
        "target": target,
        "plan": plan_summary,
        "checks": list(checks),  # the cross-checks of the inputs that passed before anything was written
        "digest_algorithm": "sha256",  # of files and of tensors
        "tensors": tensors,
    }
    if selection is not None:  # target.include/exclude/rename (``plan.selection``)
        manifest["selection"] = selection
    if fingerprints is not None:  # per parameter, layout-independent (``job.stages.proof``)
        manifest["fingerprints"] = fingerprints
    if node is not None:
        manifest["node"] = node
    manifest["manifest_sha256"] = manifest_digest(manifest)
    return manifest
