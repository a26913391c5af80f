"""Pictures of a lineage: Graphviz DOT text, a standalone SVG, and one self-contained HTML page.

No external program is needed: DOT is plain text for those who have Graphviz; the SVG is drawn
here from ``graph.layered_layout``; the HTML embeds that SVG with a little CSS and an inline
script that shows a box's full details (paths, whole sha256, run id, error) on hover or click.
Nothing refers to anything outside the file (no fonts, scripts or images to fetch), so the page
works offline and from an archive years later. The output is deterministic: the same records
give the same bytes, which keeps pictures reviewable in version control.

Boxes: a run shows its short id, status, devices and start time, with a status-coloured band;
a file shows its name, its folder (the last two folders, more where two folders of the picture
would read alike), kind, rank(s), size and short sha256, coloured by what it is (checkpoint,
strategy, manifest). Names too long for a box lose their front, never their distinctive tail.
Where the walk started is outlined in pink. Every status and role has its own colour, at least
``MIN_COLOUR_DISTANCE`` apart in CIELAB from every other, so none is mistaken for another.
Edges follow the layout's routes: through the gaps between boxes, never under one.
"""

from __future__ import annotations

import json
import os
from html import escape
from typing import Any

from collections import Counter

from reshard_job.text import human_size, rank_ranges
from reshard_job.audit.graph import FileVertex, LineageGraph, Layout, RunVertex, layered_layout
from reshard_job.audit.entities import ANCESTORS
from reshard_job.audit.text_width import fit_from_front, text_width
from reshard_job.audit.render import SHORT_DIGEST, SHORT_RUN_ID, devices, kind_words, plural, when
from reshard_job.lineage.status import RunStatus

FORMATS = ("dot", "svg", "html")

BOX_WIDTH = 288
RUN_HEIGHT = 64  # three lines
FILE_HEIGHT = 80  # four lines: the name, its folder, what it is, its digest
TITLE_SPACE = 78  # heading and legend above the boxes
TEXT_LEFT = 16  # where a box's lines start; they end by TEXT_RIGHT short of its right side
TEXT_RIGHT = 10
NAME_SIZE = 12.5  # the first line's font size (bold); the others' is LINE_SIZE
LINE_SIZE = 11
FOLDER_PARTS = 2  # folders shown above a file's name, at least
ARROW_ROOM = 3  # an edge ends this far before its box: the arrow head's tip is there

FONT = "DejaVu Sans, Verdana, Helvetica, Arial, sans-serif"
MONO = "DejaVu Sans Mono, Menlo, Consolas, monospace"
INK = "#1f2933"
MUTED = "#52606d"
EDGE = "#9aa5b1"
SUBJECT = "#e64980"  # pink: no status or file class is near it

STATUS_COLOURS = {RunStatus.COMPLETED: "#2b8a3e", RunStatus.FAILED: "#e03131", RunStatus.INTERRUPTED: "#f76707",
                  RunStatus.ABANDONED: "#495057", RunStatus.STARTED: "#1098ad"}
# (fill, border) per file class
FILE_COLOURS = {"checkpoint": ("#e8eefd", "#4263eb"), "strategy": ("#f5ebf8", "#9c36b5"),
                "manifest": ("#f1f3f5", "#adb5bd")}
MIN_COLOUR_DISTANCE = 30.0  # CIE76 ΔE between any two of the colours above; 2.3 is just noticeable


def role_colours() -> dict[str, str]:
    """Every colour that says what a box is: run statuses, file classes (their border and band), the subject."""
    colours = {f"run {status}": colour for status, colour in STATUS_COLOURS.items()}
    colours.update({name: border for name, (_, border) in FILE_COLOURS.items()})
    colours["asked about"] = SUBJECT
    return colours


def file_class(vertex: FileVertex) -> str:
    kinds = " ".join(vertex.kinds)
    if "checkpoint" in kinds:
        return "checkpoint"
    if "strategy" in kinds:
        return "strategy"
    return "manifest"


def shorten(text: str, limit: int) -> str:
    """`text` cut from the front with an ellipsis when longer than `limit` characters: the tail (a
    file's rank, step and suffix; a folder's nearest parts) is what tells similar names apart."""
    if len(text) <= limit:
        return text
    return "…" + text[len(text) - (limit - 1):]


def _folder_parts(path: str) -> tuple[str, ...]:
    return tuple(path.replace(os.sep, "/").rstrip("/").split("/")[:-1])


