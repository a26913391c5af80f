"""A recorded load keeps the fingerprint of what each tensor it returned holds, where it lies in its
parameter; the loads of every target rank, put back together, hold the fingerprints the conversion of
the same sources to the same layout records in ``manifest.json``; loads of some ranks say which
parameters they leave incomplete, and ranks that loaded different bytes for one box are named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import update

import reshard_job
from reshard_job.core.fingerprint import ALGORITHM, Fingerprint, fingerprint_array
from reshard_job.errors import ReshardError
from reshard_job.job.config.spec import JobContext, JobSpec, LineageSpec, OutputSpec, RunSpec, SourceSpec, TargetSpec
from reshard_job.job.runner import run_job
from reshard_job.lineage import LineageStore
from reshard_job.lineage.models import LoadFingerprint, Run

GOLDEN = Path(__file__).parents[2] / "golden"
# case -> (scenario, source strategy, target strategy): optimizer parallel to model parallel, pipeline
# stages to a flat target, and into a target with pipeline stages and optimizer shards (its own layout)
CASES = {
    "S2": ("S2_block_mp4dp2opt_to_mp4", "src_strategy.ckpt", "dst_strategy.ckpt"),
    "S3": ("S3_pipeline2x4opt_to_4", "src_strategy_dir", "dst_strategy.ckpt"),
    "S3-into-pipeline": ("S3_pipeline2x4opt_to_4", "src_strategy_dir", "src_strategy_merged.ckpt"),
}


def _converted(tmp_path: Path, d: Path, src_strategy: str, dst_strategy: str) -> dict:
    """The job's ``manifest.json`` for the scenario's conversion, run in this process."""
    out = tmp_path / "out"
    spec = JobSpec(SourceSpec(str(d / "src_checkpoints"), str(d / src_strategy)),
                   TargetSpec(strategy=str(d / dst_strategy)), OutputSpec(str(out)), LineageSpec(False, ""),
                   RunSpec(progress=False, workers=1), JobContext(str(tmp_path), str(tmp_path / "run"), ()), config={})
    run_job(spec, emit=lambda _: None)
    return json.loads((out / "manifest.json").read_text())


def _load_every_rank(d: Path, src_strategy: str, url: str, ranks, dst_strategy: str = "dst_strategy.ckpt") -> list[str]:
    """Load `ranks` with lineage at `url`; the run ids of the loads, in rank order."""
    with LineageStore(url) as store:
        store.ensure_schema()
        known = set(_run_ids(store))
    for rank in ranks:
        reshard_job.load_rank(rank, d / "src_checkpoints", d / src_strategy, d / dst_strategy,
                              consumer="eval-7b", lineage_url=url)
    with LineageStore(url) as store:
        new = [r for r in _run_ids(store) if r not in known]
        with store.read_session() as session:
            return sorted(new, key=lambda r: session.get(Run, r).config["load"]["rank"])


def _run_ids(store) -> list[str]:
    with store.read_session() as session:
        return list(session.scalars(Run.__table__.select().with_only_columns(Run.id)))


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_loads_of_every_target_rank_put_together_equal_the_conversions_fingerprints(case, tmp_path):
    scenario, src_strategy, dst_strategy = CASES[case]
    d = GOLDEN / scenario
    manifest = _converted(tmp_path, d, src_strategy, dst_strategy)
    url = f"sqlite:///{tmp_path / 'lineage.db'}"
    loads = _load_every_rank(d, src_strategy, url, range(manifest["target"]["devices"]), dst_strategy)
    merged = reshard_job.merge_load_fingerprints(loads, lineage_url=url)
    assert merged.complete and merged.algorithm == manifest["fingerprints"]["algorithm"] == ALGORITHM
    assert merged.fingerprints == manifest["fingerprints"]["target"]
    # a unique prefix of each id will do
    assert reshard_job.merge_load_fingerprints([r[:8] for r in loads], lineage_url=url).fingerprints == \
        merged.fingerprints


def test_loads_of_some_ranks_say_which_parameters_are_partial(tmp_path):
    d = GOLDEN / "S2_block_mp4dp2opt_to_mp4"
    url = f"sqlite:///{tmp_path / 'lineage.db'}"
    loads = _load_every_rank(d, "src_strategy.ckpt", url, [0, 1])
    merged = reshard_job.merge_load_fingerprints(loads, lineage_url=url)
    assert not merged.complete and not merged.conflicts
    loaded = reshard_job.load_rank(0, d / "src_checkpoints", d / "src_strategy.ckpt", d / "dst_strategy.ckpt")
    assert set(merged.fingerprints) | set(merged.incomplete) == set(loaded)
    assert merged.fingerprints and merged.incomplete
    rows = _rows(url, loads[0])
    # the target is model-parallel 4: a parameter it splits is half loaded by ranks 0 and 1, ...
    for name, why in merged.incomplete.items():
        total = int(np.prod([int(n) for n in rows[name].shape.split(",")]))
        assert not _whole(rows[name]) and why == f"{total // 2} of its {total} elements loaded (by ranks [0, 1])"
    # ... one it replicates is whole on rank 0, and its fingerprint is the whole tensor's
    for name, digest in merged.fingerprints.items():
        assert _whole(rows[name]) and digest == fingerprint_array(rows[name].dtype, loaded[name])


def _rows(url: str, run_id: str) -> dict:
    """Name -> the load's row (run_id, name, digest, algorithm, dtype, shape, box), as recorded."""
    table = LoadFingerprint.__table__
    with LineageStore(url) as store, store.read_session() as session:
        return {r.name: r for r in session.execute(table.select().where(table.c.run_id == run_id))}


