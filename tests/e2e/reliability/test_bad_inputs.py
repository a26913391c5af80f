"""Bad input, one test each: a non-zero exit, one error line naming the file/rank/parameter at fault,
nothing recorded as an output, and the sources untouched.

Each case builds its own damaged copy of a golden scenario and runs the job in its own process
(forked from a pre-imported interpreter, see ``Launcher``); to keep the suite fast the selected
cases run a few at a time in one module-scoped batch, and each test then checks its own outcome.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from reliability_helpers import (GOLDEN, S1, S3, Launcher, assert_nothing_recorded, copy_s1, log_lines, rewrite_ckpt,
                                 run_app, s1_args, snapshot, the_error)

from reshard_job.errors import MissingRankError
from reshard_job.formats.ckpt import CheckpointReader, record_header
from reshard_job.formats.rewrite import copy_checkpoint
from reshard_job.formats.strategy import read_strategy, to_json_bytes, write_strategy
from reshard_job.text import shorten


@dataclass
class Setup:
    args: list[str]
    expect: list[str]  # substrings of the error line (or, for ok cases, of a warning line)
    sources: list[Path] = field(default_factory=list)  # snapshotted before and after
    ok: bool = False  # the job must succeed (with a warning)


@dataclass(frozen=True)
class Case:
    id: str
    build: Callable[[Path], Setup]

    def __repr__(self) -> str:
        return self.id


def _s1(d: Path, out_name: str = "out") -> tuple[Path, Path, Path, list[str]]:
    ckpts, src, dst = copy_s1(d)
    return ckpts, src, dst, s1_args(ckpts, src, dst, d / out_name)


def _rank_file(ckpts: Path, r: int) -> Path:
    return ckpts / f"rank_{r}" / f"checkpoint_{r}.ckpt"


# ---------------------------------------------------------------------------------- 1. source dir


def source_missing(d: Path) -> Setup:
    _, src, dst, _ = _s1(d)
    return Setup(s1_args(d / "no_such_dir", src, dst, d / "out"),
                 [f"source checkpoint directory not found: {d / 'no_such_dir'}"])


def source_empty(d: Path) -> Setup:
    _, src, dst, _ = _s1(d)
    (d / "empty").mkdir()
    return Setup(s1_args(d / "empty", src, dst, d / "out"),
                 [f"source checkpoint directory {d / 'empty'} is empty; expected rank_0/, rank_1/"])


def source_without_rank_dirs(d: Path) -> Setup:
    _, src, dst, _ = _s1(d)
    (d / "flat").mkdir()
    shutil.copy(_rank_file(S1 / "src_checkpoints", 0), d / "flat" / "checkpoint_0.ckpt")
    (d / "flat" / "rank0").mkdir()
    return Setup(s1_args(d / "flat", src, dst, d / "out"),
                 [f"source checkpoint directory {d / 'flat'} has no rank_<r>/ directories"], [d / "flat"])


def source_is_a_file(d: Path) -> Setup:
    ckpts, src, dst, _ = _s1(d)
    f = _rank_file(ckpts, 0)
    # one rank's file is read as a whole model, which the 8-device source strategy cannot lay out
    return Setup(s1_args(f, src, dst, d / "out"), [f"source checkpoints {f} is a single checkpoint file, one whole "
                                                   f"model, but source.strategy {src} lays out 8 devices"], [ckpts])


def rank_dir_without_checkpoint(d: Path) -> Setup:
    ckpts, _, _, args = _s1(d)
    _rank_file(ckpts, 3).rename(ckpts / "rank_3" / "notes.txt")
    return Setup(args, [f"{ckpts}: no checkpoint file in rank directory rank_3"], [ckpts])


# ---------------------------------------------------------------------------------- 2./3. ranks


def ranks_missing(d: Path) -> Setup:
    ckpts, _, _, args = _s1(d)
    for r in (2, 3):
        shutil.rmtree(ckpts / f"rank_{r}")
    # rank_list_for_transform: targets 0 and 2 read ranks [2, 0]; targets 1 and 3 read [3, 1]
    want = str(MissingRankError({2: [0, 2], 3: [1, 3]}, str(ckpts)))
    assert want.endswith("rank 2 (needed by target ranks 0, 2); rank 3 (needed by target ranks 1, 3)")
    return Setup(args, [want], [ckpts])


def ranks_missing_plan_mode(d: Path) -> Setup:
    s = ranks_missing(d)
    s.args.append("job.mode=plan")  # the same message as a conversion, naming the checkpoint directory
    return s


def pipeline_rank_missing(d: Path) -> Setup:
    ckpts = d / "ckpts"
    shutil.copytree(S3 / "src_checkpoints", ckpts)
    shutil.rmtree(ckpts / "rank_5")
    args = [f"source.checkpoints={ckpts}", f"source.strategy={S3 / 'src_strategy_dir'}", "target=strategy",
            f"target.strategy={S3 / 'dst_strategy.ckpt'}", f"output.dir={d / 'out'}"]
    return Setup(args, [f"missing source checkpoint in {ckpts}: rank 5 (needed by target ranks 0-3)"], [ckpts])


def extra_rank_dirs(d: Path) -> Setup:
    """More rank folders than the strategy has ranks: another run's strategy (whose layouts may fit the
    first ranks' shapes and give a wrong model) or leftovers; refused either way, with both remedies."""
    ckpts, _, _, args = _s1(d)
    for r in (8, 9):
        shutil.copytree(ckpts / "rank_0", ckpts / f"rank_{r}")
    return Setup(args, [f"{ckpts}: rank folders rank_8, rank_9 lie beyond the 8 rank(s) the source strategy describes; "
                        "a strategy describes every rank of the run it was saved with, so either it belongs to "
                        "another run (use the one saved with these checkpoints) or these folders are leftovers of "
                        "another save (move them away)"], [ckpts])


