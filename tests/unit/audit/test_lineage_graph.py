"""Lineage pictures: the graph of a two-hop lineage, drawn as DOT, SVG and HTML, and the HTML
rendered by a real headless browser.

The browser is Debian's ``chromium``; where it is not installed that one test is skipped with a
loud reason (and a line in the run's summary), as the PostgreSQL tests are.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import xml.etree.ElementTree as ElementTree

import pytest

from reshard_job.audit import main
from reshard_job.text import human_size
from reshard_job.lineage import LineageStore
from reshard_job.audit.drawing import FILE_COLOURS, to_dot, to_html, to_svg
from reshard_job.audit.entities import DESCENDANTS
from reshard_job.audit.graph import file_key, graph_of, run_key
from reshard_job.audit.trace import trace_reference

SVG = "{http://www.w3.org/2000/svg}"
BROWSERS = ("chromium", "chromium-browser")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, record_lineage):
    root = tmp_path_factory.mktemp("graph")
    url = f"sqlite:///{root / 'lineage.db'}"
    store = LineageStore(url)
    store.ensure_schema()
    lineage = record_lineage(store, root / "files")
    yield store, lineage, root
    store.close()


@pytest.fixture(scope="module")
def ancestry(recorded):
    store, lineage, _ = recorded
    with store.read_session() as session:
        return graph_of(trace_reference(session, lineage.final.path), "Lineage of the final checkpoint")


def _expected_edges(lineage) -> set[tuple[str, str]]:
    run_a, run_b = run_key(lineage.run_a), run_key(lineage.run_b)
    inputs_a = {file_key(f.sha256) for f in lineage.sources + [lineage.source_strategy]}
    read_by_b = {file_key(f.sha256) for f in lineage.outputs_a[:5]}  # four checkpoints (one copied), strategy
    return ({(f, run_a) for f in inputs_a} | {(run_a, f) for f in read_by_b} | {(f, run_b) for f in read_by_b}
            | {(run_b, file_key(lineage.final.sha256))})


def test_the_graph_of_a_two_hop_ancestry(ancestry, recorded):
    _, lineage, _ = recorded
    assert [v.run.id for v in ancestry.runs] == [lineage.run_a, lineage.run_b]
    assert len(ancestry.files) == 8 + 1 + 5 + 1
    assert {(e.source, e.target) for e in ancestry.edges} == _expected_edges(lineage)
    # A's rank-0 output, copied and read by B: one content, both paths, written and read.
    copied = next(v for v in ancestry.files if v.digest == lineage.copied.sha256)
    assert set(copied.paths) == {lineage.outputs_a[0].path, lineage.copied.path}
    assert set(copied.kinds) == {"target_checkpoint", "source_checkpoint"} and copied.ranks == (0,)
    subject = [v for v in ancestry.files if v.subject]
    assert [v.digest for v in subject] == [lineage.final.sha256]
    originals = {f.sha256 for f in lineage.sources + [lineage.source_strategy]}
    assert {v.digest for v in ancestry.files if v.end} == originals


def _svg_nodes(root) -> dict[str, ElementTree.Element]:
    return {g.get("id"): g for g in root.iter(f"{SVG}g") if "node" in (g.get("class") or "").split()}


def test_svg_has_a_box_per_run_and_file_and_an_arrow_per_edge(ancestry, recorded):
    _, lineage, _ = recorded
    svg = to_svg(ancestry)
    assert svg == to_svg(ancestry)  # deterministic
    root = ElementTree.fromstring(svg)
    nodes = _svg_nodes(root)
    assert set(nodes) == {v.key for v in ancestry.files} | {v.key for v in ancestry.runs}
    run_a = nodes[run_key(lineage.run_a)]
    assert "completed" in run_a.get("class") and "run" in run_a.get("class").split()
    texts = ["".join(t.itertext()) for t in run_a.iter(f"{SVG}text")]
    assert texts[0] == f"run {lineage.run_a[:8]}" and texts[1] == "completed · 8→4 devices"
    final = nodes[file_key(lineage.final.sha256)]
    assert "subject" in final.get("class").split()
    texts = ["".join(t.itertext()) for t in final.iter(f"{SVG}text")]
    assert texts == ["checkpoint_0.ckpt", "…/out_b/rank_0/",
                     f"target checkpoint · rank 0 · {human_size(lineage.final.size)}",
                     f"sha256 {lineage.final.sha256[:12]}"]
    # Files of the same name in different folders read differently: each box names its folder.
    first_lines = {key: ["".join(t.itertext()) for t in node.iter(f"{SVG}text")][:2] for key, node in nodes.items()
                   if "file" in node.get("class").split()}
    assert first_lines[file_key(lineage.sources[0].sha256)] == ["checkpoint_0.ckpt", "…/src/rank_0/"]
    assert first_lines[file_key(lineage.outputs_a[1].sha256)] == ["checkpoint_1.ckpt", "…/out_a/rank_1/"]
    assert len({tuple(lines) for lines in first_lines.values()}) == len(first_lines)
    assert lineage.final.path in "".join(final.find(f"{SVG}title").itertext())
    edges = [p for p in root.iter(f"{SVG}path") if "edge" in (p.get("class") or "").split()]
    assert {(p.get("data-from"), p.get("data-to")) for p in edges} == _expected_edges(lineage)
    assert all(p.get("marker-end") == "url(#arrow)" for p in edges)
    # Every edge leaves its source box's right side and ends at its target box's left side.
    width = float(root.get("width"))
    for edge in edges:
        numbers = [float(n) for n in re.findall(r"-?\d+(?:\.\d+)?", edge.get("d"))]
        start_x, end_x = numbers[0], numbers[-2]
        assert 0 < start_x < end_x <= width


def test_html_is_one_self_contained_page(ancestry, recorded):
    _, lineage, _ = recorded
    html = to_html(ancestry, tool_version="9.9")
    assert html.startswith("<!DOCTYPE html>") and html.count("<svg") == 1 and "<script>" in html
    # Nothing to fetch: no external scripts, styles, fonts or images; the only URL is the SVG namespace.
    assert not re.search(r"<link|\bsrc=|@import|url\((?!#)", html)
    assert set(re.findall(r"https?://[^\s\"')]+", html)) == {"http://www.w3.org/2000/svg"}
    svg = ElementTree.fromstring(html[html.index("<svg"):html.index("</svg>") + len("</svg>")])
    nodes = _svg_nodes(svg)
    details = json.loads(nodes[run_key(lineage.run_b)].get("data-details"))
    assert details["run"] == lineage.run_b and details["status"] == "completed"
    file_details = json.loads(nodes[file_key(lineage.copied.sha256)].get("data-details"))
    assert file_details["sha256"] == lineage.copied.sha256 and lineage.copied.path in file_details["paths"]


def test_dot_names_every_vertex_and_edge(ancestry, recorded):
    _, lineage, _ = recorded
    dot = to_dot(ancestry)
    assert dot.startswith("digraph lineage {") and dot.rstrip().endswith("}")
    edges = set(re.findall(r'^  "([^"]+)" -> "([^"]+)";$', dot, re.M))
    assert edges == _expected_edges(lineage)
    for vertex in ancestry.files:
        assert f'"{vertex.key}" [label="' in dot


def test_descendants_and_a_run_are_drawn_too(recorded):
    store, lineage, _ = recorded
    with store.read_session() as session:
        built = graph_of(trace_reference(session, lineage.sources[1].path, DESCENDANTS), "Built from a source")
        of_run = graph_of(trace_reference(session, lineage.run_a), "Lineage of run A")
    assert [v.run.id for v in built.runs] == [lineage.run_a, lineage.run_b]
    assert (run_key(lineage.run_b), file_key(lineage.final.sha256)) in {(e.source, e.target) for e in built.edges}
    assert {v.digest for v in built.files if v.end} == {lineage.outputs_a[5].sha256} | {
        f.sha256 for f in lineage.outputs_b}
    assert [v.run.id for v in of_run.runs if v.subject] == [lineage.run_a]
    targets = {e.target for e in of_run.edges if e.source == run_key(lineage.run_a)}
    assert targets == {file_key(f.sha256) for f in lineage.outputs_a}  # the run's outputs, manifest included


def test_odd_characters_in_paths_are_escaped(tmp_path, make_file):
    with LineageStore(f"sqlite:///{tmp_path / 'lineage.db'}") as store:
        store.ensure_schema()
        source = make_file(tmp_path / 'we"ird <&> name' / "rank_0.ckpt", b"source", "source_checkpoint", 0)
        output = make_file(tmp_path / "out" / "rank_0.ckpt", b"output", "target_checkpoint", 0)
        run = store.start_run(config={}, overrides=[], tool_version="0.1.0", output_dir=str(tmp_path / "out"),
                              source_devices=1, target_devices=1)
        store.record_inputs(run, [source])
        store.complete_run(run, outputs=[output], plan={"ranks": []})
        with store.read_session() as session:
            graph = graph_of(trace_reference(session, output.path), 'A "title" <with> & marks')
    ElementTree.fromstring(to_svg(graph))  # well-formed despite <, & and quotes
    dot = to_dot(graph)
    assert 'we\\"ird <&> name/rank_0.ckpt' in dot and 'label="A \\"title\\" <with> & marks"' in dot


def test_graph_command_writes_the_format_its_output_suffix_names(recorded, tmp_path, capsys):
    store, lineage, _ = recorded
    url = store.url.render_as_string(hide_password=False)
    for name, start in (("lineage.html", "<!DOCTYPE html>"), ("lineage.svg", "<svg"), ("lineage.gv", "digraph")):
        assert main(["--db", url, "graph", lineage.final.path, "--output", str(tmp_path / name)]) == 0
        assert (tmp_path / name).read_text().startswith(start)
    assert capsys.readouterr().out == ""
    assert main(["--db", url, "graph", lineage.final.path, "--format", "dot", "--output",
                 str(tmp_path / "picture.svg")]) == 0
    assert (tmp_path / "picture.svg").read_text().startswith("digraph")  # --format wins over the suffix
    assert main(["--db", url, "graph", lineage.final.path, "--json"]) == 0
    model = json.loads(capsys.readouterr().out)
    assert {(e["from"], e["to"]) for e in model["edges"]} == _expected_edges(lineage)
    assert main(["--db", url, "graph", lineage.final.path, "--output", str(tmp_path / "no" / "such" / "x.svg")]) == 2
    assert "cannot write" in capsys.readouterr().err


# -- a real browser ------------------------------------------------------------------------------

def _browser() -> str | None:
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    return None


def test_the_html_renders_in_a_headless_browser(ancestry, tmp_path, skip_loudly):
    from PIL import Image  # installed with matplotlib, a dev dependency

    browser = _browser()
    if browser is None:
        skip_loudly("chromium not found on PATH: the browser rendering test of lineage pictures did NOT run "
                    "(apt-get install chromium)")
    page = tmp_path / "lineage.html"
    page.write_text(to_html(ancestry), encoding="utf-8")
    screenshot = tmp_path / "lineage.png"
    command = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={screenshot}", "--window-size=1600,1000",
               "--hide-scrollbars", page.as_uri()]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "HOME": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert screenshot.exists(), result.stderr[-2000:]
    with Image.open(screenshot) as image:
        rgb = image.convert("RGB")
        colours = {colour: count for count, colour in rgb.getcolors(maxcolors=rgb.width * rgb.height)}
        total = rgb.width * rgb.height
    drawn = total - max(colours.values())  # everything but the most common colour, the background
    assert drawn > 0.05 * total, f"only {drawn} of {total} pixels differ from the background"
    # The checkpoint boxes' fill is on screen: the SVG itself was drawn, not just the page around it.
    checkpoint_fill = tuple(int(FILE_COLOURS["checkpoint"][0][i:i + 2], 16) for i in (1, 3, 5))
    assert colours.get(checkpoint_fill, 0) > 5000


def test_layout_of_many_files_stays_in_order(tmp_path, make_file):
    """512 source ranks into one run: one column of boxes, none overlapping, drawn quickly."""
    with LineageStore(f"sqlite:///{tmp_path / 'lineage.db'}") as store:
        store.ensure_schema()
        sources = [make_file(tmp_path / "src" / f"rank_{r}" / f"checkpoint_{r}.ckpt", f"rank {r}".encode(),
                             "source_checkpoint", r) for r in range(512)]
        output = make_file(tmp_path / "out.ckpt", b"merged", "target_checkpoint", 0)
        run = store.start_run(config={}, overrides=[], tool_version="0.1.0", output_dir=str(tmp_path),
                              source_devices=512, target_devices=1)
        store.record_inputs(run, sources)
        store.complete_run(run, outputs=[output], plan={"ranks": []})
        with store.read_session() as session:
            graph = graph_of(trace_reference(session, output.path), "wide")
    svg = ElementTree.fromstring(to_svg(graph))
    boxes = [g for g in _svg_nodes(svg).values() if "file" in g.get("class").split() and
             "subject" not in g.get("class").split()]
    ys = [float(re.match(r"translate\(([\d.]+),([\d.]+)\)", g.get("transform")).group(2)) for g in boxes]
    names = ["/".join("".join(t.itertext()) for t in list(g.iter(f"{SVG}text"))[1::-1]) for g in boxes]
    order = sorted(range(len(ys)), key=ys.__getitem__)
    assert [names[i] for i in order] == [f"…/src/rank_{r}//checkpoint_{r}.ckpt" for r in range(512)]
    assert all(b - a >= 80 for a, b in zip(sorted(ys), sorted(ys)[1:]))
