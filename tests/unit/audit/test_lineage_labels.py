"""Lineage pictures: what a file's box says — its name cut from the front to fit, and enough of its
folder to tell it from every other file of the picture."""

from __future__ import annotations

from reshard_job.audit.drawing import BOX_WIDTH, LINE_SIZE, NAME_SIZE, TEXT_LEFT, TEXT_RIGHT, file_lines, folder_labels
from reshard_job.audit.graph import FileVertex
from reshard_job.audit.text_width import ELLIPSIS, fit_from_front, text_width

ROOM = BOX_WIDTH - TEXT_LEFT - TEXT_RIGHT


def _files(*paths: str) -> tuple[FileVertex, ...]:
    return tuple(FileVertex(f"file-{i}", "sha256", f"{i:064x}", 10, ("target_checkpoint",), (0,), (path,), False,
                            False) for i, path in enumerate(paths))


def _drawn(files: tuple[FileVertex, ...]) -> list[tuple[str, str]]:
    folders = folder_labels(files)
    return [file_lines(v, folders[v.key])[:2] for v in files]


def test_outputs_of_different_folders_read_differently():
    files = _files("/data/src/rank_0/checkpoint_0.ckpt", "/data/ckpt_4cards/rank_0/checkpoint_0.ckpt",
                   "/data/ckpt_2cards/rank_0/checkpoint_0.ckpt")
    assert _drawn(files) == [("checkpoint_0.ckpt", "…/src/rank_0/"), ("checkpoint_0.ckpt", "…/ckpt_4cards/rank_0/"),
                             ("checkpoint_0.ckpt", "…/ckpt_2cards/rank_0/")]


def test_a_folder_shows_as_much_of_its_path_as_tells_it_apart():
    files = _files("/a/x/ckpt/rank_0/model.ckpt", "/b/x/ckpt/rank_0/model.ckpt", "/c/rank_0/model.ckpt",
                   "relative.ckpt")
    assert [folder for _, folder in _drawn(files)] == ["/a/x/ckpt/rank_0/", "/b/x/ckpt/rank_0/", "/c/rank_0/", ""]


def _cut_in_the_middle(text: str, limit: int = 34) -> str:  # how boxes were labelled before
    keep = limit - 1
    return text if len(text) <= limit else text[:keep // 2] + "…" + text[len(text) - (keep - keep // 2):]


def test_files_that_read_alike_when_cut_in_the_middle_read_apart():
    paths = [f"/ckpt/iteration_{step:010d}/model-00004.safetensors" for step in (1000, 1010, 1020, 1030)]
    assert {_cut_in_the_middle("/".join(p.split("/")[-2:])) for p in paths} == {"iteration_000000…00004.safetensors"}
    assert _drawn(_files(*paths)) == [("model-00004.safetensors", f"/ckpt/iteration_{step:010d}/")
                                      for step in (1000, 1010, 1020, 1030)]


def test_long_names_keep_their_distinctive_tail_and_fit_their_box():
    paths = [f"/data/{'pretraining_run_' * 4}/{'llama_70b_pretrain_' * 3}iteration_{step:010d}.safetensors"
             for step in (1, 2, 3, 4)]
    drawn = _drawn(_files(*paths))
    assert len(set(drawn)) == 4
    for (name, folder), path in zip(drawn, paths):
        assert name.startswith(ELLIPSIS) and path.endswith(name[1:]) and folder.startswith(ELLIPSIS)
        assert text_width(name, NAME_SIZE, bold=True) <= ROOM and text_width(folder, LINE_SIZE) <= ROOM
        assert name.endswith(path[-len("iteration_0000000001.safetensors"):])


def test_fit_from_front():
    assert fit_from_front("short.ckpt", 200, 11) == "short.ckpt"
    cut = fit_from_front("W" * 60 + "tail_0042.ckpt", 200, 11)
    assert cut.startswith(ELLIPSIS) and cut.endswith("tail_0042.ckpt") and text_width(cut, 11) <= 200
    assert text_width(fit_from_front("W" + cut[1:], 200, 11), 11) <= 200
    wide = fit_from_front("模型" * 40, 200, 11)  # characters outside the table count one em each
    assert text_width(wide, 11) <= 200 and len(wide) == 1 + int((200 - 11) // 11)
    # Bold is wider: the same room keeps fewer characters.
    assert len(fit_from_front("m" * 80, 200, 12.5, bold=True)) < len(fit_from_front("m" * 80, 200, 12.5))