def extra_rank_dir_with_unknown_parameters(d: Path) -> Setup:
    ckpts, _, _, args = _s1(d)
    from reshard_job.formats.ckpt import CheckpointWriter

    extra = ckpts / "rank_8" / "checkpoint_8.ckpt"  # left over from another model
    with CheckpointWriter(extra, mode=0o644) as w:
        w.add("layer1.bias", np.ones(32, np.float32))
        w.add("head.weight", np.ones((4, 4), np.float32))
    return Setup(args, [f"{extra}: rank 8 lies beyond the 8 rank(s) the source strategy describes, but holds 1 "
                        "parameter(s) that no rank within it holds (e.g. 'head.weight')"], [ckpts])


# ---------------------------------------------------------------------------------- 4. broken .ckpt


def ckpt_truncated_mid_record(d: Path) -> Setup:
    ckpts, _, _, args = _s1(d)
    f = _rank_file(ckpts, 2)
    data = f.read_bytes()
    f.write_bytes(data[:100_000])  # inside adam_m.layer1.weight's content
    return Setup(args, [f"{f}: record at offset 56125 needs 50220 bytes but the file ends after 43871 (file truncated?)"],
                 [ckpts])


def ckpt_truncated_in_record_header(d: Path) -> Setup:
    ckpts, _, _, args = _s1(d)
    f = _rank_file(ckpts, 2)
    with CheckpointReader(f) as r:
        last = r.records_of(r.entries["adam_v.layer3.bias"])[0].offset
    f.write_bytes(f.read_bytes()[: last + 1])  # the record's key byte, and not its length
    return Setup(args, [f"{f}: record at offset {last}: truncated varint (file truncated?)"], [ckpts])


def ckpt_zero_bytes(d: Path) -> Setup:
    ckpts, _, _, args = _s1(d)
    f = _rank_file(ckpts, 2)
    f.write_bytes(b"")
    return Setup(args, [f"{f}: empty file (0 bytes), expected MindSpore checkpoint records"], [ckpts])


def ckpt_random_bytes(d: Path) -> Setup:
    ckpts, _, _, args = _s1(d)
    f = _rank_file(ckpts, 2)
    data = bytearray(np.random.default_rng(3).bytes(4096))
    data[0] = 0xC3
    f.write_bytes(bytes(data))
    return Setup(args, [f"{f}: wrong magic: not a MindSpore checkpoint (byte 0xc3 at offset 0, expected 0x0a)"], [ckpts])


