"""The house's rules, checked from the code's own imports: rooms in layers, data flowing one way.

A room (a package, or a top-level module) may import only rooms on a lower layer, lazy imports
inside functions included: a lower room never reaches up, so there are no circles. The package
face (``reshard_job/__init__.py``: ``__version__`` and the lazily imported API) is outside the rules.
Pure planning loads neither protobuf nor storage. Rooms stay small enough to read: modules of at
most 450 lines, functions of at most 60.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[2] / "reshard_job"

# lowest first; a room may import the rooms of any lower layer
LAYERS = [
    ["reshard_job.text", "reshard_job.json_flat", "reshard_job.conf"],
    ["reshard_job.errors", "reshard_job.secrets", "reshard_job.jsonchunks", "reshard_job.json_stream"],
    ["reshard_job.core"],
    ["reshard_job.storage"],
    ["reshard_job.formats", "reshard_job.plan"],
    ["reshard_job.sources"],
    ["reshard_job.execute"],
    ["reshard_job.proof"],  # fingerprints of whole checkpoints, through the execute room's reading
    ["reshard_job.lineage"],
    ["reshard_job.job.config"],
    ["reshard_job.job.output"],
    ["reshard_job.job.run"],
    ["reshard_job.job.stages"],
    ["reshard_job.audit"],  # compare reads checkpoints as the job's stages do
    ["reshard_job.job"],  # the runner
    ["reshard_job.job.cli"],  # the Hydra entry point over the runner
    ["reshard_job.api", "reshard_job.loading", "reshard_job.__main__"],
]
RANK = {room: i for i, rooms in enumerate(LAYERS) for room in rooms}
FACE = "reshard_job"
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    return ".".join(rel.parts).removesuffix(".__init__")


def _room(module: str) -> str | None:
    """The longest room name that is `module` or holds it."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        if name in RANK:
            return name
    return None


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "migrations" not in p.parts)


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            yield node.lineno, next((n for n in reversed(names) if _room(n) or n == FACE), node.module)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name


def test_every_module_is_in_a_room():
    homeless = [_module_name(p) for p in _sources() if _module_name(p) != FACE and _room(_module_name(p)) is None]
    assert not homeless, f"modules in no layer: {homeless}"


def test_no_relative_imports():
    relative = [f"{p.relative_to(PACKAGE.parent)}:{n.lineno}" for p in _sources()
                for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ImportFrom) and n.level]
    assert not relative, relative


def test_rooms_import_only_lower_layers():
    upward = []
    for path in _sources():
        here = _module_name(path)
        if here == FACE:
            continue
        mine = _room(here)
        for line, target in _imports(path):
            if not target.startswith("reshard_job") or target == FACE:
                continue
            theirs = _room(target)
            if theirs is None or theirs == mine:
                continue
            if RANK[theirs] >= RANK[mine]:
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({mine}) imports {target} ({theirs})")
    assert not upward, "imports that do not go down:\n" + "\n".join(upward)


def test_pure_planning_loads_no_protobuf_and_no_storage():
    code = ("import sys, reshard_job.plan, reshard_job.core.layout, reshard_job.core.topology; "
            "print('\\n'.join(m for m in sys.modules if m.startswith(('google.protobuf', 'reshard_job.storage', "
            "'reshard_job.formats', 'sqlalchemy', 'hydra'))))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert loaded == [], loaded


def test_modules_and_functions_fit_a_screen():
    too_long = []
    for path in _sources():
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            too_long.append(f"{path.relative_to(PACKAGE.parent)}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}(): {n} lines")
    assert not too_long, "\n".join(too_long)


@pytest.mark.parametrize("module", ["reshard_job.plan", "reshard_job.core.layout"])
def test_pure_modules_import_without_the_engine(module):
    """Light entry points stay light: the audit CLI does not load numpy's engine users."""
    out = subprocess.run([sys.executable, "-c", f"import sys, {module}; print('reshard_job.execute' in sys.modules)"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"