def folder_labels(files: tuple[FileVertex, ...]) -> dict[str, str]:
    """Each file's folder as its box shows it: the last `FOLDER_PARTS` folders, more for a folder
    whose tail reads like another folder's of the same picture (``…/a/ckpt/rank_0/`` and
    ``…/b/ckpt/rank_0/``), the whole folder where it is no longer; '' for a file with no path."""
    folders = {v.key: _folder_parts(v.paths[0]) for v in files if v.paths}
    distinct = set(folders.values())
    shown: dict[tuple[str, ...], int] = {}
    parts = FOLDER_PARTS
    while len(shown) < len(distinct):
        tails = Counter(folder[-parts:] for folder in distinct)
        for folder in distinct - set(shown):
            if tails[folder[-parts:]] == 1 or parts >= len(folder):
                shown[folder] = parts
        parts += 1
    labels = {}
    for key, folder in folders.items():
        cut = shown[folder] < len(folder) and folder[:-shown[folder]] != ("",)  # not just the root's "/"
        text = ("…/" if cut else "") + "/".join(folder[-shown[folder]:] if cut else folder) + "/"
        labels[key] = fit_from_front(text, BOX_WIDTH - TEXT_LEFT - TEXT_RIGHT, LINE_SIZE) if folder else ""
    return labels


def _base_name(path: str | None) -> str:
    if not path:
        return "(no known path)"
    return path.replace(os.sep, "/").rstrip("/").rsplit("/", 1)[-1]


def file_lines(vertex: FileVertex, folder: str = "") -> tuple[str, str, str, str]:
    """Name, folder, 'kind · rank · size', 'sha256 <short>' (and how many paths, if several)."""
    name = fit_from_front(_base_name(vertex.paths[0] if vertex.paths else None), BOX_WIDTH - TEXT_LEFT - TEXT_RIGHT,
                          NAME_SIZE, bold=True)
    kinds = {kind_words(k) for k in vertex.kinds}
    parts = [kind_words(vertex.kinds[0]) if len(kinds) == 1 else file_class(vertex)]
    if vertex.ranks:
        parts.append(("rank " if len(vertex.ranks) == 1 else "ranks ") + rank_ranges(vertex.ranks))
    parts.append(human_size(vertex.size))
    digest = f"{vertex.hash_algo} {vertex.digest[:SHORT_DIGEST]}"
    if len(vertex.paths) > 1:
        digest += f" · {len(vertex.paths)} paths"
    return name, folder, " · ".join(parts), digest


def run_lines(vertex: RunVertex) -> tuple[str, str, str]:
    """'run <short id>', 'status · devices', start time."""
    run = vertex.run
    return (f"run {run.id[:SHORT_RUN_ID]}",
            f"{run.status} · {devices(run.source_devices, run.target_devices)} devices",
            f"{when(run.started_at)} UTC")


def file_details(vertex: FileVertex, direction: str) -> dict[str, Any]:
    path = vertex.paths[0] if vertex.paths else None
    details: dict[str, Any] = {"file": _base_name(path), "folder": os.path.dirname(path) if path else "-",
                               "kind": ", ".join(kind_words(k) for k in vertex.kinds)}
    if vertex.ranks:
        details["rank"] = rank_ranges(vertex.ranks)
    details["size"] = f"{human_size(vertex.size)} ({vertex.size} bytes)"
    details[vertex.hash_algo] = vertex.digest
    details["paths"] = "\n".join(vertex.paths) or "-"
    if vertex.subject:
        details["note"] = "the file asked about"
    elif vertex.end:
        details["note"] = ("original: no recorded run wrote it" if direction == ANCESTORS
                           else "final: no recorded run read it")
    return details


def run_details(vertex: RunVertex) -> dict[str, Any]:
    run = vertex.run
    details: dict[str, Any] = {"run": run.id, "status": str(run.status),
                               "devices": devices(run.source_devices, run.target_devices),
                               "started": f"{when(run.started_at)} UTC",
                               "ended": f"{when(run.ended_at)} UTC" if run.ended_at else "-",
                               "output dir": run.output_dir,
                               "by": f"{run.user or '?'} on {run.host}, reshard_job {run.tool_version}"}
    if run.sweep_id is not None:
        details["sweep"] = f"{run.sweep_id} job {'-' if run.job_num is None else run.job_num}"
    if run.error:
        details["error"] = run.error
    return details


def layout_of(graph: LineageGraph) -> Layout:
    files = {v.key for v in graph.files}
    return layered_layout(graph.keys, [(e.source, e.target) for e in graph.edges],
                          lambda key: (BOX_WIDTH, FILE_HEIGHT if key in files else RUN_HEIGHT), top=TITLE_SPACE)