def ckpt_is_a_text_file(d: Path) -> Setup:
    ckpts, _, _, args = _s1(d)
    f = _rank_file(ckpts, 2)
    f.write_text("# training notes\nloss went down\n")
    return Setup(args, [f"{f}: wrong magic: not a MindSpore checkpoint (byte 0x23 at offset 0, expected 0x0a)"], [ckpts])


def ckpt_text_starting_with_newline(d: Path) -> Setup:
    ckpts, _, _, args = _s1(d)
    f = _rank_file(ckpts, 2)
    f.write_text("\nhello\n")  # 0x0a is the record key byte; 'h' as a length runs past the end
    return Setup(args, [f"{f}: record at offset 0 needs 104 bytes but the file ends after 5 (file truncated?)"], [ckpts])


# ---------------------------------------------------------------------------------- 5. CRC


def _with_crc(ckpts: Path) -> None:
    for r in range(8):
        f = _rank_file(ckpts, r)
        with CheckpointReader(f) as reader:
            copy_checkpoint(reader, f.with_suffix(".crc"), crc=True)
        os.replace(f.with_suffix(".crc"), f)


def crc_mismatch(d: Path) -> Setup:
    ckpts, _, _, args = _s1(d)
    _with_crc(ckpts)
    f = _rank_file(ckpts, 2)
    os.chmod(f, 0o644)
    data = bytearray(f.read_bytes())
    data[60_000] ^= 0x01  # one bit of adam_m.layer1.weight
    f.write_bytes(bytes(data))
    return Setup(args, [f"{f}: CRC32 mismatch: trailer says ", "(file corrupted)"], [ckpts])


# ---------------------------------------------------------------------------------- 6. content length


def tensor_content_disagrees_with_dims(d: Path) -> Setup:
    ckpts, _, _, args = _s1(d)
    f = _rank_file(ckpts, 2)
    content = np.zeros(10, np.float32).tobytes()
    f.write_bytes(f.read_bytes() + record_header("extra.scale", (3, 4), "Float32", len(content)) + content)
    return Setup(args, [f"{f}: parameter 'extra.scale': 40 bytes of data but dims [3, 4] of Float32 need 48"], [ckpts])


def tensor_content_runs_past_its_record(d: Path) -> Setup:
    ckpts, _, _, args = _s1(d)
    f = _rank_file(ckpts, 2)
    content = np.zeros(4, np.float32).tobytes()
    rec = bytearray(record_header("extra.scale", (4,), "Float32", len(content)) + content)
    rec[-len(content) - 1] = 0x7F  # tensor_content claims 127 bytes, the record holds 16
    f.write_bytes(f.read_bytes() + bytes(rec))
    size = f.stat().st_size
    return Setup(args, [f"{f}: record at offset {size - len(rec)}: tensor_content runs past the tensor"], [ckpts])


# ---------------------------------------------------------------------------------- 7. strategy files


def _replace_src_strategy(d: Path, name: str, data: bytes) -> tuple[list[str], Path]:
    ckpts, _, dst, _ = _s1(d)
    f = d / name
    f.write_bytes(data)
    return s1_args(ckpts, f, dst, d / "out"), f


def strategy_random_bytes(d: Path) -> Setup:
    args, f = _replace_src_strategy(d, "src_strategy_bad.ckpt", np.random.default_rng(5).bytes(2000))
    return Setup(args, [f"{f}: not a valid protobuf strategy file (a name that does not end in .json is read as protobuf)"], [f])


def strategy_truncated(d: Path) -> Setup:
    args, f = _replace_src_strategy(d, "src_strategy_cut.ckpt", (S1 / "src_strategy.ckpt").read_bytes()[:700])
    return Setup(args, [f"{f}: not a valid protobuf strategy file"], [f])


def strategy_empty(d: Path) -> Setup:
    args, f = _replace_src_strategy(d, "src_strategy_empty.ckpt", b"")
    return Setup(args, [f"{f}: strategy file is empty (0 bytes)"], [f])


