"""No file is written outside ``reshard_job/storage``: every creation, replacement, removal or change
of a file or folder goes through the storage package, where the strategy of each (temporary name,
rename, fsync, mode) is chosen and documented once. Reading (``open`` for reading, ``stat``) and
pointing a descriptor at ``os.devnull`` are not writing."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[3] / "reshard_job"
STORAGE = PACKAGE / "storage"

MODULE_CALLS = {
    "os": {"replace", "rename", "renames", "makedirs", "mkdir", "unlink", "remove", "rmdir", "removedirs",
           "utime", "chmod", "chown", "truncate", "symlink", "link", "mkfifo"},
    "shutil": {"rmtree", "move", "copy", "copy2", "copyfile", "copytree", "copyfileobj"},
}
PATH_METHODS = {"write_text", "touch", "mkdir", "rmdir", "symlink_to", "hardlink_to"}
WRITE_FLAGS = {"O_WRONLY", "O_RDWR", "O_CREAT", "O_TRUNC", "O_APPEND"}


def _names(node: ast.AST) -> set[str]:
    return {n.attr if isinstance(n, ast.Attribute) else n.id for n in ast.walk(node)
            if isinstance(n, (ast.Attribute, ast.Name))}


def _open_mode(call: ast.Call) -> str:
    mode = call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "mode"), None)
    return mode.value if isinstance(mode, ast.Constant) and isinstance(mode.value, str) else "r"


def _writes(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Name) and func.id == "open":
        return "open for writing" if set(_open_mode(call)) & set("wax+") else None
    if not isinstance(func, ast.Attribute):
        return None
    owner = func.value.id if isinstance(func.value, ast.Name) else None
    if owner == "os" and func.attr == "open":
        if call.args and "devnull" in _names(call.args[0]):
            return None
        return "os.open for writing" if len(call.args) > 1 and _names(call.args[1]) & WRITE_FLAGS else None
    if owner in MODULE_CALLS:
        return f"{owner}.{func.attr}" if func.attr in MODULE_CALLS[owner] else None
    return f".{func.attr}()" if func.attr in PATH_METHODS else None


def test_no_file_is_written_outside_storage():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if path.is_relative_to(STORAGE):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and (what := _writes(node)):
                found.append(f"reshard_job/{rel}:{node.lineno} {what}")
    assert not found, "files written outside reshard_job/storage:\n" + "\n".join(found)


def test_the_check_sees_a_direct_write():
    code = ast.parse("import os\nos.replace(a, b)\nopen(p, 'w')\nos.open(p, os.O_WRONLY | os.O_CREAT)\n"
                     "open(p)\nos.open(os.devnull, os.O_WRONLY)\nstorage.write_bytes(p, b'')\n")
    seen = [_writes(n) for n in ast.walk(code) if isinstance(n, ast.Call)]
    assert [s for s in seen if s] == ["os.replace", "open for writing", "os.open for writing"]
