"""What parsing MindFormers' ``metadata.json`` shares between its parts (``mindformers_metadata``,
``mindformers_storage``): the error, how values are shown in one-line messages, and the interning
of equal values (a save of a million parameters repeats a few shapes, layouts and groups)."""

from __future__ import annotations

import json

from reshard_job.errors import FormatError

MESSAGE_NAME_LIMIT = 80


class MindFormersFormatError(FormatError):
    """A MindFormers checkpoint folder, its metadata.json or one of its files is not as the format says."""


def short_name(name: str) -> str:
    return name if len(name) <= MESSAGE_NAME_LIMIT else name[: MESSAGE_NAME_LIMIT - 1] + "…"


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def brief(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:59] + "…"


class Shared(dict):
    """Equal values parsed once: one object for every equal shape, layout, group, file name."""

    def __init__(self, max_shards: int | None = None):
        super().__init__()
        self.max_shards = max_shards

    def check_count(self, count: int, what: str, path: str) -> None:
        if self.max_shards is not None and count > self.max_shards:
            raise MindFormersFormatError(
                path, f"{what} more than the {self.max_shards} tensors the folder's files can hold")

    def __call__(self, value):
        return self.setdefault(value, value)


def int_list(value, where: str, path: str, shared: Shared, *, minimum: int = 0) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(is_int(v) and v >= minimum for v in value):
        lower = "positive" if minimum == 1 else "non-negative"
        raise MindFormersFormatError(path, f"{where} must be a list of {lower} integers, got {brief(value)}")
    return shared(tuple(value))