def strategy_protobuf_named_json(d: Path) -> Setup:
    args, f = _replace_src_strategy(d, "src_strategy.json", (S1 / "src_strategy.ckpt").read_bytes())
    return Setup(args, [f"{f}: not valid JSON (", "); a name ending in .json is read as JSON"], [f])


def strategy_json_named_ckpt(d: Path) -> Setup:
    data = to_json_bytes(read_strategy(S1 / "src_strategy.ckpt"))
    args, f = _replace_src_strategy(d, "src_strategy_json.ckpt", data)
    return Setup(args, [f"{f}: not a valid protobuf strategy file (a name that does not end in .json is read as protobuf)"], [f])


def strategy_json_truncated(d: Path) -> Setup:
    data = to_json_bytes(read_strategy(S1 / "src_strategy.ckpt"))
    args, f = _replace_src_strategy(d, "src_strategy.json", data[:-25])
    return Setup(args, [f"{f}: not valid JSON (Unterminated string"], [f])


def strategy_json_wrong_shape(d: Path) -> Setup:
    args, f = _replace_src_strategy(d, "src_strategy.json", b'[{"dev_matrix": [8]}]')
    return Setup(args, [f"{f}: JSON strategy must be an object with 'parallel_layout_item'"], [f])


def strategy_json_layout_lacks_key(d: Path) -> Setup:
    doc = json.loads(to_json_bytes(read_strategy(S1 / "src_strategy.ckpt")))
    del doc["parallel_layout_item"]["layer1.weight"]["tensor_map"]
    args, f = _replace_src_strategy(d, "src_strategy.json", json.dumps(doc).encode())
    return Setup(args, [f"{f}: parameter 'layer1.weight': layout lacks 'tensor_map'"], [f])


def strategy_file_missing(d: Path) -> Setup:
    ckpts, _, dst, _ = _s1(d)
    return Setup(s1_args(ckpts, d / "nowhere.ckpt", dst, d / "out"), [f"strategy file not found: {d / 'nowhere.ckpt'}"])


def target_strategy_corrupt(d: Path) -> Setup:
    ckpts, src, _, _ = _s1(d)
    f = d / "dst_bad.ckpt"
    f.write_bytes((S1 / "dst_strategy.ckpt").read_bytes()[:500])
    return Setup(s1_args(ckpts, src, f, d / "out"), [f"{f}: not a valid protobuf strategy file"], [f])


def target_strategy_of_another_network(d: Path) -> Setup:
    """S1's MLP sources with the target strategy of S2's network: every weight would be left out."""
    ckpts, src, _, _ = _s1(d)
    other = GOLDEN / "S2_block_mp4dp2opt_to_mp4" / "dst_strategy.ckpt"
    return Setup(s1_args(ckpts, src, other, d / "out"),
                 [f"the target strategy {other} lays out none of the ", f"source strategy {src}",
                  "it is the strategy of another network"], [ckpts])


def lineage_database_not_a_database(d: Path) -> Setup:
    """lineage.url names a text file: one line naming the database, no extra log line before it."""
    ckpts, src, dst, args = _s1(d)
    notes = d / "notes.db"
    notes.write_text("not a database\n" * 100)
    return Setup(args + [f"lineage.url=sqlite:///{notes}"], [f"{notes}"], [ckpts, notes])


def pipeline_buffers_left_out(d: Path) -> Setup:
    """S3's pipeline sources to 4 ranks: the 30 accu_grads buffers are left out, said in one warning."""
    d.mkdir(parents=True, exist_ok=True)
    args = [f"source.checkpoints={S3 / 'src_checkpoints'}", f"source.strategy={S3 / 'src_strategy_dir'}",
            "target=strategy", f"target.strategy={S3 / 'dst_strategy.ckpt'}", f"output.dir={d / 'out'}"]
    return Setup(args, ["30 parameter(s) left out of the outputs", "'accu_grads.", "gradient-accumulation buffer"],
                 [], ok=True)


