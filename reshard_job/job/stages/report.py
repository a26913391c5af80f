"""Human-readable reports: the plan table (``job.mode=plan``) and the end-of-run summary."""

from __future__ import annotations

from reshard_job.plan.model import Plan
from reshard_job.text import human_size, one_line_of, rank_ranges, table
from reshard_job.formats.manifest_file import MANIFEST_FILE


def plan_report(plan: Plan, *, predicted_peak: int, missing: dict[int, list[int]] | None = None,
                source_files: dict[int, str | tuple[str, ...]] | None = None, checks: list[str] = ()) -> str:
    rows = []
    for rp in plan.ranks:
        rows.append([str(rp.target_rank), rank_ranges(rp.source_ranks), str(len(rp.params)),
                     human_size(rp.bytes_read), human_size(rp.bytes_written), human_size(rp.largest_slice)])
    totals = plan.totals()
    lines = [
        f"Plan: {plan.source['devices']} source rank(s) ({plan.source['stages']} stage(s) x {plan.source['stage_devices']})"
        f" -> {plan.target['devices']} target rank(s) ({plan.target['stages']} stage(s) x {plan.target['stage_devices']})",
        "",
        table(["target rank", "source ranks", "params", "read", "write", "largest slice"], rows,
              align_right={2, 3, 4, 5}),
        "",
        f"Totals: read {human_size(totals['bytes_read'])} from {totals['source_ranks_read']} source file(s), "
        f"write {human_size(totals['bytes_written'])} to {totals['target_ranks']} file(s); "
        f"largest slice {human_size(totals['largest_slice'])}",
        f"Predicted peak memory per worker: {human_size(predicted_peak)} of tensor buffers",
    ]
    if plan.omitted:
        lines.append(f"Omitted ({len(plan.omitted)}): " + ", ".join(o["name"] for o in plan.omitted[:8])
                     + (" ..." if len(plan.omitted) > 8 else ""))
        lines.append(f"  reason: {plan.omitted[0]['reason']}")
    for note in plan.notes:
        lines.append(f"Note: {note}")
    if source_files:
        shown = [f"rank {r}: {_names(p)}" for r, p in sorted(source_files.items())[:8]]
        more = f", ... ({len(source_files)} ranks)" if len(source_files) > 8 else ""
        lines.append("Source files: " + ", ".join(shown) + more)
    for check in checks:
        lines.append(f"Checked: {check}")
    if missing:
        lines.append("Missing source files: " + "; ".join(
            f"rank {r} (needed by target ranks {rank_ranges(t)})" for r, t in sorted(missing.items())))
    else:
        lines.append("Missing source files: none")
    return "\n".join(lines)


def _names(paths: str | tuple[str, ...]) -> str:
    """A rank's file name, or ``{a, b}`` for the files read together as one rank."""
    def name(p: str) -> str:
        return p.rstrip("/").rsplit("/", 1)[-1]

    return name(paths) if isinstance(paths, str) else "{" + ", ".join(name(p) for p in paths) + "}"


def run_summary(result) -> str:
    """What a finished job prints on stdout: status, where the outputs are, how to audit them."""
    if not result.output_dir:
        return ""
    out = one_line_of(result.output_dir)  # one line each, whatever the folder's name holds (a newline)
    lines = [f"{result.status}: outputs in {out}"]
    lines.append(f"  manifest: {out.rstrip('/')}/{MANIFEST_FILE} (file sha256 {result.manifest_sha256})")
    if result.run_id:
        url = one_line_of(str(result.lineage_url))
        db = f" --db '{url}'" if getattr(result, "lineage_url", None) else ""
        lines.append(f"  lineage run {result.run_id} in {url}: "
                     f"python -m reshard_job.audit{db} show {result.run_id}")
    if getattr(result, "nodes", None):
        from reshard_job.job.run.throughput import from_json, render

        lines += ["  per Ray node:"] + ["    " + line for line in render(from_json(result.nodes)).splitlines()]
    return "\n".join(lines)
