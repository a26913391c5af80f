"""Writing MindFormers 2.x saves for tests, exactly as the format spec describes them.

The shard rule is a reference written here from the prose of the spec
(mindformers-checkpoint-format §3.2), not from the package's own helpers, so tests built on these
saves check the package against the spec. Used by the format tests and the job-level tests.
"""

from __future__ import annotations

import ast
import json
from math import prod
from pathlib import Path

import numpy as np

import reshard_job.core.dtypes as dtypes
from reshard_job.formats.safetensors import save_file


# ================================================================================ spec reference


def spec_coords(position: int, device_matrix) -> list[int]:
    """Row-major coordinates: the last axis varies fastest."""
    out = []
    for size in reversed(device_matrix):
        out.append(position % size)
        position //= size
    return out[::-1]


def spec_shard(position: int, device_matrix, tensor_map, fragments) -> int:
    """§3.2: j_d from the coordinates of the axes in tensor_map[d] (value m = axis len-1-m, first listed
    most significant); k = Σ j_d · Π_{d' > d} n_d'."""
    c = spec_coords(position, device_matrix)
    n = len(device_matrix)
    k = 0
    for entry, frag in zip(tensor_map, fragments):
        j = 0
        for m in (entry if isinstance(entry, (list, tuple)) else [entry]):
            if m != -1:
                j = j * device_matrix[n - 1 - m] + c[n - 1 - m]
        k = k * frag + j
    return k


def spec_fragments(device_matrix, tensor_map) -> list[int]:
    n = len(device_matrix)
    return [prod(device_matrix[n - 1 - m] for m in (e if isinstance(e, (list, tuple)) else [e]) if m != -1)
            for e in tensor_map]


def spec_box(k: int, shape, fragments):
    j = spec_coords(k, fragments)
    return tuple((jd * g // f, (jd + 1) * g // f) for jd, g, f in zip(j, shape, fragments))


# ================================================================================ sample writer


def write_mf_save(root: Path, params: dict, *, stored_by=None, world: int, prefix: str = "llama",
                  iteration: int = 7, extras: dict | None = None) -> Path:
    """Write a MindFormers save as its saver would (spec §1–§3).

    `params`: name -> (global array, MindSpore dtype name, device_matrix, tensor_map, rank_list).
    `stored_by(name, k, rank_group)`: the one rank storing shard k (a redundancy-removed save);
    None: every holder stores its own copy, file number = rank, total = `world`.
    `extras`: tensors added whole to every opt file (global_step, learning_rate), as without
    redundancy removal. Returns the iteration folder.
    """
    folder = root / f"iteration_{iteration:08d}"
    folder.mkdir(parents=True)
    files: dict[tuple[str, int], dict] = {}  # (kind, rank) -> name -> (array, dtype)
    sdm, storage = {}, {}
    for name, (array, dtype, dev, tmap, ranks) in params.items():
        frags = spec_fragments(dev, tmap)
        shards = [spec_shard(i, dev, tmap, frags) for i in range(len(ranks))]
        groups: dict[int, list[int]] = {}
        for i, k in enumerate(shards):
            groups.setdefault(k, []).append(ranks[i])
        order = list(dict.fromkeys(shards))
        local = [g // f for g, f in zip(array.shape, frags)]
        sdm[name] = {
            "properties": {"dtype": dtype.lower(),
                           "replica_id": [groups[k].index(ranks[i]) for i, k in enumerate(shards)],
                           "allow_shape_mismatch": False, "allow_to_save": True},
            "global_shape": list(array.shape), "axis_fragmentations": frags,
            "layout": {"device_matrix": list(dev), "tensor_map": tmap, "interleaved_parallel": False,
                       "alias_name": [chr(ord("a") + i) for i in range(len(dev))], "rank_list": list(ranks)},
            "chunk": [{"global_offset": [k], "local_shape": local} for k in order],
        }
        kind = "opt" if name.startswith(("adam_m.", "adam_v.")) else "model"
        for k in order:
            box = spec_box(k, array.shape, frags)
            part = np.ascontiguousarray(array[tuple(slice(a, b) for a, b in box)])
            writers = [stored_by(name, k, groups[k])] if stored_by else groups[k]
            for r in writers:
                files.setdefault((kind, r), {})[name] = (part, dtype)
            storage[str((name, (k,)))] = [{"file_name": None, "storage_rank": r, "rank_group": groups[k]}
                                          for r in writers]
    file_names = {}
    for kind in ("model", "opt"):
        ranks_with = sorted(r for (t, r) in files if t == kind)
        if stored_by is None:
            ranks_with = list(range(world))
        for number, r in enumerate(ranks_with):
            index = r if stored_by is None else number
            file_names[(kind, r)] = f"{prefix}-{kind}-{index:07d}-{len(ranks_with):07d}.safetensors"
    for key, entries in storage.items():
        name = ast.literal_eval(key)[0]
        kind = "opt" if name.startswith(("adam_m.", "adam_v.")) else "model"
        for e in entries:
            e["file_name"] = file_names[(kind, e["storage_rank"])]
    for (kind, r), fname in file_names.items():
        tensors = dict(files.get((kind, r), {}))
        if kind == "opt" and stored_by is None:
            tensors.update({n: (a, dtypes.from_numpy(a.dtype).name) for n, a in (extras or {}).items()})
        save_file(folder / fname, {n: a for n, (a, _) in tensors.items()},
                  dtype_overrides={n: d for n, (_, d) in tensors.items()})
    (folder / "metadata.json").write_text(json.dumps({"state_dict_metadata": sdm, "storage_data": storage},
                                                     separators=(",", ":")))
    (folder / "common.json").write_text(json.dumps({"epoch_num": 1, "step_num": iteration,
                                                    "global_step": iteration}, indent=4))
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return folder


def bf16(shape, seed) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return dtypes.float32_to_bf16(rng.standard_normal(shape).astype(np.float32))


def f32(shape, seed) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def dedup_params():
    ranks = [0, 1, 2, 3]
    return {
        "model.wq.weight": (f32((8, 4), 1), "Float32", [2, 2], [[0, 1], -1], ranks),  # one holder per shard
        "model.wo.weight": (bf16((4, 8), 2), "BFloat16", [2, 2], [-1, 0], ranks),  # shards held by 2 ranks
        "model.norm.weight": (f32((4,), 3), "Float32", [2, 2], [-1], ranks),  # held by all 4
        "adam_m.model.wo.weight": (f32((4, 8), 4), "Float32", [2, 2], [-1, 0], ranks),
        "adam_m.model.norm.weight": (f32((4,), 5), "Float32", [2, 2], [-1], ranks),
    }


DEDUP_WRITERS = {("model.wo.weight", 0): 2, ("model.wo.weight", 1): 1, ("model.norm.weight", 0): 3,
                 ("adam_m.model.wo.weight", 0): 2, ("adam_m.model.wo.weight", 1): 3,
                 ("adam_m.model.norm.weight", 0): 3}


def dedup_writer(name, k, group):
    rank = DEDUP_WRITERS.get((name, k), group[0])
    assert rank in group
    return rank