# ---------------------------------------------------------------------------------- 8. disagreements


def parameter_missing_from_one_rank(d: Path) -> Setup:
    """Ranks 2, 3, 6 and 7 hold the second column block of layer1.weight; a redundancy-removed save
    keeps it on one of them, but with none of them holding it the block is lost."""
    ckpts, _, _, args = _s1(d)
    for r in (2, 3, 6, 7):
        rewrite_ckpt(_rank_file(ckpts, r), drop={"layer1.weight"})
    return Setup(args, ["parameter 'layer1.weight': no source rank holds its block [0:784, 16:32] (1 of its 2 blocks "
                        "are held); ranks [2, 3, 6, 7] should"], [ckpts])


def local_shape_not_a_slice_of_global(d: Path) -> Setup:
    ckpts, _, dst, _ = _s1(d)
    doc = json.loads(to_json_bytes(read_strategy(S1 / "src_strategy.ckpt")))
    doc["parallel_layout_item"]["layer1.weight"]["tensor_shape"] = [784, 30]
    f = d / "src_strategy.json"
    f.write_text(json.dumps(doc))
    return Setup(s1_args(ckpts, f, dst, d / "out"),
                 ["parameter 'layer1.weight': local shape [784, 16] with layout dev [2, 2, 2] map [*, (1)] gives global "
                  "shape [784, 32], but the strategy says [784, 30]"], [ckpts, f])


def local_shape_differs_across_ranks(d: Path) -> Setup:
    ckpts, _, _, args = _s1(d)
    rewrite_ckpt(_rank_file(ckpts, 2), change={"layer1.weight": lambda a, dt: (a[:, :15].copy(), dt)})
    return Setup(args, ["parameter 'layer1.weight': shape differs across source ranks ([784, 16] in rank 0, [784, 15] "
                        "in rank 2)"], [ckpts])


def global_shape_indivisible_by_target(d: Path) -> Setup:
    ckpts, _, _, args = _s1(d)
    for r in range(8):  # layer2.weight is replicated in the source; the target shards its rows 4 ways
        rewrite_ckpt(_rank_file(ckpts, r), change={"layer2.weight": lambda a, dt: (a[:30].copy(), dt)})
    return Setup(args, ["parameter 'layer2.weight': dimension 0 of size 30 cannot be split into 4 equal parts"], [ckpts])


def dtype_differs_across_ranks(d: Path) -> Setup:
    ckpts, _, _, args = _s1(d)
    rewrite_ckpt(_rank_file(ckpts, 5), change={"layer1.bias": lambda a, dt: (a.astype(np.float16), "Float16")})
    return Setup(args, ["parameter 'layer1.bias': dtype differs across source ranks (Float32 in rank 0, Float16 in rank 5)"],
                 [ckpts])


# ---------------------------------------------------------------------------------- 9. pipeline stages


def _s3(d: Path, stage_files: dict[str, bytes]) -> tuple[list[str], Path]:
    sd = d / "stages"
    sd.mkdir(parents=True)
    for name, data in stage_files.items():
        (sd / name).write_bytes(data)
    shutil.copytree(S3 / "src_checkpoints", d / "ckpts")
    args = [f"source.checkpoints={d / 'ckpts'}", f"source.strategy={sd}", "target=strategy",
            f"target.strategy={S3 / 'dst_strategy.ckpt'}", f"output.dir={d / 'out'}"]
    return args, sd


def pipeline_first_stage_missing(d: Path) -> Setup:
    args, sd = _s3(d, {"stage1.ckpt": (S3 / "src_strategy_dir" / "stage1.ckpt").read_bytes()})
    return Setup(args, [f"{sd}: pipeline stage file(s) missing for stage(s) [0]: found stages [1]"], [sd])


def pipeline_last_stage_missing(d: Path) -> Setup:
    args, sd = _s3(d, {"stage0.ckpt": (S3 / "src_strategy_dir" / "stage0.ckpt").read_bytes()})
    rank4 = d / "ckpts" / "rank_4" / "checkpoint_4.ckpt"
    return Setup(args, [f"{rank4}: rank 4 lies beyond the 4 rank(s) the source strategy describes, but holds 64 "
                        f"parameter(s) that no rank within it holds", f"is a pipeline stage's strategy file missing from {sd}?"],
                 [sd, d / "ckpts"])


