"""Synthetic GPT-like distributed checkpoints for the benchmarks, of any size and dtype.

Every element of every tensor is a deterministic function of (parameter name, global flat index),
so any box of any parameter can be produced on its own: a rank's slice is generated straight
into its file, the global tensor never exists, and memory stays at one generation chunk no matter
how large the model is. The same function lets ``expected_box`` recompute what any target rank of
any layout must hold, which is how the runner checks that a conversion is right and not only fast.

Element words are hashed from the global index and have the second-highest bit cleared, so
float16/bfloat16/float32 values are always finite (|x| < 2): a converter that decodes the values
(MindSpore widens bfloat16 to float32) sees ordinary numbers, while a misplaced element is almost
surely detected because neighbouring words are uncorrelated.

Layouts follow what MindSpore compiles for a Megatron-style transformer (see the golden scenario
S2 in tests/golden): dev_matrix ``[dp, mp]`` with the model-parallel axis last; q/k/v, ffn-in and
the head are column-split (tensor_map ``[-1, 0]``), attention-out and ffn-out row-split
(``[0, -1]``), the embedding row-split over the vocabulary, the column-split biases split
(``[0]``), layer norms and the other biases replicated. With optimizer parallelism every
parameter's dimension 0 is further cut over its replicas, recorded as ``opt_weight_shard_size -1``
and ``opt_weight_shard_step`` = the rank stride of the replica group (``mp`` for split
parameters, 1 for replicated ones). ``adam_m.*``/``adam_v.*`` have the parameters' layouts (and are
listed in the strategy, as in the golden scenarios); ``global_step``/``learning_rate`` are in no
strategy.

Layout of a generated directory (``<out>``)::

    meta.json                         model dims, dtype, sizes (read back by run.py)
    src/rank_<r>/checkpoint_<r>.ckpt  source A: 8 ranks, mp4 x dp2, optimizer parallel
    src_pp/rank_<r>/checkpoint_<r>.ckpt
                                      source B: 2 pipeline stages x 4 ranks (mp2 x dp2, opt. parallel)
    strategy/src_8_mp4dp2.ckpt        strategy of source A
    strategy/src_pp2x4/stage<s>.ckpt  per-stage strategies of source B (keys not prefixed)
    strategy/dst_4_mp4.ckpt           target: 4 ranks, mp4, no optimizer parallel
    strategy/dst_16_mp4dp4.ckpt       target: 16 ranks, mp4 x dp4, optimizer parallel
    strategy/dst_6_mp2dp3.ckpt        target: 6 ranks, mp2 x dp3, optimizer parallel (8 -> 6 does not divide)

Usage::

    python benchmarks/generate.py --size-gb 2.07 --dtype float16 --out benchmarks/data/gpt_2.07gb_float16
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import zlib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from math import prod

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)
if _REPO not in sys.path:  # allow running from a checkout without installing
    sys.path.insert(0, _REPO)

from reshard_job.formats.ckpt import CheckpointWriter  # noqa: E402
from reshard_job.core.strategy_model import ParamLayout, StrategyFile, StrategyItem  # noqa: E402
from reshard_job.formats.strategy import write_strategy

GENERATOR_VERSION = 1
DEFAULT_SEED = 20240601
DIM_QUANTUM = 48  # hidden and vocabulary sizes are multiples of 48: divisible by 2, 3, 4, 6, 8, 16

DTYPES = {  # CLI name -> (MindSpore tensor_type, bytes per element)
    "float16": ("Float16", 2),
    "bfloat16": ("BFloat16", 2),
    "float32": ("Float32", 4),
}

# Tensor kinds -> tensor_map (MindSpore axis numbering: 0 = last dev_matrix position = mp axis)
COL, ROW, VEC_SPLIT, REP = "col", "row", "vec_split", "rep"
TENSOR_MAPS = {COL: (-1, 0), ROW: (0, -1), VEC_SPLIT: (0,), REP: None}

GEN_CHUNK_ELEMS = 1 << 21  # elements generated at a time (bounds the generator's memory)

MIX1 = np.uint64(0x9E3779B97F4A7C15)
MIX2 = np.uint64(0xBF58476D1CE4E5B9)
SHIFT = np.uint64(29)

GLOBAL_STEP = 1000
LEARNING_RATE = 1.0e-4


# ============================================================================================ model


@dataclass(frozen=True)
class ModelDims:
    hidden: int
    layers: int
    vocab: int
    ffn: int
    dtype: str  # CLI name

    @property
    def ms_dtype(self) -> str:
        return DTYPES[self.dtype][0]

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][1]


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    kind: str  # COL / ROW / VEC_SPLIT / REP
    op: str  # operator name for the strategy item
    stage: int  # pipeline stage in source B


def model_dims(size_gb: float, dtype: str = "float16") -> ModelDims:
    """Pick hidden size, layer count and vocabulary so that weights + adam_m + adam_v ~= size_gb * 1e9 bytes.

    Aspect ratio like GPT-2/3 (layers ~ hidden / 48); the vocabulary absorbs the remainder, so any
    size is reachable to within a fraction of a percent.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    itemsize = DTYPES[dtype][1]
    target_params = size_gb * 1e9 / (3 * itemsize)
    q = DIM_QUANTUM
    hidden = max(q, int(round((3 * target_params) ** (1 / 3) / q)) * q)
    per_layer = 12 * hidden * hidden + 16 * hidden
    layers = max(2, int(round(hidden / q)))
    while layers > 2 and layers * per_layer > 0.85 * target_params:
        layers -= 1
    rest = target_params - layers * per_layer - 2 * hidden
    vocab = max(2 * q, int(round(rest / (2 * hidden) / q)) * q)
    return ModelDims(hidden, layers, vocab, 4 * hidden, dtype)


