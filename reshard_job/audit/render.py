"""Human-readable text for the audit CLI: tables and trees built from read-side entities.

Pure string building, kept apart from the queries so that ``--json`` and text show exactly the
same facts. Digests are shortened to ``SHORT_DIGEST`` characters in text (the JSON always has
them whole; the audit accepts the short form back); times are UTC. Pictures are in ``drawing``.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import TYPE_CHECKING, Iterable

from reshard_job.text import human_size, rank_ranges, table
from reshard_job.audit.entities import ANCESTORS, FileUse, RunDetails, RunInfo, iso

if TYPE_CHECKING:  # the walkers import SQLAlchemy; printing does not need it
    from reshard_job.audit.queries import FingerprintSummary, ShownRun
    from reshard_job.audit.trace import Trace, TraceHop, TraceNode
    from reshard_job.audit.verify import FileCheck, FingerprintCheck, VerifyReport

SHORT_DIGEST = 12
SHORT_RUN_ID = 8
# Parameters listed one a line under a failed fingerprint check, per kind of failure; the JSON has them all.
LISTED_PARAMETERS = 20


def short(digest: str | None) -> str:
    return "-" if not digest else digest[:SHORT_DIGEST]


def when(moment) -> str:
    """A datetime or ISO text as '2026-11-22 10:01:22' (UTC)."""
    text = moment if isinstance(moment, str) or moment is None else iso(moment)
    if not text:
        return "-"
    return text.replace("T", " ")[:19]


def devices(source: int | None, target: int | None) -> str:
    return f"{'?' if source is None else source}→{'?' if target is None else target}"


def plural(count: int, noun: str) -> str:
    """'1 strategy', '2 strategies', '3 source checkpoints'."""
    if count == 1:
        return f"1 {noun}"
    if noun.endswith("y") and noun[-2:-1] not in ("a", "e", "i", "o", "u"):
        return f"{count} {noun[:-1]}ies"
    return f"{count} {noun}s"


def kind_words(kind: str) -> str:
    return kind.replace("_", " ")


def count_by_kind(kinds: Iterable[str]) -> str:
    """'8 source checkpoints, 1 strategy' (in order of first appearance)."""
    counts = Counter(kinds)
    return ", ".join(plural(n, kind_words(kind)) for kind, n in counts.items())


# -- runs ----------------------------------------------------------------------------------------

def runs_table(runs: list[RunInfo]) -> str:
    if not runs:
        return "no runs"
    return table(
        ["RUN ID", "STARTED (UTC)", "STATUS", "DEVICES", "OUTPUT DIR"],
        [[r.id, when(r.started_at), r.status, devices(r.source_devices, r.target_devices), r.output_dir]
         for r in runs],
    )


# -- show ----------------------------------------------------------------------------------------

COPY_NOTE = "  (copy of an input)"  # bytes the run copied, not made: they link no runs


def _source_ranks(entry) -> str:
    return rank_ranges(entry.source_ranks) if entry.unreadable is None else f"unreadable: {entry.unreadable}"


def _files_table(files: Iterable[FileUse]) -> str:
    files = list(files)
    if not files:
        return "  (none)"
    return table(["KIND", "RANK", "SIZE", "SHA256", "PATH"],
                 [[f.kind, f.rank, human_size(f.size), short(f.digest), f.path + (COPY_NOTE if f.copied else "")]
                  for f in files], indent="  ")


def fingerprint_counts(summary: FingerprintSummary) -> str:
    """'51 source, 51 target, all equal (poslin64x2-v1)', or what else was recorded."""
    if not summary.recorded:
        return "none recorded (a run from before fingerprints were kept)"
    if summary.loaded and not summary.source + summary.target:
        return f"{summary.loaded} loaded, each the share its rank holds ({summary.algorithm})"
    if not summary.target:
        return f"{summary.source} source, outputs not read back ({summary.algorithm})"
    differ = len(summary.mismatches)
    equal = "all equal" if summary.equal else f"{differ} differ{'s' if differ == 1 else ''}"
    return f"{summary.source} source, {summary.target} target, {equal} ({summary.algorithm})"


def shown_run(shown: ShownRun) -> str:
    return run_details(shown.details, fingerprints=shown.fingerprints)


def run_details(details: RunDetails, fingerprints: FingerprintSummary | None = None) -> str:
    run = details.run
    fields = [
        ("status", run.status),
        ("started", f"{when(run.started_at)} UTC"),
        ("ended", f"{when(run.ended_at)} UTC" if run.ended_at else "-"),
        ("devices", devices(run.source_devices, run.target_devices)),
        ("output dir", run.output_dir),
        ("tool", f"reshard_job {run.tool_version} on {run.host} (user {run.user or '?'}, pid {run.pid})"),
    ]
    if run.sweep_id is not None or run.job_num is not None:
        fields.append(("sweep", f"{run.sweep_id or '-'} job {'-' if run.job_num is None else run.job_num}"))
    if fingerprints is not None:
        fields.append(("fingerprints", fingerprint_counts(fingerprints)))
    fields.append(("overrides", " ".join(details.overrides) or "(none)"))
    if run.error:
        fields.append(("error", run.error))
    lines = [f"run {run.id}"] + [f"  {name:<12} {value}" for name, value in fields]
    lines.append("config:")
    lines += ["  " + line for line in json.dumps(details.config, indent=2, sort_keys=True).splitlines()]
    lines.append(f"inputs ({len(details.inputs)}):")
    lines.append(_files_table(details.inputs))
    lines.append(f"outputs ({len(details.outputs)}):")
    lines.append(_files_table(details.outputs))
    lines.append(f"rank map ({len(details.rank_map)} target ranks):")
    if details.rank_map:
        lines.append(table(["TARGET", "SOURCE RANKS", "READ", "WRITTEN"],
                           [[r.target_rank, _source_ranks(r), human_size(r.bytes_read), human_size(r.bytes_written)]
                            for r in details.rank_map], indent="  "))
    else:
        lines.append("  (none)")
    return "\n".join(lines)


# -- trace ---------------------------------------------------------------------------------------

def _node_label(node: TraceNode, direction: str) -> str:
    rank = "" if node.rank is None else f" rank {node.rank}"
    end = ""
    if node.is_end:
        end = "  (original)" if direction == ANCESTORS else "  (final)"
    return (f"{node.path or '(no known path)'}  [{node.role}{rank}, {human_size(node.artifact.size)}]  "
            f"sha256 {short(node.artifact.digest)}{end}")


def _hop_lines(hop: TraceHop, direction: str) -> list[str]:
    run = hop.run
    head = (f"run {run.id}  {run.status}  {when(run.started_at)} UTC  "
            f"{devices(run.source_devices, run.target_devices)} devices")
    if hop.expanded_elsewhere:
        return [head + "  (shown above)"]
    sources = hop.source_checkpoints
    lines = [head, f"source checkpoints: {plural(len(sources), 'file')} (ranks {rank_ranges(f.rank for f in sources)})"]
    for f in hop.strategy_files:
        arrow = "read " if f.direction == "input" else "wrote"
        lines.append(f"{f.kind} ({arrow}): {f.path}  sha256 {short(f.digest)}")
    if direction != ANCESTORS:
        outputs = [f for f in hop.files if f.direction == "output"]
        lines.append(f"outputs: {count_by_kind(f.kind for f in outputs) or 'none recorded'}")
    return lines


FOLD_AT = 160  # characters of indentation at most: deeper levels are drawn from the left again


def _tree(node: TraceNode, prefix: str, direction: str, out: list[str], level: int = 1) -> None:
    """`node`'s hops and, below each, the files they link to, `prefix` before each line. A chain of
    thousands of conversions indented at every level took 48 MB of spaces for 2,000: past ``FOLD_AT``
    a line says so and the levels below start again at the left margin."""
    if len(prefix) > FOLD_AT:
        out.append(f"┆ (level {level} of the tree: what lies below it is drawn from the left margin again)")
        prefix = ""
    verb = "produced by " if direction == ANCESTORS else "used by "
    for h_index, hop in enumerate(node.hops):
        last_hop = h_index == len(node.hops) - 1
        hop_lines = _hop_lines(hop, direction)
        out.append(prefix + ("└── " if last_hop else "├── ") + verb + hop_lines[0])
        inner = prefix + ("    " if last_hop else "│   ")
        for extra in hop_lines[1:]:
            out.append(inner + ("│ " if hop.next else "  ") + extra)
        _children(hop, inner, direction, out, level)


def _children(hop: TraceHop, prefix: str, direction: str, out: list[str], level: int = 0) -> None:
    for index, child in enumerate(hop.next):
        last = index == len(hop.next) - 1
        out.append(prefix + ("└── " if last else "├── ") + _node_label(child, direction))
        _tree(child, prefix + ("    " if last else "│   "), direction, out, level + 1)


def trace_tree(result: Trace) -> str:
    direction = result.direction
    out: list[str] = []
    query = result.query
    if "manifest" in query:
        out.append(f"{query['path']}: {plural(len(result.roots), 'file')} listed in its manifest")
    if query.get("note"):
        out.append(f"({query['note']})")
    if result.subject_run is not None and not result.roots:
        hop_lines = _hop_lines(result.subject_run, direction)
        out += [hop_lines[0]] + ["  " + line for line in hop_lines[1:]]
        _children(result.subject_run, "", direction, out)
    for root in result.roots:
        out.append(_node_label(root, direction))
        _tree(root, "", direction, out)
    runs = len(result.runs)
    ends = result.ends
    kinds = count_by_kind(end.kind for end in ends)
    if direction == ANCESTORS:
        out.append(f"{plural(runs, 'run')} in the ancestry; {plural(len(ends), 'original file')}"
                   + (f": {kinds}" if kinds else ""))
    else:
        out.append(f"{plural(runs, 'run')} built on it; {plural(len(ends), 'final file')}"
                   + (f": {kinds}" if kinds else "") + (" (read by no recorded run)" if ends else ""))
    return "\n".join(out)


# -- verify --------------------------------------------------------------------------------------

def _file_state_line(f: FileCheck) -> str:
    label = "ok" if f.state == "ok" else f.state.upper()
    line = f"  {label:<10} {f.path}"
    if f.state == "changed":
        now = f"sha256 {short(f.actual_sha256)}" if f.actual_sha256 else (f.detail or "?")
        line += (f"  (recorded sha256 {short(f.expected_sha256)}, {f.expected_size} bytes; "
                 f"now {now}, {f.actual_size} bytes)")
    elif f.state in ("unreadable", "unrecorded", "unlisted"):
        line += f"  ({f.detail or f.state})"
    return line


def verify_report(report: VerifyReport) -> str:
    if report.path is not None and report.run_id is not None:
        subject = f"{report.path} (run {report.run_id}, {report.run_status})"
    elif report.run_id is not None:
        subject = f"run {report.run_id} ({report.run_status})"
    elif report.sha256 is not None:
        subject = f"sha256 {report.sha256}"
    else:
        subject = report.path
    checked = len(report.files)
    if report.files_intact:
        head = f"{subject}: all {checked} file{'s' if checked != 1 else ''} intact"
    elif report.complete_unrecorded:
        intact = report.count("ok")
        head = f"{subject}: complete, not recorded: rerun to record ({intact} file{'s' if intact != 1 else ''} intact)"
    else:
        problems = [f"{report.count(state)} {state}" for state in ("changed", "missing", "unreadable", "unrecorded",
                                                                    "unlisted")
                    if report.count(state)]
        head = f"{subject}: {checked} checked, {report.count('ok')} ok, " + ", ".join(problems)
    check = report.fingerprints
    if check is not None and not check.ok:
        names = {name for problem in check.problems for name in problem.names}
        head += f"; fingerprints of {plural(len(names), 'parameter')} disagree" if names else "; fingerprints disagree"
    return "\n".join([head] + [_file_state_line(f) for f in report.files] + _fingerprint_lines(check))


def _fingerprint_lines(check: FingerprintCheck | None) -> list[str]:
    if check is None:
        return []
    lines = [f"  fingerprints: {fingerprint_counts(check.summary)}"]
    differ = [m for m in check.summary.mismatches if m.source is not None]
    unsourced = [m for m in check.summary.mismatches if m.source is None]
    lines += _listed([f"  {'DIFFERS':<10} {m.name}  (output {short(m.target)}, source {short(m.source)})"
                      for m in differ])
    lines += _listed([f"  {'NO SOURCE':<10} {m.name}  (output {short(m.target)}, no source fingerprint)"
                      for m in unsourced])
    for manifest in check.manifests:
        how_many = f"{plural(len(manifest.differ), 'parameter')} " if manifest.differ else ""
        said = {"agrees": "the same as recorded", "none": "none listed", "unreadable": "not read",
                "disagrees": f"{how_many}listed otherwise than recorded"}
        detail = f" ({manifest.detail})" if manifest.detail else ""
        lines.append(f"  fingerprints in {manifest.path}: {said.get(manifest.state, manifest.state)}{detail}")
        if manifest.state == "disagrees":
            lines += _listed([f"  {'MANIFEST':<10} {name}" for name in manifest.differ])
    return lines


def _listed(lines: list[str]) -> list[str]:
    if len(lines) <= LISTED_PARAMETERS:
        return lines
    return lines[:LISTED_PARAMETERS] + [f"  ... and {len(lines) - LISTED_PARAMETERS} more (--json lists them all)"]
