"""Huge declared sizes must not turn into huge allocations: each crafted file below claims far more
than it holds (a record length of 2^62, dims whose product is 2^80, a tensor_content length past
the record, a map part of 2^40 elements, a strategy field of 2^60 bytes). They are read in a child
process whose address space is capped a little above what it needs to start, so any attempt to
allocate what is declared fails loudly (MemoryError) instead of passing unnoticed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from reshard_job.formats import wire
from reshard_job.formats.ckpt.records import record_header, tensor_header as _tensor_header

TP = 2**62


def _record(name: bytes, tensor_proto: bytes) -> bytes:
    value = wire.len_field(1, len(name)) + name + wire.len_field(2, len(tensor_proto)) + tensor_proto
    return wire.len_field(1, len(value)) + value


def crafted_ckpts() -> dict[str, bytes]:
    small = np.arange(4, dtype=np.float32).tobytes()
    ok = record_header("w", (4,), "Float32", len(small)) + small
    out = {
        "record length 2^62": b"\x0a" + wire.encode_varint(TP) + b"\x0a\x01w",
        "dims product 2^80": record_header("w", (2**40, 2**40), "Float32", len(small)) + small,
        "dims 2^62 of Int4 (unchecked packed dtype)": record_header("q", (TP,), "Int4", 4) + b"\x00" * 4,
        "content length 2^60 inside a small record": _record(b"w", _tensor_header((4,), "Float32", 2**60) + small),
        "tag length 2^62": b"\x0a\x10\x0a" + wire.encode_varint(TP) + b"w" * 6,
        "packed dims of 2^62 entries": _record(b"w", wire.len_field(1, TP) + b"\x01"),
        "map part 2^40 elements": _record(b"m", b"")[:0] + _map(),
        "negative dims": record_header("w", (-1, -4), "Float32", len(small)) + small,
        "10-byte varint dims": _record(b"w", b"\x08" + b"\xff" * 9 + b"\x01" + b"\x12\x07Float32\x1a\x10" + small),
    }
    out["valid then huge"] = ok + out["record length 2^62"]
    return out


def _map() -> bytes:
    def part(dims, dtype, content):
        return _tensor_header(dims, dtype, len(content)) + content

    parts = [part((2**40,), "int64", b"\x00" * 16), part((2**20, 2**20), "float32", b"\x00" * 16),
             part((2,), "V1000000000", b"\x00" * 2)]
    body = b"".join(wire.len_field(1, len(p)) + p for p in parts)
    value = wire.len_field(1, 1) + b"m" + wire.len_field(3, len(body)) + body
    return wire.len_field(1, len(value)) + value


def crafted_strategies() -> dict[str, bytes]:
    lay = {"dev_matrix": [2**62, 2**62], "tensor_map": [0, 1], "field": 0, "opt_weight_shard_step": 0,
           "opt_weight_shard_size": 2**62, "tensor_shape": [2**62, 2**62]}
    return {
        "protobuf field length 2^60.ckpt": b"\x1a" + wire.encode_varint(2**60) + b"\x0a\x01w",
        "protobuf repeated dims 2^62.ckpt": b"\x1a\x0c\x0a\x01w\x12\x07\x0a\x05\x0a\x03" + b"\x08" + wire.encode_varint(TP)[:1],
        "JSON with 2^62 devices.json": json.dumps({"parallel_layout_item": {"w": lay}}).encode(),
    }


CHILD = r"""
import json, resource, sys
from reshard_job.errors import ReshardError
from reshard_job.formats.ckpt import CheckpointReader
from reshard_job.formats.strategy import read_strategy
from reshard_job.core.topology import Topology

def read_ckpt(path):
    with CheckpointReader(path) as r:
        for name in r.names():
            r.value(name)
            for _ in r.iter_content(name):
                pass

def read_strat(path):
    Topology.from_strategy(read_strategy(path))

with open("/proc/self/status") as f:
    vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
cap = vm + 256 * 1024 * 1024
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
out = {}
try:  # the control: the cap does stop a real allocation of this size
    bytearray(1 << 34)
    out["control"] = "allocated"
except MemoryError:
    out["control"] = "MemoryError"
for path in sys.argv[1:]:
    try:
        (read_strat if "strategy" in path else read_ckpt)(path)
        out[path] = "ok"
    except ReshardError as e:
        out[path] = "ReshardError"
    except MemoryError:
        out[path] = "MemoryError"
    except BaseException as e:
        out[path] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


@pytest.mark.timeout(120)
def test_huge_declarations_under_an_address_space_cap(tmp_path):
    paths = []
    for i, (what, data) in enumerate(crafted_ckpts().items()):
        p = tmp_path / f"ckpt{i}.ckpt"
        p.write_bytes(data)
        paths.append((what, p))
    for i, (what, data) in enumerate(crafted_strategies().items()):
        p = tmp_path / f"strategy{i}{Path(what).suffix}"
        p.write_bytes(data)
        paths.append((what, p))
    res = subprocess.run([sys.executable, "-c", CHILD, *(str(p) for _, p in paths)], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    outcome = json.loads(res.stdout)
    assert outcome["control"] == "MemoryError"
    got = {what: outcome[str(p)] for what, p in paths}
    # refused as malformed, or (the JSON: 2^62 devices are merely numbers) read; never allocated
    assert {w: v for w, v in got.items() if v != "ReshardError" and not (v == "ok" and w.endswith(".json"))} == {}