def model_params(d: ModelDims) -> list[Param]:
    """The trainable parameters in network order, with their Megatron-style split kind and stage."""
    H, F, V, L = d.hidden, d.ffn, d.vocab, d.layers
    first_stage1 = (L + 1) // 2  # layers [0, first_stage1) on stage 0, the rest on stage 1
    out = [Param("embedding_table", (V, H), ROW, "Gather", 0)]
    for i in range(L):
        s = 0 if i < first_stage1 else 1
        p = f"layers.{i}."
        out += [
            Param(p + "ln1.gamma", (H,), REP, "LayerNorm", s),
            Param(p + "ln1.beta", (H,), REP, "LayerNorm", s),
            Param(p + "attention.wq.weight", (H, H), COL, "MatMul", s),
            Param(p + "attention.wq.bias", (H,), VEC_SPLIT, "Add", s),
            Param(p + "attention.wk.weight", (H, H), COL, "MatMul", s),
            Param(p + "attention.wk.bias", (H,), VEC_SPLIT, "Add", s),
            Param(p + "attention.wv.weight", (H, H), COL, "MatMul", s),
            Param(p + "attention.wv.bias", (H,), VEC_SPLIT, "Add", s),
            Param(p + "attention.wo.weight", (H, H), ROW, "MatMul", s),
            Param(p + "attention.wo.bias", (H,), REP, "Add", s),
            Param(p + "ln2.gamma", (H,), REP, "LayerNorm", s),
            Param(p + "ln2.beta", (H,), REP, "LayerNorm", s),
            Param(p + "ffn.w1.weight", (H, F), COL, "MatMul", s),
            Param(p + "ffn.w1.bias", (F,), VEC_SPLIT, "Add", s),
            Param(p + "ffn.w2.weight", (F, H), ROW, "MatMul", s),
            Param(p + "ffn.w2.bias", (H,), REP, "Add", s),
        ]
    out += [
        Param("final_ln.gamma", (H,), REP, "LayerNorm", 1),
        Param("final_ln.beta", (H,), REP, "LayerNorm", 1),
        Param("head.weight", (H, V), COL, "MatMul", 1),
    ]
    return out


def all_params(d: ModelDims) -> list[Param]:
    """Parameters plus their adam_m/adam_v states (same shapes, kinds and stages)."""
    ps = model_params(d)
    return ps + [Param(f"{m}.{p.name}", p.shape, p.kind, p.op, p.stage) for m in ("adam_m", "adam_v") for p in ps]


def scalar_entries() -> list[tuple[str, str, tuple[int, ...], np.ndarray]]:
    """Entries in no strategy: (name, dtype, dims, array); MindSpore stores global_step as Int32 [1]."""
    return [
        ("global_step", "Int32", (1,), np.array([GLOBAL_STEP], dtype=np.int32)),
        ("learning_rate", "Float32", (), np.array(LEARNING_RATE, dtype=np.float32)),
    ]


def total_bytes(d: ModelDims) -> int:
    return sum(prod(p.shape) for p in all_params(d)) * d.itemsize


# ========================================================================================= layouts


