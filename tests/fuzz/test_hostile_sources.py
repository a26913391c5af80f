"""Hostile MindFormers saves and export folders, run as users run the job: each ends quickly, in
bounded memory, in one ``reshard_job: error: <file>: ...`` line with exit status 2, or converts
correctly.

Every case runs ``python -m reshard_job`` in a child process under an address-space limit and a
timeout (``run_bounded``/``one_error`` of ``tests/e2e/reliability/test_hostile.py``), so a
regression that reads a gigabyte, allocates what a file declares or loops over it fails the test
instead of taking the machine down. The cases are built from golden scenario M1a (a dp2 x mp2
MindFormers save) and from an export of it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_RELIABILITY = str(Path(__file__).resolve().parents[1] / "e2e" / "reliability")
if _RELIABILITY not in sys.path:
    sys.path.insert(0, _RELIABILITY)

from reliability_helpers import app_command, app_env  # noqa: E402
from test_hostile import MEMORY_BOUND_MIB, one_error, run_bounded  # noqa: E402

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
M1A = GOLDEN / "M1a_mf_llama_dp2mp2os_bf16_to_mp4"
ITERATION = "iteration_00000020"
INDEX = "model.safetensors.index.json"
SECONDS = 10  # the bound a refusal is held to (the harness's own timeout is a hang detector)


def refused(tmp_path: Path, *args: str) -> str:
    """The one error line of a bounded run (exit 2, no traceback, within the time and memory bounds)."""
    code, stderr, rss, seconds = run_bounded(tmp_path, *args)
    error = one_error(code, stderr, rss)
    assert seconds < SECONDS, f"{seconds:.1f} s: {error}"
    return error


def converted(tmp_path: Path, *args: str) -> None:
    code, stderr, rss, seconds = run_bounded(tmp_path, *args)
    assert code == 0, stderr
    assert rss <= MEMORY_BOUND_MIB, f"peak RSS {rss:.0f} MiB"


# ================================================================================ building cases


@pytest.fixture
def save(tmp_path) -> Path:
    """A writable copy of M1a's MindFormers folder."""
    root = tmp_path / "mf"
    shutil.copytree(M1A / "src_mindformers", root)
    for p in root.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    return root


def metadata(save: Path) -> Path:
    return save / ITERATION / "metadata.json"


def edit_metadata(save: Path, change) -> Path:
    path = metadata(save)
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc, separators=(",", ":")))
    return path


def mf_args(save: Path, out: Path, *extra: str) -> list[str]:
    return [f"source.checkpoints={save}", "target=strategy", f"target.strategy={M1A / 'dst_strategy.ckpt'}",
            f"output.dir={out}", "lineage.enabled=false", "job.progress=false", *extra]


def read_header(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), data[8 + n:]


def write_header(path: Path, header: dict, body: bytes) -> None:
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + body)


def add_empty_tensor(path: Path, name: str, shape: list) -> None:
    """`path` (a safetensors file) with one more tensor of no bytes and the given declared shape."""
    header, body = read_header(path)
    header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [len(body), len(body)]}
    write_header(path, header, body)


def set_shape(path: Path, name: str, shape: list) -> None:
    """Tensor `name` of `path` given `shape` and no bytes (its data dropped, the others moved up)."""
    header, body = read_header(path)
    meta = header.pop("__metadata__", None)
    out, rebuilt = bytearray(), {} if meta is None else {"__metadata__": meta}
    for n, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"]):
        part = b"" if n == name else body[e["data_offsets"][0]:e["data_offsets"][1]]
        rebuilt[n] = dict(e, shape=shape if n == name else e["shape"], data_offsets=[len(out), len(out) + len(part)])
        out += part
    write_header(path, rebuilt, bytes(out))


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    """M1a exported for inference in two shards (written once by the job)."""
    root = tmp_path_factory.mktemp("export")
    res = subprocess.run(app_command(f"source.checkpoints={M1A / 'src_mindformers'}", "target=hf_export",
                                     f"output.dir={root / 'hf'}", "target.max_shard_size=20000",
                                     "lineage.enabled=false", "job.progress=false"),
                         cwd=root, env=app_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return root / "hf"


@pytest.fixture
def hf(tmp_path, export) -> Path:
    """A writable copy of the export's shards and index."""
    folder = tmp_path / "hf"
    folder.mkdir()
    for p in export.iterdir():
        if p.name.endswith((".safetensors", ".json")) and p.name != "manifest.json":
            shutil.copy(p, folder / p.name)
            (folder / p.name).chmod(0o644)
    return folder


def hf_args(hf: Path, out: Path) -> list[str]:
    return [f"source.checkpoints={hf}", "target=single", f"output.dir={out}", "lineage.enabled=false",
            "job.progress=false"]


def edit_index(hf: Path, change) -> Path:
    path = hf / INDEX
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc, indent=2))
    return path


