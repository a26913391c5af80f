"""``python -m reshard_job --help``: one line per configuration key with its meaning, taken from the
schema, answered without importing Hydra, OmegaConf or numpy; ``--hydra-help`` stays Hydra's."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import typing

import reshard_job.job.config.schema as schema


def run_app(*args: str, code: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "RESHARD_JOB_FULL_ERROR")}
    command = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "reshard_job", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


def every_schema_key(cls: type = schema.ReshardConfig, prefix: str = "") -> dict[str, str]:
    """dotted key -> meaning for every field of the schema, nested dataclasses included (walked here
    on its own, not with the help's code); the items of a list of dataclasses as ``key[].field``."""
    keys = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        keys[key] = f.metadata.get("help", "")
        hint = hints[f.name]
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        if dataclasses.is_dataclass(hint):
            keys.update(every_schema_key(hint, key + "."))
        elif inner and dataclasses.is_dataclass(inner[0]):
            keys.update(every_schema_key(inner[0], key + ("[]." if typing.get_origin(hint) is list else ".")))
    return keys


def key_lines(stdout: str) -> dict[str, str]:
    """The help's keys section as key -> meaning (a section's title line is ``name: meaning``)."""
    section = stdout.split("== Keys", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    lines = {}
    for line in section:
        if line.startswith("  "):
            key, _, meaning = line.strip().partition("  ")
        else:
            key, _, meaning = line.partition(": ")
        assert key not in lines, f"{key} listed twice"
        lines[key] = meaning.strip()
    return lines


def test_help_lists_every_schema_key_with_its_meaning():
    res = run_app("--help")
    assert res.returncode == 0 and res.stderr == "", res.stderr
    shown = key_lines(res.stdout)
    expected = every_schema_key()
    assert len(expected) > 40  # the walk found the nested sections too
    assert set(shown) == set(expected), set(shown) ^ set(expected)
    for key, meaning in expected.items():
        assert meaning and shown[key] == meaning, key
    assert "target: demo_mlp, hf_export, megatron, single, strategy" in res.stdout
    assert "--hydra-help" in res.stdout


def test_the_schema_gives_every_key_a_one_line_meaning():
    """The help cannot drift from the schema: the meanings live in the schema's fields, a key added
    without one is refused when the schema is defined, and each meaning is one line of text."""
    for key, meaning in every_schema_key().items():
        assert meaning.strip() and "\n" not in meaning and len(meaning) < 200, key
    import pytest

    with pytest.raises(ValueError, match="one-line meaning"):
        schema.setting(1, "")


def test_help_is_answered_without_hydra_omegaconf_or_numpy():
    code = ("import sys; sys.argv[0] = 'reshard_job'; from reshard_job.job.cli.app import main; main(); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'hydra', 'omegaconf', 'numpy', 'yaml'}), "
            "file=sys.stderr)")
    for flag in ("--help", "-h"):
        res = run_app(flag, "target=single", code=code)
        assert res.returncode == 0 and "== Keys" in res.stdout, res.stderr
        assert res.stderr.strip() == "[]", res.stderr


def test_hydra_help_stays_hydras():
    res = run_app("--hydra-help")
    assert res.returncode == 0, res.stderr
    assert "== Flags ==" in res.stdout and "--hydra-help : Hydra's help" in res.stdout


def test_schema_missing_is_omegaconfs():
    """The schema spells OmegaConf's mandatory-value mark itself (so --help need not import OmegaConf)."""
    from omegaconf import MISSING

    assert schema.MISSING == MISSING
