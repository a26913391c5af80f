"""real_paths resolves paths as os.path.realpath does, each folder once."""

from __future__ import annotations

import os

from reshard_job.job.output.places import real_paths


def test_real_paths_are_realpath_of_each(tmp_path, monkeypatch):
    real = tmp_path / "real"
    (real / "sub").mkdir(parents=True)
    (real / "a.json").write_text("{}")
    (tmp_path / "linked").symlink_to(real)
    (real / "to_a.json").symlink_to(real / "a.json")
    (real / "sub" / "up").symlink_to(real)
    monkeypatch.chdir(tmp_path)
    paths = [str(real / "a.json"), str(tmp_path / "linked" / "a.json"), str(real / "to_a.json"),
             str(real / "missing.json"), str(real / "sub" / "up" / ".." / "a.json"), "linked/a.json",
             str(real) + "/", str(real / "sub" / "up" / "to_a.json"), "s3://bucket/key", "//" + str(real / "a.json")]
    assert real_paths(paths) == [os.path.realpath(p) for p in paths]