# ================================================================================ 1. whose file


def test_rank_files_swapped_in_metadata_are_refused(tmp_path, save):
    """Rank 0's shards placed in rank 1's file and back: names and shapes fit, the bytes would not."""
    def swap(doc):
        for entries in doc["storage_data"].values():
            for e in entries:
                for a, b in (("-0000000-", "-0000001-"), ("-0000001-", "-0000000-")):
                    if a in e["file_name"]:
                        e["file_name"] = e["file_name"].replace(a, b)
                        break
    path = edit_metadata(save, swap)
    error = refused(tmp_path, *mf_args(save, tmp_path / "out"))
    assert error.startswith(f"{path}: parameter ")
    assert "storage_data says rank 0 stored it in llama-model-0000001-0000004.safetensors" in error
    assert "file 1 of 4" in error and "model file n is the one rank n wrote" in error
    assert not (tmp_path / "out" / "manifest.json").exists()


# ================================================================================ 2. shapes kept


@pytest.mark.parametrize("shape,problem", [
    ([0, 2**64], "dimension 1 (18446744073709551616) does not fit an int64"),
    ([0, 2**63], "does not fit an int64"),
    ([0, 2**62, 2**62], "non-zero dimensions multiply to more than 2**63-1 bytes"),
    ([0] * 65, "65 dims"),
    ([0, -1], "not a list of non-negative integers"),
    ([0, 1.5], "not a list of non-negative integers"),
])
def test_shapes_no_array_can_have_are_refused_naming_file_and_tensor(tmp_path, save, shape, problem):
    victim = save / ITERATION / "llama-opt-0000000-0000004.safetensors"
    add_empty_tensor(victim, "extra.empty", shape)
    error = refused(tmp_path, *mf_args(save, tmp_path / "out", "target.include=all"))
    assert error.startswith(f"{victim}: tensor 'extra.empty': ") and problem in error, error


def test_a_zero_size_tensor_keeps_its_declared_dims(tmp_path, save):
    from reshard_job.formats.ckpt import CheckpointReader

    for r in range(4):
        add_empty_tensor(save / ITERATION / f"llama-opt-{r:07d}-0000004.safetensors", "extra.empty", [0, 2**60])
    converted(tmp_path, *mf_args(save, tmp_path / "out", "target.include=all"))
    with CheckpointReader(tmp_path / "out" / "rank_0" / "checkpoint_0.ckpt") as r:
        assert r.entries["extra.empty"].shape == (0, 2**60)


# ================================================================================ 3. absurd integers

HUGE = "9" * 5000


@pytest.mark.parametrize("where,before,after,needle", [
    ("global_shape", b'"global_shape":[32,32]', b'"global_shape":[' + HUGE.encode() + b',32]', "'global_shape'"),
    ("storage_rank", b'"storage_rank":0', b'"storage_rank":' + HUGE.encode(), "'storage_rank'"),
    ("rank_group", b'"rank_group":[0', b'"rank_group":[' + HUGE.encode(), "'rank_group'"),
    ("chunk offset", b'"global_offset":[0]', b'"global_offset":[-' + HUGE.encode() + b']', "'global_offset'"),
    ("storage key", b"(0,))", b"(" + HUGE.encode() + b",))", "storage_data key"),
])
def test_integers_of_absurd_length_in_metadata_are_refused_as_such(tmp_path, save, where, before, after, needle):
    path = metadata(save)
    data = path.read_bytes()
    assert before in data
    path.write_bytes(data.replace(before, after, 1))
    error = refused(tmp_path, *mf_args(save, tmp_path / "out"))
    assert error.startswith(f"{path}: ") and "integers of absurd length are refused" in error and needle in error


def test_an_absurd_total_size_in_the_index_is_refused_as_such(tmp_path, hf):
    path = hf / INDEX
    doc = json.loads(path.read_text())
    path.write_text(json.dumps(doc).replace(str(doc["metadata"]["total_size"]), HUGE))
    error = refused(tmp_path, *hf_args(hf, tmp_path / "out"))
    assert error.startswith(f"{path}: ") and "integers of absurd length" in error and "'total_size'" in error


# ================================================================================ 4. zero beside 2**62