# -- DOT -----------------------------------------------------------------------------------------

def _dot_text(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def to_dot(graph: LineageGraph) -> str:
    lines = [
        "digraph lineage {",
        f"  graph [rankdir=LR, label={_dot_text(graph.title)}, labelloc=t, fontname=\"Helvetica\", "
        f"nodesep=0.25, ranksep=0.6];",
        "  node [shape=box, style=\"rounded,filled\", fontname=\"Helvetica\", fontsize=10, penwidth=1.2];",
        f"  edge [color=\"{EDGE}\", arrowsize=0.7];",
    ]
    folders = folder_labels(graph.files)
    for vertex in graph.files:
        fill, border = FILE_COLOURS[file_class(vertex)]
        pen = f', penwidth=2.5, color="{SUBJECT}"' if vertex.subject else f', color="{border}"'
        tooltip = "\n".join(vertex.paths) + f"\n{vertex.hash_algo} {vertex.digest}"
        label = chr(10).join(line for line in file_lines(vertex, folders.get(vertex.key, "")) if line)
        lines.append(f"  {_dot_text(vertex.key)} [label={_dot_text(label)}, "
                     f"fillcolor=\"{fill}\"{pen}, tooltip={_dot_text(tooltip)}];")
    for vertex in graph.runs:
        colour = STATUS_COLOURS.get(vertex.run.status, MUTED)
        pen = f', penwidth=2.5, color="{SUBJECT}"' if vertex.subject else f', color="{colour}"'
        lines.append(f"  {_dot_text(vertex.key)} [label={_dot_text(chr(10).join(run_lines(vertex)))}, "
                     f"fillcolor=\"#ffffff\"{pen}, tooltip={_dot_text('run ' + vertex.run.id)}];")
    for edge in graph.edges:
        lines.append(f"  {_dot_text(edge.source)} -> {_dot_text(edge.target)};")
    lines.append("}")
    return "\n".join(lines) + "\n"


# -- SVG -----------------------------------------------------------------------------------------

def _number(value: float) -> str:
    text = f"{value:.1f}"
    return text[:-2] if text.endswith(".0") else text


def edge_path(layout: Layout, source: str, target: str) -> str:
    """SVG path data along the edge's route: straight where the route keeps its height (through a
    column, where no box is), an S-curve where it changes height (across the gap between two
    columns); the curve's control points lie between the waypoints' x, so the curve does too."""
    points = list(layout.routes[(source, target)])
    (x1, _), (x2, y2) = points[-2], points[-1]
    points[-1] = (x2 - ARROW_ROOM if x2 > x1 else x2 + ARROW_ROOM, y2)
    parts = [f"M{_number(points[0][0])},{_number(points[0][1])}"]
    for (x1, y1), (x2, y2) in zip(points, points[1:]):
        if y1 == y2:
            parts.append(f"L{_number(x2)},{_number(y2)}")
        else:
            middle = _number((x1 + x2) / 2)
            parts.append(f"C{middle},{_number(y1)} {middle},{_number(y2)} {_number(x2)},{_number(y2)}")
    return " ".join(parts)


def legend() -> tuple[list[str], float]:
    """The legend's SVG pieces, a swatch and a word for every file class, run status and the subject,
    and how wide they are together."""
    items = [(name, fill, border, "1") for name, (fill, border) in FILE_COLOURS.items()]
    items += [(f"run {status}", "#ffffff", STATUS_COLOURS[status], "2") for status in RunStatus]
    items.append(("asked about", "#ffffff", SUBJECT, "2.5"))
    parts, x = [], 0.0
    for label, fill, border, stroke in items:
        parts.append(f'<rect x="{_number(x)}" y="0" width="14" height="14" rx="3" fill="{fill}" stroke="{border}" '
                     f'stroke-width="{stroke}"/><text x="{_number(x + 20)}" y="11.5">{label}</text>')
        x += 20 + text_width(label, LINE_SIZE) + 18
    return parts, x - 18


def _box(key: str, layout: Layout, classes: str, lines: tuple[str, ...], band: str, fill: str, border: str,
         subject: bool, details: dict[str, Any]) -> str:
    """A box with a bold first line, then smaller lines; the last (a digest or a time) monospaced."""
    box = layout.boxes[key]
    title = "\n".join(f"{name}: {value}" for name, value in details.items())
    stroke = SUBJECT if subject else border
    width = "2.5" if subject else "1.2"
    first, *middle, last = (escape(text) for text in lines)
    texts = [f'<text x="{TEXT_LEFT}" y="21" font-size="{NAME_SIZE}" font-weight="600" fill="{INK}">{first}</text>']
    baseline = 21 + 18
    for text in middle:
        texts.append(f'<text x="{TEXT_LEFT}" y="{baseline}" font-size="{LINE_SIZE}" fill="{MUTED}">{text}</text>')
        baseline += 16
    texts.append(f'<text x="{TEXT_LEFT}" y="{baseline}" font-size="{LINE_SIZE}" font-family="{MONO}" '
                 f'fill="{MUTED}">{last}</text>')
    return (f'<g class="{classes}" id="{escape(key)}" transform="translate({_number(box.x)},{_number(box.y)})" '
            f"data-details='{escape(json.dumps(details, ensure_ascii=False), quote=True)}'>"
            f"<title>{escape(title)}</title>"
            f'<rect class="box" width="{box.width:g}" height="{box.height:g}" rx="8" fill="{fill}" '
            f'stroke="{stroke}" stroke-width="{width}"/>'
            f'<rect x="0.6" y="0.6" width="6" height="{box.height - 1.2:g}" rx="3" fill="{band}"/>'
            + "".join(texts) + "</g>")


def to_svg(graph: LineageGraph, layout: Layout | None = None) -> str:
    layout = layout or layout_of(graph)
    pieces, legend_width = legend()
    width = max(layout.width, 24 + legend_width + 24)
    height = layout.height
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_number(width)}" height="{_number(height)}" '
        f'viewBox="0 0 {_number(width)} {_number(height)}" font-family="{FONT}" role="img">',
        f"<title>{escape(graph.title)}</title>",
        f'<defs><marker id="arrow" viewBox="0 0 10 10" refX="8.5" refY="5" markerWidth="8" markerHeight="8" '
        f'orient="auto"><path d="M0,1 L9,5 L0,9 z" fill="{EDGE}"/></marker></defs>',
        '<rect width="100%" height="100%" fill="#ffffff"/>',
        f'<text class="heading" x="24" y="32" font-size="17" font-weight="600" fill="{INK}">'
        f"{escape(graph.title)}</text>",
        f'<g class="legend" transform="translate(24,46)" font-size="11" fill="{MUTED}">{"".join(pieces)}</g>',
        '<g class="edges">',
    ]
    for edge in graph.edges:
        # An edge closing a cycle (a round trip reproduced its source) runs backwards: dashed.
        back = (edge.source, edge.target) in layout.back_edges
        dashes = ' stroke-dasharray="5 4"' if back else ""
        out.append(f'<path class="edge{" back" if back else ""}" data-from="{escape(edge.source)}" '
                   f'data-to="{escape(edge.target)}" d="{edge_path(layout, edge.source, edge.target)}" fill="none" '
                   f'stroke="{EDGE}" stroke-width="1.4"{dashes} marker-end="url(#arrow)"/>')
    out.append("</g>")
    out.append('<g class="nodes">')
    folders = folder_labels(graph.files)
    for vertex in graph.files:
        fill, border = FILE_COLOURS[file_class(vertex)]
        classes = f"node file {file_class(vertex)}" + (" subject" if vertex.subject else "") + (
            " end" if vertex.end else "")
        out.append(_box(vertex.key, layout, classes, file_lines(vertex, folders.get(vertex.key, "")), border, fill,
                        border, vertex.subject,
                        file_details(vertex, graph.direction)))
    for vertex in graph.runs:
        colour = STATUS_COLOURS.get(vertex.run.status, MUTED)
        classes = f"node run {vertex.run.status}" + (" subject" if vertex.subject else "")
        out.append(_box(vertex.key, layout, classes, run_lines(vertex), colour, "#ffffff", colour, vertex.subject,
                        run_details(vertex)))
    out.append("</g>")
    out.append("</svg>")
    return "\n".join(out) + "\n"