@dataclass(frozen=True)
class Mesh:
    """A uniform Megatron mesh: dev_matrix [dp, mp] (or [mp]), optimizer parallel over dp or not."""

    name: str
    mp: int
    dp: int
    opt: bool

    @property
    def devices(self) -> int:
        return self.mp * self.dp

    @property
    def dev_matrix(self) -> tuple[int, ...]:
        return (self.dp, self.mp) if self.dp > 1 else (self.mp,)

    def layout(self, p: Param) -> ParamLayout:
        tmap = TENSOR_MAPS[p.kind] or tuple([-1] * len(p.shape))
        if self.mp == 1:
            tmap = tuple([-1] * len(p.shape))
        step = size = 0
        if self.opt and self.dp > 1:
            split = tmap != tuple([-1] * len(p.shape))
            step = self.mp if split else 1  # rank stride of the replica group
            size = -1  # all replicas
        return ParamLayout(self.dev_matrix, tmap, step, size)


SRC_A = Mesh("src_8_mp4dp2", mp=4, dp=2, opt=True)
SRC_B_STAGE = Mesh("src_pp2x4", mp=2, dp=2, opt=True)  # per stage; 2 stages
PP_STAGES = 2
TARGETS = {
    4: Mesh("dst_4_mp4", mp=4, dp=1, opt=False),
    16: Mesh("dst_16_mp4dp4", mp=4, dp=4, opt=True),
    6: Mesh("dst_6_mp2dp3", mp=2, dp=3, opt=True),
}


