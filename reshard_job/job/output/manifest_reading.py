"""Reading a manifest found in an output directory (``manifest.json``, a node's ``manifest.<node>.json``),
bounded by what it describes.

A job reads a manifest it finds to decide what the directory holds: which conversion (``fingerprint``,
``run_id``), which files (``target``: ``files``, ``strategy``, ``node_manifests``). The rest (the
configuration, the sources, the plan and, above all, the per-tensor digests, hundreds of MB for a
model of a million tensors) is never needed there, so it is read past a value at a time and dropped
(``json_stream.JsonStream``): memory follows what is kept, not the file.

The file may have become anything since it was written (truncated, replaced, a sparse 2 GiB file of
zeros), so reading is bounded by what a manifest of the files it lists can be: before ``target``
at most ``HEAD_BYTES`` are read, and once ``target`` lists its files, at most ``HEAD_BYTES`` plus
``TENSORS_BYTES_PER_BYTE`` per byte of those files (the per-tensor digests of a file take at most
that). Anything else — a larger file, bytes that are not JSON, a ``target`` whose files are not
what this tool writes — is a damaged manifest: ``ManifestDamaged``, which the callers treat as they
treat an unreadable one (the outputs of another conversion: refused, or cleared with
``output.overwrite=true``).
"""

from __future__ import annotations

import hashlib
import re

from reshard_job.json_stream import JsonProblem, JsonStream, file_reader

HEAD_BYTES = 256 << 20  # config, sources, plan: far below this for any real conversion
TENSORS_BYTES_PER_BYTE = 16  # per-tensor digests per byte of the files they describe (see journal)
MAX_SECTION_CHARS = 64 << 20  # one kept value (``target.files``: 65536 files of 1 KiB each)
KEPT = frozenset({"manifest_version", "run_id", "tool_version", "created_at", "fingerprint", "digest_algorithm",
                  "manifest_sha256", "node"})
SKIPPED_IN_TARGET = frozenset({"export"})  # shard names and what an export left out: not needed here
_PLAIN = r'[^"\\\x00-\x1f]*'  # (one character class repeated: what the regex engine runs fast)
_STRING = rf'"{_PLAIN}(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{{4}}){_PLAIN})*"'  # as the strict scanner takes it
_NUMBER = r"-?(?:0|[1-9][0-9]{0,19})(?:\.[0-9]{1,20})?(?:[eE][-+]?[0-9]{1,20})?"  # no integer of absurd length
_WS = r"[ \t\n\r]*"
# members of a string, number or literal value, each up to its comma (a rank's per-tensor digests)
_SCALAR_MEMBERS = re.compile(rf"(?:{_WS}{_STRING}{_WS}:{_WS}(?:{_STRING}|{_NUMBER}|true|false|null){_WS},)*")


class ManifestDamaged(ValueError):
    """The manifest is not one this tool wrote (what is wrong, in words)."""


class _Budget:
    """``read(n)`` over an open file that stops at `limit` bytes read (raised later by the reader),
    hashing what it reads."""

    def __init__(self, f, limit: int):
        self._read = file_reader(f)
        self.limit = limit
        self.done = 0
        self.sha256 = hashlib.sha256()

    def read(self, n: int) -> bytes:
        data = self._read(min(n, self.limit + 1 - self.done))
        self.done += len(data)
        self.sha256.update(data)
        if self.done > self.limit:
            raise JsonProblem(f"more than {self.limit} bytes, more than a manifest of its files can be")
        return data


def read_manifest_summary(f) -> tuple[dict, tuple[int, str]]:
    """(what the job needs of the manifest in the open file `f`, (size, sha256) of the file).
    ManifestDamaged when it is not a manifest this tool could have written."""
    budget = _Budget(f, HEAD_BYTES)
    stream = JsonStream(budget.read)
    out: dict = {}
    try:
        for key in stream.members():
            if key in KEPT:
                out[key] = stream.value(MAX_SECTION_CHARS)
            elif key == "target" and "target" not in out:
                out["target"] = _target(stream)
                files = out["target"].get("files", [])
                budget.limit = HEAD_BYTES + TENSORS_BYTES_PER_BYTE * sum(x.get("size", 0) for x in files)
            else:
                _skip(stream)
        stream.end()
    except (JsonProblem, RecursionError) as e:
        raise ManifestDamaged(str(e)) from None
    return out, (budget.done, budget.sha256.hexdigest())


def _target(stream: JsonStream) -> dict:
    if stream.peek() != "{":
        raise JsonProblem("target is not an object")
    target: dict = {}
    for key in stream.members():
        if key in SKIPPED_IN_TARGET:
            _skip(stream)
        else:
            target[key] = stream.value(MAX_SECTION_CHARS)
    _check_target(target)
    return target


def _check_target(target: dict) -> None:
    """``target`` lists files as this tool writes them (so no caller meets a surprise shape): each a
    path, and a rank, part, size and sha256 of the right kinds where given."""
    files = target.get("files", [])
    if not isinstance(files, list) or not all(_is_file(f) and _numbered(f) for f in files):
        raise JsonProblem("target.files is not a list of files with their rank, path, size and sha256")
    strategy = target.get("strategy")
    if strategy is not None and not _is_file(strategy):
        raise JsonProblem("target.strategy is not a file with its path, size and sha256")
    nodes = target.get("node_manifests")
    if nodes is not None and not (isinstance(nodes, list) and all(_is_file(m) for m in nodes)):
        raise JsonProblem("target.node_manifests is not a list of files with their path, size and sha256")


def _is_file(f) -> bool:
    return (isinstance(f, dict) and isinstance(f.get("path"), str) and isinstance(f.get("sha256", ""), str)
            and _count(f.get("size", 0)))


def _numbered(f: dict) -> bool:
    return all(f.get(k) is None or _count(f[k]) for k in ("rank", "part")) \
        and (f.get("file") is None or isinstance(f["file"], str))


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _skip(stream: JsonStream, depth: int = 0) -> None:
    """Read past the value that begins here, holding one small value of it at a time."""
    c = stream.peek()
    if c == "{":
        if depth == 0:  # e.g. the per-tensor digests: a member per file, each walked item by item
            for _ in stream.members():
                _skip(stream, 1)
        else:
            _skip_object(stream)
    elif c == "[":
        stream.take("[")
        if stream.peek() == "]":
            stream.take("]")
            return
        while True:
            _skip(stream, depth + 1)
            if stream.take(",]") == "]":
                return
    else:
        stream.value()


def _skip_object(stream: JsonStream) -> None:
    """Read past the object that begins here, making none of its values: runs of members of scalar
    values pass in one match a window (a million per-tensor digests, which ``JsonStream.items``
    passed in 7 s, 17 s before it took indented members); any other member, the last, and one the
    window's end cuts, the careful way."""
    stream.take("{")
    if stream.peek() == "}":
        stream.take("}")
        return
    while True:
        stream.pos = _SCALAR_MEMBERS.match(stream.buf, stream.pos).end()
        if stream.peek() != '"':
            raise stream.problem("expecting a key in double quotes")
        stream.value()
        stream.take(":")
        stream.value()
        if stream.take(",}") == "}":
            return