# -- HTML ----------------------------------------------------------------------------------------

_STYLE = """
:root { color-scheme: light; }
body { margin: 0; font: 14px/1.45 DejaVu Sans, Verdana, Helvetica, Arial, sans-serif; color: #1f2933;
       background: #f5f7fa; }
header { padding: 14px 24px; background: #ffffff; border-bottom: 1px solid #e4e7eb; }
header h1 { margin: 0 0 2px; font-size: 18px; }
header p { margin: 0; color: #52606d; font-size: 13px; }
main { display: flex; gap: 16px; padding: 16px 24px; align-items: flex-start; }
.canvas { flex: 1; min-width: 0; overflow: auto; background: #ffffff; border: 1px solid #e4e7eb;
          border-radius: 8px; }
.canvas svg { display: block; max-width: 100%; height: auto; }
.canvas svg .heading { display: none; }  /* the page header says it */
aside { flex: 0 0 330px; background: #ffffff; border: 1px solid #e4e7eb; border-radius: 8px; padding: 12px 16px;
        position: sticky; top: 16px; }
aside h2 { margin: 0 0 8px; font-size: 15px; }
aside dl { margin: 0; display: grid; grid-template-columns: max-content 1fr; gap: 4px 10px; font-size: 12.5px; }
aside dt { color: #52606d; }
aside dd { margin: 0; overflow-wrap: anywhere; white-space: pre-wrap; font-family: DejaVu Sans Mono, Menlo, monospace; }
.node { cursor: pointer; }
.node:hover .box, .node.selected .box { stroke-width: 2.6; }
.edge.lit { stroke: #1c7ed6; stroke-width: 2.4; }
svg.focus .node:not(.lit) { opacity: 0.45; }
svg.focus .edge:not(.lit) { opacity: 0.25; }
"""