def pipeline_two_files_claim_one_stage(d: Path) -> Setup:
    sf = read_strategy(S3 / "src_strategy_dir" / "stage1.ckpt")
    name = next(iter(sf.layouts))
    from dataclasses import replace

    sf.layouts[name] = replace(sf.layouts[name], opt_shard_size=0, opt_shard_step=0,
                               tensor_map=tuple(-1 for _ in sf.layouts[name].tensor_map))
    args, sd = _s3(d, {"stage0.ckpt": (S3 / "src_strategy_dir" / "stage0.ckpt").read_bytes(),
                       "stage1.ckpt": (S3 / "src_strategy_dir" / "stage1.ckpt").read_bytes()})
    write_strategy(sf, sd / "stage1_rank6.ckpt", mode=0o644)
    return Setup(args, [f"{sd / 'stage1_rank6.ckpt'}: claims pipeline stage 1, like {sd / 'stage1.ckpt'}, but its "
                        "layouts differ"], [sd])


def pipeline_stage_dir_empty(d: Path) -> Setup:
    args, sd = _s3(d, {"README": b"stage files go here"})
    return Setup(args, [f"{sd}: no strategy files (*.ckpt or *.json) in pipeline strategy directory"], [sd])


# ---------------------------------------------------------------------------------- 10. target layout


def _layout(d: Path, *overrides: str) -> Setup:
    ckpts, src, _, _ = _s1(d)
    args = [f"source.checkpoints={ckpts}", f"source.strategy={src}", f"output.dir={d / 'out'}", *overrides]
    return Setup(args, [], [ckpts, src])


def layout_unknown_axis(d: Path) -> Setup:
    s = _layout(d, "target.layout.rules=[{match: 'layer1\\.weight', dims: [null, tp]}, {match: '.*', dims: []}]")
    s.expect = ["target.layout.rules[0]: unknown axis 'tp' (mesh axes: dp, mp)"]
    return s


def layout_wrong_number_of_dims(d: Path) -> Setup:
    s = _layout(d, "target.layout.rules=[{match: 'layer1\\.weight', dims: [null, mp, null]}, {match: '.*', dims: []}]")
    s.expect = ["parameter 'layer1.weight' has 2 dimension(s) [784, 32] but target.layout.rules[0] (match "
                "'layer1\\\\.weight') gives 3 dims entries"]
    return s


def layout_indivisible_dimension(d: Path) -> Setup:
    s = _layout(d, "target.devices=3")
    s.expect = ["parameter 'layer1.weight': dimension 1 of size 32 is not divisible by mp = 3 (target.layout.rules[0]"]
    return s


def layout_mesh_product_not_devices(d: Path) -> Setup:
    s = _layout(d, "target.layout.mesh={dp: 2, mp: 4}")
    s.expect = ["target.layout.mesh dp=2 x mp=4 has 8 devices but target.devices is 4"]
    return s


def layout_bad_regex(d: Path) -> Setup:
    s = _layout(d, "target.layout.rules=[{match: '(', dims: []}]")
    s.expect = ["target.layout.rules[0]: match '(' is not a valid regular expression"]
    return s


