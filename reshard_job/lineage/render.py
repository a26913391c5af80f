"""Human-readable text for the audit CLI: tables and trees built from ``queries`` results.

Pure string building, kept apart from the queries so that ``--json`` and text show exactly the
same facts. Digests are shortened in text (the JSON always has them whole); times are UTC.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Sequence

from ..text import human_size, rank_ranges, table

SHORT_DIGEST = 12


def short(digest: str | None) -> str:
    return "-" if not digest else digest[:SHORT_DIGEST]


def when(iso: str | None) -> str:
    """'2026-11-22T10:01:22.123+00:00' -> '2026-11-22 10:01:22'."""
    if not iso:
        return "-"
    return iso.replace("T", " ")[:19]


def devices(source: int | None, target: int | None) -> str:
    return f"{'?' if source is None else source}→{'?' if target is None else target}"


# -- runs ----------------------------------------------------------------------------------------

def runs_table(runs: list[dict[str, Any]]) -> str:
    if not runs:
        return "no runs"
    return table(
        ["RUN ID", "STARTED (UTC)", "STATUS", "DEVICES", "OUTPUT DIR"],
        [[r["id"], when(r["started_at"]), r["status"], devices(r["source_devices"], r["target_devices"]),
          r["output_dir"]] for r in runs],
    )


# -- show ----------------------------------------------------------------------------------------

def _files_table(files: list[dict[str, Any]]) -> str:
    if not files:
        return "  (none)"
    return table(["KIND", "RANK", "SIZE", "SHA256", "PATH"],
                 [[f["kind"], f["rank"], human_size(f["size"]), short(f["digest"]), f["path"]] for f in files],
                 indent="  ")


def run_details(details: dict[str, Any]) -> str:
    d = details
    fields = [
        ("status", d["status"]),
        ("started", f"{when(d['started_at'])} UTC"),
        ("ended", f"{when(d['ended_at'])} UTC" if d["ended_at"] else "-"),
        ("devices", devices(d["source_devices"], d["target_devices"])),
        ("output dir", d["output_dir"]),
        ("tool", f"reshard_job {d['tool_version']} on {d['host']} (user {d['user'] or '?'}, pid {d['pid']})"),
    ]
    if d.get("sweep_id") is not None or d.get("job_num") is not None:
        job = "-" if d.get("job_num") is None else d["job_num"]
        fields.append(("sweep", f"{d.get('sweep_id') or '-'} job {job}"))
    fields.append(("overrides", " ".join(d["overrides"]) or "(none)"))
    if d.get("error"):
        fields.append(("error", d["error"]))
    lines = [f"run {d['id']}"] + [f"  {name:<11} {value}" for name, value in fields]
    lines.append("config:")
    lines += ["  " + line for line in json.dumps(d["config"], indent=2, sort_keys=True).splitlines()]
    lines.append(f"inputs ({len(d['inputs'])}):")
    lines.append(_files_table(d["inputs"]))
    lines.append(f"outputs ({len(d['outputs'])}):")
    lines.append(_files_table(d["outputs"]))
    lines.append(f"rank map ({len(d['rank_map'])} target ranks):")
    if d["rank_map"]:
        lines.append(table(["TARGET", "SOURCE RANKS", "READ", "WRITTEN"],
                           [[r["target_rank"], rank_ranges(r["source_ranks"]), human_size(r["bytes_read"]),
                             human_size(r["bytes_written"])] for r in d["rank_map"]], indent="  "))
    else:
        lines.append("  (none)")
    return "\n".join(lines)


# -- trace ---------------------------------------------------------------------------------------

def _node_label(node: dict[str, Any]) -> str:
    rank = "" if node.get("rank") is None else f" rank {node['rank']}"
    original = "  (original)" if node.get("original") else ""
    return f"{node.get('path') or '(no known path)'}  [{node['role']}{rank}, {human_size(node['size'])}]  " \
           f"sha256 {short(node['digest'])}{original}"


def _hop_lines(hop: dict[str, Any]) -> list[str]:
    head = (f"run {hop['run_id']}  {hop['status']}  {when(hop['started_at'])} UTC  "
            f"{devices(hop['source_devices'], hop['target_devices'])} devices")
    if hop["expanded_elsewhere"]:
        return [head + "  (inputs shown above)"]
    sources = hop["source_checkpoints"]
    lines = [head, f"source checkpoints: {len(sources)} file{'s' if len(sources) != 1 else ''}"
                   f" (ranks {rank_ranges(f['rank'] for f in sources)})"]
    for f in hop["strategy_files"]:
        arrow = "read " if f["direction"] == "input" else "wrote"
        lines.append(f"{f['kind']} ({arrow}): {f['path']}  sha256 {short(f['digest'])}")
    return lines


def _tree(node: dict[str, Any], prefix: str, out: list[str]) -> None:
    hops = node["produced_by"]
    for h_index, hop in enumerate(hops):
        last_hop = h_index == len(hops) - 1
        hop_lines = _hop_lines(hop)
        out.append(prefix + ("└── " if last_hop else "├── ") + "produced by " + hop_lines[0])
        inner = prefix + ("    " if last_hop else "│   ")
        for extra in hop_lines[1:]:
            out.append(inner + ("│ " if hop["inputs"] else "  ") + extra)
        for i_index, child in enumerate(hop["inputs"]):
            last_input = i_index == len(hop["inputs"]) - 1
            out.append(inner + ("└── " if last_input else "├── ") + _node_label(child))
            _tree(child, inner + ("    " if last_input else "│   "), out)


def trace_tree(result: dict[str, Any]) -> str:
    root = result["root"]
    out = [_node_label(root)]
    note = result.get("query", {}).get("note")
    if note:
        out.append(f"({note})")
    _tree(root, "", out)
    originals = result["original_sources"]
    by_kind: dict[str, int] = {}
    for f in originals:
        by_kind[f["kind"]] = by_kind.get(f["kind"], 0) + 1
    kinds = ", ".join(f"{n} {kind.replace('_', ' ')}{'s' if n != 1 else ''}" for kind, n in by_kind.items())
    runs = len(result["runs"])
    out.append(f"{runs} run{'s' if runs != 1 else ''} in the ancestry; "
               f"{len(originals)} original file{'s' if len(originals) != 1 else ''}" + (f": {kinds}" if kinds else ""))
    return "\n".join(out)


# -- verify --------------------------------------------------------------------------------------

def _file_state_line(f: dict[str, Any]) -> str:
    state = f["state"]
    label = "ok" if state == "ok" else state.upper()
    line = f"  {label:<10} {f['path']}"
    if state == "changed":
        line += (f"  (recorded sha256 {short(f['expected_sha256'])}, {f['expected_size']} bytes; "
                 f"now {'sha256 ' + short(f['actual_sha256']) if f['actual_sha256'] else f.get('detail', '?')}, "
                 f"{f['actual_size']} bytes)")
    elif state == "unreadable":
        line += f"  ({f.get('detail') or 'cannot read'})"
    return line


def verify_report(report: dict[str, Any]) -> str:
    subject = f"run {report['run_id']} ({report['run_status']})" if report["run_id"] else report["path"]
    problems = [f"{report[s]} {s}" for s in ("changed", "missing", "unreadable") if report[s]]
    if report["intact"]:
        head = f"{subject}: all {report['checked']} file{'s' if report['checked'] != 1 else ''} intact"
    else:
        head = f"{subject}: {report['checked']} checked, {report['ok']} ok, " + ", ".join(problems)
    lines = [head] + [_file_state_line(f) for f in report["files"]]
    return "\n".join(lines)
