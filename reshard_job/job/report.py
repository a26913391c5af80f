"""Human-readable reports: the plan table (``job.mode=plan``) and the end-of-run summary."""

from __future__ import annotations

from ..plan import Plan
from .progress import human_bytes


def _ranges(values: list[int]) -> str:
    out, vals, i = [], sorted(set(values)), 0
    while i < len(vals):
        j = i
        while j + 1 < len(vals) and vals[j + 1] == vals[j] + 1:
            j += 1
        out.append(str(vals[i]) if i == j else f"{vals[i]}-{vals[j]}")
        i = j + 1
    return ",".join(out) or "-"


def table(headers: list[str], rows: list[list[str]], align_right: set[int] | None = None) -> str:
    align_right = align_right or set()
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def fmt(cells):
        return "  ".join(c.rjust(w) if i in align_right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([fmt(headers), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows])


def plan_report(plan: Plan, *, predicted_peak: int, missing: dict[int, list[int]] | None = None) -> str:
    rows = []
    for rp in plan.ranks:
        rows.append([str(rp.target_rank), _ranges(rp.source_ranks), str(len(rp.params)),
                     human_bytes(rp.bytes_read), human_bytes(rp.bytes_written), human_bytes(rp.largest_slice)])
    totals = plan.to_json()["totals"]
    lines = [
        f"Plan: {plan.source['devices']} source rank(s) ({plan.source['stages']} stage(s) x {plan.source['stage_devices']})"
        f" -> {plan.target['devices']} target rank(s) ({plan.target['stages']} stage(s) x {plan.target['stage_devices']})",
        "",
        table(["target rank", "source ranks", "params", "read", "write", "largest slice"], rows, {2, 3, 4, 5}),
        "",
        f"Totals: read {human_bytes(totals['bytes_read'])} from {totals['source_ranks_read']} source file(s), "
        f"write {human_bytes(totals['bytes_written'])} to {totals['target_ranks']} file(s); "
        f"largest slice {human_bytes(totals['largest_slice'])}",
        f"Predicted peak memory per worker: {human_bytes(predicted_peak)} of tensor buffers",
    ]
    if plan.omitted:
        lines.append(f"Omitted ({len(plan.omitted)}): " + ", ".join(o["name"] for o in plan.omitted[:8])
                     + (" ..." if len(plan.omitted) > 8 else ""))
        lines.append(f"  reason: {plan.omitted[0]['reason']}")
    for note in plan.notes:
        lines.append(f"Note: {note}")
    if missing:
        lines.append("Missing source files: " + "; ".join(
            f"rank {r} (needed by target ranks {_ranges(t)})" for r, t in sorted(missing.items())))
    else:
        lines.append("Missing source files: none")
    return "\n".join(lines)