def megatron_box(mesh: Mesh, p: Param, rank: int) -> tuple[tuple[int, int], ...]:
    """The box of `p`'s global tensor that local `rank` of `mesh` holds (training semantics).

    Written out for these meshes on purpose instead of calling ``reshard_job.core.layout``: the
    benchmark's generator and checker must not share the code they check. Rank ``r`` has
    coordinates ``(r // mp, r % mp)`` on ``[dp, mp]``. A split dimension takes block ``r % mp``.
    With optimizer parallelism the replicas of a block, in ascending rank order, each hold one
    part of dimension 0 inside the model-parallel block (model-parallel index outer): for a split
    parameter the replicas are the ``dp`` ranks with the same ``r % mp`` (part ``r // mp``), for a
    replicated one all ranks (part ``r``).
    """
    tmap = mesh.layout(p).tensor_map
    mp_c = rank % mesh.mp
    box = []
    for i, n in enumerate(p.shape):
        if tmap[i] == 0:
            unit = n // mesh.mp
            box.append([mp_c * unit, (mp_c + 1) * unit])
        else:
            box.append([0, n])
    if mesh.opt and mesh.dp > 1:
        split = any(m != -1 for m in tmap)
        k, u = (mesh.dp, rank // mesh.mp) if split else (mesh.devices, rank)
        a, b = box[0]
        part = (b - a) // k
        if part * k != b - a:
            raise ValueError(f"{p.name}: dimension 0 block of {b - a} cannot be cut into {k} parts")
        box[0] = [a + u * part, a + (u + 1) * part]
    return tuple((a, b) for a, b in box)


def strategy_for(mesh: Mesh, params: list[Param], stage: int = 0) -> StrategyFile:
    layouts = {p.name: mesh.layout(p) for p in params}
    items = []
    for p in params:
        if p.name.startswith(("adam_m.", "adam_v.")):
            continue
        dp, mp = mesh.dp, mesh.mp
        if p.kind == COL:
            strat = ((dp, 1), (1, mp))
        elif p.kind == ROW:
            strat = ((dp, mp), (mp, 1))
        elif p.kind == VEC_SPLIT:
            strat = ((dp, mp), (mp,))
        else:
            strat = ((dp, 1), (1,))
        items.append(StrategyItem(f"{p.op}_{p.name}", stage, strat))
    return StrategyFile(layouts, items, current_stage=1)


def strategy_paths(out: str) -> dict[str, str]:
    s = os.path.join(out, "strategy")
    paths = {
        "src": os.path.join(s, f"{SRC_A.name}.ckpt"),
        "src_pp": os.path.join(s, SRC_B_STAGE.name),  # a directory of per-stage files
    }
    for n, mesh in TARGETS.items():
        paths[f"dst_{n}"] = os.path.join(s, f"{mesh.name}.ckpt")
    return paths


def write_strategies(out: str, d: ModelDims) -> dict[str, str]:
    params = all_params(d)
    paths = strategy_paths(out)
    os.makedirs(os.path.dirname(paths["src"]), exist_ok=True)
    write_strategy(strategy_for(SRC_A, params), paths["src"], mode=0o644)
    os.makedirs(paths["src_pp"], exist_ok=True)
    for s in range(PP_STAGES):
        mine = [p for p in params if p.stage == s]
        write_strategy(strategy_for(SRC_B_STAGE, mine, stage=s), os.path.join(paths["src_pp"], f"stage{s}.ckpt"),
                       mode=0o644)
    for n, mesh in TARGETS.items():
        write_strategy(strategy_for(mesh, params), paths[f"dst_{n}"], mode=0o644)
    return paths


# ========================================================================================= content


def param_seed(name: str, seed: int) -> np.uint64:
    return np.uint64((zlib.crc32(name.encode()) << 32) ^ (seed & 0xFFFFFFFF))


def words_for(name: str, flat_index: np.ndarray, itemsize: int, seed: int = DEFAULT_SEED) -> np.ndarray:
    """The stored words of `name` at the given global flat indices (uint64 array)."""
    x = (flat_index + param_seed(name, seed)) * MIX1
    x ^= x >> SHIFT
    x *= MIX2
    bits = 8 * itemsize
    w = (x >> np.uint64(64 - bits)).astype(np.dtype(f"<u{itemsize}"))
    w &= np.array(~(1 << (bits - 2)) & ((1 << bits) - 1), dtype=w.dtype)  # exponent below max: finite
    return w


def iter_box(name: str, global_shape: tuple[int, ...], box, itemsize: int, seed: int = DEFAULT_SEED,
             chunk_elems: int = GEN_CHUNK_ELEMS):
    """Yield the words of a box of the global tensor, in C order, in chunks of whole rows (or row pieces)."""
    if len(global_shape) == 1:
        (a, b), = box
        for lo in range(a, b, chunk_elems):
            hi = min(b, lo + chunk_elems)
            yield words_for(name, np.arange(lo, hi, dtype=np.uint64), itemsize, seed)
        return
    if len(global_shape) != 2:
        raise ValueError("only 1-D and 2-D parameters are generated")
    (r0, r1), (c0, c1) = box
    ncols = global_shape[1]
    width = c1 - c0
    cols = np.arange(c0, c1, dtype=np.uint64)
    rows_per = max(1, chunk_elems // max(1, width))
    for lo in range(r0, r1, rows_per):
        hi = min(r1, lo + rows_per)
        rows = np.arange(lo, hi, dtype=np.uint64) * np.uint64(ncols)
        yield words_for(name, np.add.outer(rows, cols).reshape(-1), itemsize, seed)


def expected_box(name: str, global_shape, box, itemsize: int, seed: int = DEFAULT_SEED) -> np.ndarray:
    """The whole box at once (for verification of modest boxes)."""
    parts = list(iter_box(name, tuple(global_shape), box, itemsize, seed))
    flat = np.concatenate(parts) if parts else np.empty(0, dtype=f"<u{itemsize}")
    return flat.reshape(tuple(b - a for a, b in box))


# ========================================================================================= writing


def _write_rank(args) -> tuple[int, str, int]:
    """Write one source rank's file; runs in a worker process."""
    path, rank, local, mesh_dict, dims_dict, stage, seed = args
    mesh = Mesh(**mesh_dict)
    d = ModelDims(**dims_dict)
    params = [p for p in all_params(d) if stage is None or p.stage == stage]
    # MindSpore's save order: parameters, then global_step/learning_rate, then optimizer states
    weights = [p for p in params if not p.name.startswith(("adam_m.", "adam_v."))]
    states = [p for p in params if p.name.startswith(("adam_m.", "adam_v."))]
    w = CheckpointWriter(path, mode=0o444)
    try:
        def put(p: Param):
            box = megatron_box(mesh, p, local)
            sink = w.begin(p.name, d.ms_dtype, tuple(b - a for a, b in box))
            for chunk in iter_box(p.name, p.shape, box, d.itemsize, seed):
                sink.write(chunk.view(np.uint8))
            sink.close()

        for p in weights:
            put(p)
        for name, dt, dims, arr in scalar_entries():
            w.add(name, arr, dtype=dt, dims=dims)
        for p in states:
            put(p)
        wf = w.commit()
    except BaseException:
        w.abort()
        raise
    return rank, path, wf.size


def _jobs(jobs: int | None) -> int:
    return max(1, jobs if jobs else min(2, os.cpu_count() or 1))


def write_source(out: str, which: str, d: ModelDims, seed: int = DEFAULT_SEED, jobs: int | None = None) -> int:
    """Write source ``src`` (8 ranks mp4 x dp2) or ``src_pp`` (2 stages x 4 ranks); return total bytes."""
    root = os.path.join(out, which)
    tmp = root + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tasks = []
    if which == "src":
        for r in range(SRC_A.devices):
            p = os.path.join(tmp, f"rank_{r}", f"checkpoint_{r}.ckpt")
            tasks.append((p, r, r, asdict(SRC_A), asdict(d), None, seed))
    elif which == "src_pp":
        n = SRC_B_STAGE.devices
        for s in range(PP_STAGES):
            for local in range(n):
                g = s * n + local
                p = os.path.join(tmp, f"rank_{g}", f"checkpoint_{g}.ckpt")
                tasks.append((p, g, local, asdict(SRC_B_STAGE), asdict(d), s, seed))
    else:
        raise ValueError(f"unknown source {which!r}")
    n_jobs = _jobs(jobs)
    if n_jobs == 1:
        results = [_write_rank(t) for t in tasks]
    else:
        with ProcessPoolExecutor(n_jobs) as ex:
            results = list(ex.map(_write_rank, tasks))
    shutil.rmtree(root, ignore_errors=True)
    os.replace(tmp, root)  # a source directory exists only when complete
    return sum(size for _, _, size in results)


def dir_bytes(path: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(dirpath, f))
    return total


def generate(out: str, size_gb: float, dtype: str = "float16", *, sources=("src", "src_pp"),
             seed: int = DEFAULT_SEED, jobs: int | None = None, force: bool = False, log=print) -> dict:
    """Generate (or reuse, if meta.json matches) the strategies and the requested sources; return meta."""
    d = model_dims(size_gb, dtype)
    meta_path = os.path.join(out, "meta.json")
    want = {"generator_version": GENERATOR_VERSION, "size_gb": size_gb, "seed": seed, "dims": asdict(d)}
    meta = None
    if os.path.exists(meta_path) and not force:
        with open(meta_path) as f:
            meta = json.load(f)
        if any(meta.get(k) != v for k, v in want.items()):
            meta = None
    if meta is None:
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out, exist_ok=True)
        meta = dict(want)
        meta.update({
            "dtype": dtype,
            "ms_dtype": d.ms_dtype,
            "model_bytes": total_bytes(d),
            "n_params": sum(prod(p.shape) for p in model_params(d)),
            "sources": {},
        })
    meta["strategies"] = write_strategies(out, d)
    for which in sources:
        root = os.path.join(out, which)
        if which in meta["sources"] and os.path.isdir(root) and not force:
            continue
        t0 = time.perf_counter()
        log(f"[generate] {out}/{which}: {size_gb} GB {dtype} "
            f"(hidden {d.hidden}, layers {d.layers}, vocab {d.vocab}) ...")
        nbytes = write_source(out, which, d, seed, jobs)
        dt = time.perf_counter() - t0
        log(f"[generate]   {nbytes / 1e9:.3f} GB in {dt:.1f} s ({nbytes / 1e9 / dt:.2f} GB/s)")
        meta["sources"][which] = {"path": root, "bytes": nbytes, "generate_s": round(dt, 2)}
        _write_meta(meta_path, meta)
    _write_meta(meta_path, meta)
    return meta


def _write_meta(path: str, meta: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
    os.replace(tmp, path)


def data_dir_for(base: str, size_gb: float, dtype: str) -> str:
    return os.path.join(base, f"gpt_{size_gb:g}gb_{dtype}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, required=True, help="total source size (weights + adam_m + adam_v), 1e9 bytes")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float16")
    ap.add_argument("--out", help="output directory (default benchmarks/data/gpt_<size>gb_<dtype>)")
    ap.add_argument("--sources", default="src,src_pp", help="comma list of src (8 ranks) and src_pp (pipeline 2x4)")
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    ap.add_argument("--jobs", type=int, default=None, help="ranks written in parallel (default min(2, cores))")
    ap.add_argument("--force", action="store_true", help="regenerate even if a matching source exists")
    ap.add_argument("--dims-only", action="store_true", help="print the model dimensions and exit")
    a = ap.parse_args(argv)
    d = model_dims(a.size_gb, a.dtype)
    if a.dims_only:
        print(json.dumps({**asdict(d), "bytes": total_bytes(d)}, indent=2))
        return 0
    out = a.out or data_dir_for(os.path.join(_HERE, "data"), a.size_gb, a.dtype)
    meta = generate(out, a.size_gb, a.dtype, sources=tuple(s for s in a.sources.split(",") if s),
                    seed=a.seed, jobs=a.jobs, force=a.force)
    print(json.dumps(meta, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
