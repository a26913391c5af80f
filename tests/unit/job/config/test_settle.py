"""Settling a configuration: every preset composes against the schema, values are checked at the
edge with one line naming the key, required keys are required, unknown keys are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from reshard_job.errors import ConfigError
import reshard_job.job.config.schema as schema
from reshard_job.job.config.settle import settle
from reshard_job.job.config.spec import JobContext

CONF = Path(__file__).resolve().parents[4] / "reshard_job" / "conf"
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and not p.name.startswith("_"))
PRESETS = [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))]
# presets that leave a path for the user to give (???), and one value that satisfies them
REQUIRED = {("source", "checkpoints"): ["source.checkpoints=/data/ckpt"],
            ("target", "strategy"): ["target.strategy=/data/dst.ckpt"]}


def _compose(*overrides: str):
    schema.register()
    with initialize_config_module("reshard_job.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=False)


def _ctx(tmp_path, *overrides: str, **choices) -> JobContext:
    return JobContext(str(tmp_path), str(tmp_path / "run"), tuple(overrides), choices=choices, from_presets=True)


@pytest.mark.parametrize("group,preset", PRESETS, ids=[f"{g}={p}" for g, p in PRESETS])
def test_every_preset_composes_and_settles(tmp_path, group, preset):
    extra = REQUIRED.get((group, preset), [])
    overrides = [f"{group}={preset}", *extra]
    spec = settle(_compose(*overrides), _ctx(tmp_path, *overrides, **{group: preset}))
    assert spec.run.max_memory >= 1024 and spec.output.dir.startswith(str(tmp_path))


@pytest.mark.parametrize("group,preset,key", [("source", "checkpoints", "source.checkpoints"),
                                               ("target", "strategy", "target.strategy")])
def test_a_preset_that_leaves_a_key_open_makes_it_required(tmp_path, group, preset, key):
    with pytest.raises(ConfigError, match=rf"^{key} is required by the preset {group}={preset}: set {key}="):
        settle(_compose(f"{group}={preset}"), _ctx(tmp_path, f"{group}={preset}", **{group: preset}))


@pytest.mark.parametrize("override,message", [
    ("job.workers=0", "job.workers must be an integer from 1 to 1024, or null for the CPU count; got 0"),
    ("job.workers=-3", "job.workers must be an integer from 1 to 1024"),
    ("job.max_memory=0", "job.max_memory must lie between 1KiB and 1TiB (e.g. 256MiB), got 0"),
    ("job.max_memory=inf", "job.max_memory: not a finite size"),
    ("job.max_memory=1e400", "job.max_memory: not a finite size"),
    ("job.max_memory=2TiB", "job.max_memory must lie between 1KiB and 1TiB"),
    ("job.max_memory=lots", "job.max_memory: not a size: 'lots'"),
    ("target.devices=0", "target.devices must be an integer from 1 to 65536"),
    ("target.devices=4294967296", "target.devices must be an integer from 1 to 65536"),
    ("target.prefix=" + "p" * 300, "target.prefix has 300 characters; at most 200"),
    ("target.prefix=a/b", "target.prefix must be the start of a file name (no '/'), got 'a/b'"),
    ("target.format=npz", "target.format must be ckpt, safetensors or safetensors_index, got 'npz'"),
    ("target.unmapped=keep", "target.unmapped must be one of omit, full, drop, got 'keep'"),
    ("job.mode=dry", "job.mode must be 'convert' or 'plan', got 'dry'"),
    ("job.ranks=[-1]", "job.ranks entries must be an integer from 0"),
    ("job.ranks=[]", "job.ranks is empty"),
])
def test_bad_values_are_refused_naming_the_key(tmp_path, override, message):
    with pytest.raises(ConfigError) as err:
        settle(_compose(override), _ctx(tmp_path, override))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_mistyped_added_key_gets_the_closest_known_one(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown configuration key target\.devcies; did you mean target\.devices\?"):
        settle(_compose("+target.devcies=4"), _ctx(tmp_path, "+target.devcies=4"))


def test_a_strategy_on_the_command_line_wins_over_the_default_layout(tmp_path):
    spec = settle(_compose("target.strategy=/x/dst.ckpt"), _ctx(tmp_path, "target.strategy=/x/dst.ckpt"))
    assert spec.target.strategy == "/x/dst.ckpt" and spec.target.layout is None and spec.target.devices is None
    both = ("target.strategy=/x/dst.ckpt", "target.devices=4")
    assert settle(_compose(*both), _ctx(tmp_path, *both)).target.devices == 4  # checked against the file later
    layout = ("target.strategy=/x/dst.ckpt", "target.layout.optimizer_shard=dp")
    with pytest.raises(ConfigError, match="give target.strategy or target.layout, not both"):
        settle(_compose(*layout), _ctx(tmp_path, *layout))


def test_paths_resolve_against_the_launch_directory_and_urls_stay(tmp_path):
    o = ("source=checkpoints", "source.checkpoints=ckpt", "source.strategy=s3://bucket/strategy.ckpt",
         "output.dir='~/out'")
    spec = settle(_compose(*o), _ctx(tmp_path, *o))
    assert spec.source.checkpoints == str(tmp_path / "ckpt")
    assert spec.source.strategy == "s3://bucket/strategy.ckpt"
    assert spec.output.dir == str(Path("~/out").expanduser())
    assert spec.lineage.url == f"sqlite:///{tmp_path}/runs/lineage.db"


def test_the_recorded_config_never_holds_a_password(tmp_path):
    o = ("lineage.url=postgresql://alice:s3cret@db/lineage", "+storage.options.secret=SK", "+storage.options.key=AK")
    spec = settle(_compose(*o), _ctx(tmp_path, *o))
    assert spec.lineage.url == "postgresql://alice:s3cret@db/lineage"  # used to connect
    text = repr(spec.config)
    assert "s3cret" not in text and "SK" not in text and "AK" not in text and "alice:***@db" in text
    assert spec.storage.options == {"secret": "SK", "key": "AK"} and "SK" not in repr(spec.storage)


def test_a_composed_configuration_is_converted_once_and_settles_as_its_plain_copy(tmp_path, monkeypatch):
    """Hydra's composition is already typed by the schema: merging it onto the schema again, and
    rebuilding it from the dataclasses twice more, took most of a minute for 10,000 layout rules."""
    from omegaconf import OmegaConf

    rules = "[" + ",".join(f"{{match: 'nomatch{i}', dims: []}}" for i in range(300)) + ",{match: '.*', dims: []}]"
    o = ("target.devices=4", f"target.layout.rules={rules}", "target.include=[layers.*,head.*]",
         "target.rename={layers.: blk.}")
    cfg = _compose(*o)
    plain = OmegaConf.to_container(cfg, resolve=True)
    expected = settle(plain, _ctx(tmp_path, *o))  # a plain dict is merged onto the schema
    for name in ("merge", "structured"):
        monkeypatch.setattr(OmegaConf, name, staticmethod(lambda *a, _name=name, **k: pytest.fail(f"{_name} called")))
    spec = settle(cfg, _ctx(tmp_path, *o))
    assert spec == expected
    assert len(spec.target.layout["rules"]) == 301 and spec.target.layout["rules"][-1] == {"match": ".*", "dims": []}
    assert spec.target.include == ("layers.*", "head.*") and spec.target.rename == (("layers.", "blk."),)
    assert spec.config["target"]["layout"] == spec.target.layout and spec.config["target"]["layout"] is not \
        spec.target.layout


def test_default_workers_follow_cpus_ranks_and_bytes(monkeypatch):
    """job.workers=null: one process per CPU, no more than target ranks, and one per 256 MiB to
    write at most (a conversion of many small parameters stays in one process)."""
    import reshard_job.job.run.local as executors

    monkeypatch.setattr(executors.os, "cpu_count", lambda: 16)
    mib = 1024 ** 2
    assert executors.default_workers(8) == 8
    assert executors.default_workers(32) == 16
    assert executors.default_workers(8, 18 * mib) == 1
    assert executors.default_workers(8, 300 * mib) == 2
    assert executors.default_workers(8, 2070 * mib) == 8
    assert executors.default_workers(4, 0) == 1


def test_job_workers_starts_at_most_four_processes_per_cpu_and_says_so_once(monkeypatch, caplog):
    """job.workers=256 for 256 small ranks forked 256 processes on 2 CPUs (1.45 GB together)."""
    import logging

    import reshard_job.job.run.local as executors
    from reshard_job.job.stages.executor_choice import ExecutorChoice

    monkeypatch.setattr(executors.os, "cpu_count", lambda: 2)
    assert [executors.useful_workers(asked, tasks) for asked, tasks in ((256, 256), (3, 256), (256, 5), (1, 9))] == \
        [8, 3, 5, 1]
    with caplog.at_level(logging.INFO, logger="reshard_job"):
        executor, how = ExecutorChoice(files=None, workers=256).executor_for(256, 80 * 1024 ** 2)
        assert ExecutorChoice(files=None, workers=6).executor_for(4)[0].workers == 4  # (fewer tasks: no line)
    assert executor.workers == 8 and how == "with 8 worker(s)"
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["job.workers=256: using 8 worker processes, 4 per CPU of this machine's 2 (more would only "
                     "wait for the CPUs, each holding its own memory)"]


SIZE_KEYS = ["job.max_memory", "target.max_shard_size"]


@pytest.mark.parametrize("key", SIZE_KEYS)
@pytest.mark.parametrize("text,size", [("512M", 512 * 2**20), ("512MiB", 512 * 2**20), ("5GB", 5 * 10**9),
                                       ("4GiB", 4 * 2**30), ("64k", 64 * 2**10), ("1.5GiB", 3 * 2**29),
                                       ("2048", 2048), ("100KB", 100_000)])
def test_every_size_setting_takes_the_same_units(tmp_path, key, text, size):
    """One parser for every size: what job.max_memory accepts, target.max_shard_size accepts too."""
    overrides = (f"{key}={text}",)
    spec = settle(_compose(*overrides), _ctx(tmp_path, *overrides))
    assert (spec.run.max_memory if key == "job.max_memory" else spec.target.max_shard_size) == size


@pytest.mark.parametrize("key", SIZE_KEYS)
@pytest.mark.parametrize("text", ["lots", "5XB", "inf", "12Mo"])
def test_a_size_that_is_not_one_is_refused_naming_the_key(tmp_path, key, text):
    overrides = (f"{key}={text}",)
    with pytest.raises(ConfigError) as err:
        settle(_compose(*overrides), _ctx(tmp_path, *overrides))
    assert str(err.value).startswith(key) and "\n" not in str(err.value)


@pytest.mark.parametrize("text,size", [
    # what job.max_memory accepted (single letters and their B/iB forms, any case, spaces, fractions)
    ("1k", 2**10), ("1K", 2**10), ("1m", 2**20), ("1G", 2**30), ("1t", 2**40), ("1kb", 10**3), ("1KiB", 2**10),
    ("1 GiB", 2**30), ("0.5M", 2**19), ("100b", 100), ("100", 100), (100, 100),
    # what target.max_shard_size accepted (decimal and binary units with B)
    ("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("2TB", 2 * 10**12), ("4GiB", 4 * 2**30), ("1TiB", 2**40),
    ("1.5GB", 1_500_000_000), (" 5 GB ", 5 * 10**9), ("10B", 10),
])
def test_the_size_parser_keeps_every_spelling_either_setting_took(text, size):
    from reshard_job.core.sizes import parse_size
    from reshard_job.plan.export_shards import parse_shard_size

    assert parse_size(text) == size == parse_shard_size(text)


@pytest.mark.parametrize("value", [True, "lots", "1e400", "nan", "5XB", "GB", ""])
def test_the_size_parser_refuses_what_is_not_a_size(value):
    from reshard_job.core.sizes import parse_size

    with pytest.raises(ValueError):
        parse_size(value)


def test_a_lineage_url_given_as_a_path_is_the_sqlite_file_there(tmp_path):
    spec = settle(_compose("lineage.url=team/lineage.db"), _ctx(tmp_path, "lineage.url=team/lineage.db"))
    assert spec.lineage.url == f"sqlite:///{tmp_path / 'team' / 'lineage.db'}"


def test_the_environment_names_the_lineage_database_unless_the_command_line_does(tmp_path, monkeypatch):
    monkeypatch.setenv("RESHARD_JOB_LINEAGE_URL", "postgresql+psycopg://me@db/lineage")
    assert settle(_compose(), _ctx(tmp_path)).lineage.url == "postgresql+psycopg://me@db/lineage"
    given = f"sqlite:///{tmp_path / 'mine.db'}"
    assert settle(_compose(f"lineage.url={given}"), _ctx(tmp_path, f"lineage.url={given}")).lineage.url == given