_SCRIPT = """
(function () {
  var svg = document.querySelector('.canvas svg');
  var fields = document.getElementById('fields');
  var heading = document.getElementById('details-heading');
  var selected = null;
  function show(node) {
    var details = JSON.parse(node.getAttribute('data-details'));
    heading.textContent = node.classList.contains('run') ? 'Run' : 'File';
    while (fields.firstChild) { fields.removeChild(fields.firstChild); }
    Object.keys(details).forEach(function (name) {
      var dt = document.createElement('dt'); dt.textContent = name;
      var dd = document.createElement('dd'); dd.textContent = details[name];
      fields.appendChild(dt); fields.appendChild(dd);
    });
    svg.classList.add('focus');
    svg.querySelectorAll('.lit').forEach(function (e) { e.classList.remove('lit'); });
    node.classList.add('lit');
    svg.querySelectorAll('.edge').forEach(function (edge) {
      var from = edge.getAttribute('data-from'), to = edge.getAttribute('data-to');
      if (from === node.id || to === node.id) {
        edge.classList.add('lit');
        [from, to].forEach(function (id) { var n = document.getElementById(id); if (n) { n.classList.add('lit'); } });
      }
    });
  }
  function clear() {
    if (selected) { show(selected); return; }
    svg.classList.remove('focus');
    svg.querySelectorAll('.lit').forEach(function (e) { e.classList.remove('lit'); });
  }
  svg.querySelectorAll('.node').forEach(function (node) {
    node.addEventListener('mouseenter', function () { show(node); });
    node.addEventListener('mouseleave', clear);
    node.addEventListener('click', function (event) {
      if (selected) { selected.classList.remove('selected'); }
      selected = selected === node ? null : node;
      if (selected) { selected.classList.add('selected'); show(node); } else { clear(); }
      event.stopPropagation();
    });
  });
})();
"""


def to_html(graph: LineageGraph, layout: Layout | None = None, *, tool_version: str = "") -> str:
    svg = to_svg(graph, layout)
    runs, files = len(graph.runs), len(graph.files)
    walk = "ancestry" if graph.direction == ANCESTORS else "descendants"
    summary = f"{walk}: {plural(runs, 'run')}, {plural(files, 'file content')}"
    if tool_version:
        summary += f" · drawn by reshard_job {escape(tool_version)}"
    return "\n".join([
        "<!DOCTYPE html>",
        '<html lang="en">',
        "<head>",
        '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{escape(graph.title)}</title>",
        f"<style>{_STYLE}</style>",
        "</head>",
        "<body>",
        f"<header><h1>{escape(graph.title)}</h1><p>{summary} · hover or click a box for its details</p></header>",
        "<main>",
        f'<div class="canvas">{svg}</div>',
        '<aside><h2 id="details-heading">Details</h2><dl id="fields"><dt>tip</dt>'
        "<dd>hover a box: its paths, whole sha256, run id and error appear here; click to keep them</dd></dl></aside>",
        "</main>",
        f"<script>{_SCRIPT}</script>",
        "</body>",
        "</html>",
    ]) + "\n"


def draw(graph: LineageGraph, fmt: str, *, tool_version: str = "") -> str:
    """`graph` as DOT, SVG or HTML text."""
    if fmt == "dot":
        return to_dot(graph)
    if fmt == "svg":
        return to_svg(graph)
    if fmt == "html":
        return to_html(graph, tool_version=tool_version)
    raise ValueError(f"unknown picture format {fmt!r} (expected one of {', '.join(FORMATS)})")