CASES = [Case(f.__name__, f) for f in [
    source_missing, source_empty, source_without_rank_dirs, source_is_a_file, rank_dir_without_checkpoint,
    ranks_missing, ranks_missing_plan_mode, pipeline_rank_missing, extra_rank_dirs, extra_rank_dir_with_unknown_parameters,
    ckpt_truncated_mid_record, ckpt_truncated_in_record_header, ckpt_zero_bytes, ckpt_random_bytes, ckpt_is_a_text_file,
    ckpt_text_starting_with_newline, crc_mismatch, tensor_content_disagrees_with_dims, tensor_content_runs_past_its_record,
    strategy_random_bytes, strategy_truncated, strategy_empty, strategy_protobuf_named_json, strategy_json_named_ckpt,
    strategy_json_truncated, strategy_json_wrong_shape, strategy_json_layout_lacks_key, strategy_file_missing,
    target_strategy_corrupt, target_strategy_of_another_network, pipeline_buffers_left_out,
    lineage_database_not_a_database,
    parameter_missing_from_one_rank, local_shape_not_a_slice_of_global,
    local_shape_differs_across_ranks, global_shape_indivisible_by_target, dtype_differs_across_ranks,
    pipeline_first_stage_missing, pipeline_last_stage_missing, pipeline_two_files_claim_one_stage,
    pipeline_stage_dir_empty, layout_unknown_axis, layout_wrong_number_of_dims, layout_indivisible_dimension,
    layout_mesh_product_not_devices, layout_bad_regex,
]]


@dataclass
class Outcome:
    dir: Path
    setup: Setup
    result: subprocess.CompletedProcess
    before: dict
    after: dict


def _run_case(case: Case, d: Path, launchers: queue.Queue) -> Outcome:
    setup = case.build(d)
    before = snapshot(*setup.sources)
    launcher = launchers.get()
    try:
        res = launcher.run(d, setup.args)
    finally:
        launchers.put(launcher)
    return Outcome(d, setup, res, before, snapshot(*setup.sources))


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory) -> dict[str, Outcome | BaseException]:
    """Run the selected cases, a few at a time (each in its own process, see Launcher)."""
    selected = {item.callspec.params["case"].id for item in request.session.items
                if getattr(item, "module", None) is request.module and hasattr(item, "callspec")}
    cases = [c for c in CASES if c.id in selected]
    root = tmp_path_factory.mktemp("bad_inputs")
    n = max(2, min(3, os.cpu_count() or 1))
    launchers: queue.Queue = queue.Queue()
    started = [Launcher() for _ in range(min(n, len(cases)))]
    for launcher in started:
        launchers.put(launcher)
    try:
        with ThreadPoolExecutor(max_workers=len(started) or 1) as pool:
            futures = {c.id: pool.submit(_run_case, c, root / c.id, launchers) for c in cases}
            results: dict[str, Outcome | BaseException] = {}
            for cid, f in futures.items():
                try:
                    results[cid] = f.result()
                except Exception as e:  # a broken case fails its own test, not the others
                    results[cid] = e
            return results
    finally:
        for launcher in started:
            launcher.close()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, outcomes):
    o = outcomes[case.id]
    if isinstance(o, BaseException):
        raise o
    res = o.result
    if o.setup.ok:
        assert res.returncode == 0, res.stderr
        warnings = log_lines(res.stdout + res.stderr, "WARNING")  # Hydra logs to stdout
        assert any(all(e in w for e in o.setup.expect) for w in warnings), res.stdout
        assert (o.dir / "out" / "manifest.json").exists()
    else:
        error = the_error(res)
        for e in o.setup.expect:
            assert e in error, f"{e!r} not in {error!r}"
        noise = log_lines(res.stdout + res.stderr, "WARNING") + log_lines(res.stdout + res.stderr, "ERROR")
        assert not noise, f"a refused run prints its one line only: {noise}"
        assert_nothing_recorded(o.dir / "out", o.dir / "runs" / "lineage.db", error)
    assert o.after == o.before, "source files changed"



@pytest.mark.parametrize("case", [c for c in CASES if c.id in ("ranks_missing", "crc_mismatch")], ids=str)
def test_launcher_runs_are_plain_cli_runs(tmp_path, case):
    """The batch's forked runs behave exactly like ``python -m reshard_job`` started afresh."""
    setup = case.build(tmp_path / "a")
    case.build(tmp_path / "b")
    with Launcher() as launcher:
        forked = launcher.run(tmp_path / "a", setup.args)
    plain = run_app(tmp_path / "b", *[a.replace(str(tmp_path / "a"), str(tmp_path / "b")) for a in setup.args])
    assert forked.returncode == plain.returncode != 0
    assert forked.stderr.replace(str(tmp_path / "a"), str(tmp_path / "b")) == plain.stderr