def _whole(row) -> bool:
    return row.box == ",".join(f"0:{n}" for n in row.shape.split(",") if n)


def test_a_share_is_the_fingerprint_of_the_rank_s_slice_where_it_lies(tmp_path):
    d = GOLDEN / "S2_block_mp4dp2opt_to_mp4"
    url = f"sqlite:///{tmp_path / 'lineage.db'}"
    [load] = _load_every_rank(d, "src_strategy.ckpt", url, [3])
    arrays = reshard_job.load_rank(3, d / "src_checkpoints", d / "src_strategy.ckpt", d / "dst_strategy.ckpt")
    rows = _rows(url, load)
    assert set(rows) == set(arrays)  # every tensor returned, optimizer states too
    assert any(n.startswith("adam_") for n in rows)
    sliced = [n for n, r in rows.items() if not _whole(r)]
    assert sliced
    for name in sliced:
        row = rows[name]
        box = tuple(tuple(int(i) for i in part.split(":")) for part in row.box.split(","))
        shape = tuple(int(n) for n in row.shape.split(","))
        assert tuple(hi - lo for lo, hi in box) == arrays[name].shape
        assert row.digest == Fingerprint(row.dtype, shape).add_box(box, arrays[name]).hexdigest(partial=True)
        assert row.algorithm == ALGORITHM


def test_ranks_that_loaded_different_bytes_for_one_box_are_named_not_merged(tmp_path):
    d = GOLDEN / "S2_block_mp4dp2opt_to_mp4"
    url = f"sqlite:///{tmp_path / 'lineage.db'}"
    loads = _load_every_rank(d, "src_strategy.ckpt", url, range(4))
    whole = next(n for n, r in _rows(url, loads[2]).items() if _whole(r) and r.shape)
    with LineageStore(url) as store, store.engine.begin() as connection:
        connection.execute(update(LoadFingerprint).values(digest="0" * 32)
                           .where(LoadFingerprint.run_id == loads[2], LoadFingerprint.name == whole))
    merged = reshard_job.merge_load_fingerprints(loads, lineage_url=url)
    assert list(merged.conflicts) == [whole] and whole not in merged.fingerprints
    assert "loaded different bytes" in merged.conflicts[whole] and " 2" in merged.conflicts[whole]


def test_a_run_that_is_not_a_load_is_refused_in_one_line(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'lineage.db'}"
    source = tmp_path / "model.ckpt"
    source.write_bytes(b"weights")
    run_id = reshard_job.record_use("finetune", [source], lineage_url=url)
    with pytest.raises(ReshardError, match=rf"^run {run_id} is not a load"):
        reshard_job.merge_load_fingerprints([run_id], lineage_url=url)
    monkeypatch.setenv("RESHARD_JOB_LINEAGE_URL", url)  # no URL given: the environment's database
    with pytest.raises(ReshardError, match="not a load"):
        reshard_job.merge_load_fingerprints(run_id)


def test_audit_show_of_a_load_states_its_fingerprints(tmp_path, capsys):
    from reshard_job.audit import main as audit

    d = GOLDEN / "S2_block_mp4dp2opt_to_mp4"
    url = f"sqlite:///{tmp_path / 'lineage.db'}"
    [load] = _load_every_rank(d, "src_strategy.ckpt", url, [1])
    count = len(reshard_job.load_rank(1, d / "src_checkpoints", d / "src_strategy.ckpt", d / "dst_strategy.ckpt"))
    shown = subprocess.run([sys.executable, "-m", "reshard_job.audit", "--db", url, "show", load[:8]],
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert f"fingerprints {count} loaded, each the share its rank holds ({ALGORITHM})" in " ".join(shown.stdout.split())
    assert audit(["--db", url, "show", load, "--json"]) == 0
    fingerprints = json.loads(capsys.readouterr().out)["fingerprints"]
    assert fingerprints["loaded"] == count and fingerprints["algorithm"] == ALGORITHM