def _lm_head_of_shape(save: Path, shape: list) -> Path:
    """M1a with lm_head.weight (bf16, split in 4 along dimension 0) of global shape `shape`."""
    def change(doc):
        p = doc["state_dict_metadata"]["lm_head.weight"]
        p["global_shape"] = shape
        for c in p["chunk"]:
            c["local_shape"] = [g // f for g, f in zip(shape, p["axis_fragmentations"])]
    path = edit_metadata(save, change)
    local = [g // f for g, f in zip(shape, [4, 1])]
    for r in range(4):
        set_shape(save / ITERATION / f"llama-model-{r:07d}-0000004.safetensors", "lm_head.weight", local)
    return path


@pytest.mark.parametrize("shape,problem", [
    ([0, 2**62], "its non-zero dimensions multiply to more than 2**63-1 bytes"),  # bf16: 2**63 bytes
    ([2**62 * 4, 0], "dimension 0 (18446744073709551616) does not fit an int64"),
])
def test_zero_dims_beside_huge_ones_in_metadata_are_refused(tmp_path, save, shape, problem):
    path = _lm_head_of_shape(save, shape)
    error = refused(tmp_path, *mf_args(save, tmp_path / "out"))
    assert error.startswith(f"{path}: parameter 'lm_head.weight': global_shape ") and problem in error, error


def test_zero_dims_beside_large_ones_in_metadata_are_kept(tmp_path, save):
    from reshard_job.formats.ckpt import CheckpointReader

    _lm_head_of_shape(save, [0, 2**61])  # 2**62 bytes over its non-zero dims: numpy holds it
    converted(tmp_path, *mf_args(save, tmp_path / "out"))
    with CheckpointReader(tmp_path / "out" / "rank_1" / "checkpoint_1.ckpt") as r:
        assert r.entries["lm_head.weight"].shape[1] == 2**61


# ================================================================================ 5. sizes


@pytest.mark.parametrize("how", ["sparse", "padded"])
def test_a_gigabyte_metadata_json_is_refused_by_its_size(tmp_path, save, how):
    path = metadata(save)
    if how == "sparse":
        path.write_bytes(b"")
        os.truncate(path, 1 << 30)
    else:
        with open(path, "ab") as f:
            f.truncate(path.stat().st_size + (1 << 30))  # NUL bytes; a valid document ends before them
    error = refused(tmp_path, *mf_args(save, tmp_path / "out"))
    assert error.startswith(f"{path}: {path.stat().st_size} bytes, more than a metadata.json of this folder can need")


def test_a_metadata_json_describing_more_than_the_files_hold_stops_early(tmp_path, save):
    """200,000 parameters (97 MB, within the size limit) beside files whose headers list 252 tensors:
    refused once it describes more than their 228 KB could list, not parsed to the end."""
    def inflate(doc):
        entry = doc["state_dict_metadata"]["lm_head.weight"]
        doc["state_dict_metadata"].update({f"fake.{i}": entry for i in range(200_000)})
    path = edit_metadata(save, inflate)
    error = refused(tmp_path, *mf_args(save, tmp_path / "out"))
    assert error.startswith(f"{path}: state_dict_metadata describes more than the ")
    assert error.endswith(" tensors the folder's files can hold")


def test_a_metadata_json_padded_within_its_limit_is_read_in_windows(tmp_path, save):
    path = metadata(save)
    path.write_bytes(b" " * (48 << 20) + path.read_bytes() + b"\n" * (8 << 20))
    converted(tmp_path, *mf_args(save, tmp_path / "out"))


@pytest.mark.parametrize("how", ["sparse", "padded"])
def test_a_gigabyte_index_is_refused_by_its_size(tmp_path, hf, how):
    path = hf / INDEX
    if how == "sparse":
        path.write_bytes(b"")
    with open(path, "ab") as f:
        f.truncate(path.stat().st_size + (1 << 30))
    error = refused(tmp_path, *hf_args(hf, tmp_path / "out"))
    assert error.startswith(f"{path}: {path.stat().st_size} bytes, more than an index of this folder can need")


# the child's own peak: VmHWM is its address space's (ru_maxrss would count the parent's too, from
# before the exec)
LOAD_CHILD = textwrap.dedent("""
    import json, sys, time
    from reshard_job.sources.mindformers_save import load_mindformers
    started = time.monotonic()
    save = load_mindformers(sys.argv[1])
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    print(json.dumps({"params": len(save.params), "seconds": time.monotonic() - started, "peak_mib": peak / 1024}))
""")


def write_layoutless_save(root: Path, n: int) -> Path:
    """A one-rank save of `n` layout-less parameters: metadata.json of some 380 bytes each."""
    folder = root / "iteration_00000001"
    folder.mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("1")
    file_name = "model-0000000-0000001.safetensors"
    names = [f"model.layers.{i // 1000}.mlp.experts.{i % 1000}.w1.weight" for i in range(n)]
    entry = ('{"properties":{"dtype":"float32","replica_id":0,"allow_shape_mismatch":false,"allow_to_save":true},'
             '"global_shape":[4],"axis_fragmentations":[1],"layout":null,'
             '"chunk":[{"global_offset":[0],"local_shape":[4]}]}')
    where = f'[{{"file_name":"{file_name}","storage_rank":0,"rank_group":[0]}}]'
    with open(folder / "metadata.json", "w") as f:
        f.write('{"state_dict_metadata":{' + ",".join(f'{json.dumps(m)}:{entry}' for m in names))
        f.write('},"storage_data":{' + ",".join(f'{json.dumps(str((m, (0,))))}:{where}' for m in names) + "}}")
    header = {m: {"dtype": "F32", "shape": [4], "data_offsets": [16 * i, 16 * i + 16]}
              for i, m in enumerate(sorted(names))}
    write_header(folder / file_name, header, bytes(16 * n))
    return root


def test_a_large_metadata_json_is_read_without_holding_copies(tmp_path):
    """100,000 layout-less parameters (a 38 MB metadata.json): loaded in 3 s within 100 MiB here,
    where ``json.loads`` and a dict per shard took 12 s and 400 MiB."""
    root = write_layoutless_save(tmp_path / "mf", 100_000)
    res = subprocess.run([sys.executable, "-c", LOAD_CHILD, str(root)], capture_output=True, text=True, timeout=300,
                         env=app_env())
    assert res.returncode == 0, res.stderr
    measured = json.loads(res.stdout)
    assert measured["params"] == 100_000
    assert measured["peak_mib"] < 160, measured  # about 100


SETTLE_CHILD = textwrap.dedent("""
    import json, sys
    from reshard_job.core.topology import Topology
    from reshard_job.formats.strategy import parse_protobuf_strategy
    from reshard_job.job.config.spec import TargetSpec
    from reshard_job.job.stages.target import settle_target
    from reshard_job.sources.mindformers_save import load_mindformers
    from reshard_job.sources.rank_folders import LoadedStrategy

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) * 1024

    save = load_mindformers(sys.argv[1])
    source, index = LoadedStrategy(save.topology, save.strategy, ()), save.index()
    try:
        with open("/proc/self/clear_refs", "w") as f:  # the peak from here on: VmHWM set back to VmRSS
            f.write("5")
    except OSError:
        print(json.dumps(None))
        sys.exit(0)
    before = status("VmRSS")
    replicated = {"mesh": {"dp": 1, "mp": 1}, "optimizer_shard": None, "rules": [{"match": ".*", "dims": []}]}
    target = settle_target(TargetSpec(layout=replicated, devices=1), source, index)
    back = Topology.from_strategy(parse_protobuf_strategy(target.strategy_bytes, "strategy.ckpt"))
    print(json.dumps({"compiled": len(target.topology.layouts), "parsed": len(back.layouts),
                      "grown": status("VmHWM") - before}))
""")


def test_a_compiled_target_of_many_parameters_is_written_and_read_without_an_object_each(tmp_path):
    """A declarative target compiled for 60,000 layout-less parameters, its strategy file written
    and read back: under 150 bytes per parameter here beyond what the loaded save holds (the file's
    own bytes among them), where protobuf objects and a layout mapping per parameter took 1,000."""
    n = 60_000
    root = write_layoutless_save(tmp_path / "mf", n)
    res = subprocess.run([sys.executable, "-c", SETTLE_CHILD, str(root)], capture_output=True, text=True,
                         timeout=300, env=app_env())
    assert res.returncode == 0, res.stderr
    measured = json.loads(res.stdout)
    if measured is None:
        pytest.skip("this kernel does not let a process reset its peak RSS (/proc/self/clear_refs)")
    assert measured["compiled"] == measured["parsed"] == n
    assert measured["grown"] < 300 * n, measured


# ================================================================================ 6. total_size


def test_a_total_size_that_is_not_the_shards_is_refused(tmp_path, hf):
    total = json.loads((hf / INDEX).read_text())["metadata"]["total_size"]
    path = edit_index(hf, lambda doc: doc["metadata"].update(total_size=total + 2))
    error = refused(tmp_path, *hf_args(hf, tmp_path / "out"))
    assert error == (f"{path}: metadata.total_size says {total + 2} bytes, but the tensors of its 2 shard(s) hold "
                     f"{total} bytes (the files {sum(p.stat().st_size for p in hf.glob('*.safetensors'))}); "
                     f"the index describes other shards, or was edited")


@pytest.mark.parametrize("variant", ["float", "file sizes", "no total_size", "no metadata"])
def test_total_sizes_real_exports_write_are_accepted(tmp_path, hf, variant):
    files = sum(p.stat().st_size for p in hf.glob("*.safetensors"))
    edit_index(hf, {
        "float": lambda doc: doc["metadata"].update(total_size=float(doc["metadata"]["total_size"])),
        "file sizes": lambda doc: doc["metadata"].update(total_size=files),
        "no total_size": lambda doc: doc["metadata"].pop("total_size"),
        "no metadata": lambda doc: doc.pop("metadata"),
    }[variant])
    converted(tmp_path, *hf_args(hf, tmp_path / "out"))


# ================================================================================ 7. and the like


def test_a_garbled_crc_trailer_of_a_ckpt_names_the_file(tmp_path):
    from reliability_helpers import copy_s1, s1_args

    ckpts, src, dst = copy_s1(tmp_path / "src")
    victim = ckpts / "rank_2" / "checkpoint_2.ckpt"
    victim.write_bytes(victim.read_bytes() + b"crc_num" + b"\xff" * 10)
    error = refused(tmp_path, *s1_args(ckpts, src, dst, tmp_path / "out"))
    assert error.startswith(f"{victim}: CRC32 mismatch: trailer says ")


@pytest.mark.parametrize("case,change,needle", [
    ("deep nesting", lambda d: d["state_dict_metadata"]["lm_head.weight"].update(global_shape="NEST"),
     "nested too deeply"),
    ("20 MiB name", lambda d: d["state_dict_metadata"].__setitem__("x" * (20 << 20), {}),
     "a value of more than"),
    ("absolute file", lambda d: next(iter(d["storage_data"].values()))[0].update(file_name="/etc/passwd"),
     "file_name '/etc/passwd' must be a file of the iteration folder"),
    ("dot-dot file", lambda d: next(iter(d["storage_data"].values()))[0].update(file_name="../x.safetensors"),
     "must be a file of the iteration folder"),
    ("negative dim", lambda d: d["state_dict_metadata"]["lm_head.weight"].update(global_shape=[-32, 32]),
     "global_shape must be a list of non-negative integers"),
    ("float dim", lambda d: d["state_dict_metadata"]["lm_head.weight"].update(global_shape=[32.0, 32]),
     "global_shape must be a list of non-negative integers"),
    ("duplicate parameter", "DUP", "describes parameter 'lm_head.weight' twice"),
])
def test_other_hostile_metadata_is_one_line(tmp_path, save, case, change, needle):
    path = metadata(save)
    if change == "DUP":
        data = path.read_bytes()
        start = data.index(b'"lm_head.weight":')
        entry = data[start:data.index(b'"adam_m.lm_head.weight":')]
        path.write_bytes(data.replace(entry, entry + entry, 1))
    else:
        edit_metadata(save, change)
        if case == "deep nesting":
            path.write_bytes(path.read_bytes().replace(b'"NEST"', b"[" * 100_000 + b"]" * 100_000))
    error = refused(tmp_path, *mf_args(save, tmp_path / "out"))
    assert error.startswith(f"{path}: ") and needle in error, error


@pytest.mark.parametrize("case,change,needle", [
    ("absolute file", lambda d: d["weight_map"].update({"lm_head.weight": "/etc/passwd"}),
     "weight_map names '/etc/passwd', which is not a file of the export folder"),
    ("dot-dot", lambda d: d["weight_map"].update({"lm_head.weight": ".."}), "which is not a file of the export"),
    ("deep nesting", lambda d: d.update(extra="NEST"), "nested too deeply"),
    ("duplicate tensor", "DUP", "weight_map lists tensor 'lm_head.weight' twice"),
])
def test_other_hostile_indexes_are_one_line(tmp_path, hf, case, change, needle):
    path = hf / INDEX
    if change == "DUP":
        text = path.read_text()
        line = next(ln for ln in text.splitlines() if '"lm_head.weight"' in ln)
        path.write_text(text.replace(line, line + "\n" + line, 1))
    else:
        edit_index(hf, change)
        path.write_bytes(path.read_bytes().replace(b'"NEST"', b"[" * 100_000 + b"]" * 100_000))
    error = refused(tmp_path, *hf_args(hf, tmp_path / "out"))
    assert error.startswith(f"{path}: ") and needle in error, error
