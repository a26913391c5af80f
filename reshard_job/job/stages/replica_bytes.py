"""Reading the tensors several source ranks must hold identically (replicas of one block, tensors
the source strategy does not lay out) and saying which differ: what ``job.mode=plan`` checks
(``prepare.check_identical``), where the conversion compares them while it hashes the sources.

A model of many small tensors is compared a run of names at a time: each rank's spans looked up
together (``whole_spans``) and their bytes read through the reader's read-ahead window
(``read_near``), instead of a positioned read per tensor and rank (300,000 tensors on 8 ranks were
2.4 million system calls, 40 s). Anything else is hashed whole, block by block.
"""

from __future__ import annotations

from typing import Callable, Iterator, Mapping, Sequence

from reshard_job.formats.base import whole_spans_of
from reshard_job.job.stages.extra_ranks import tensor_digest

RUN = 2048  # names looked up together
SMALL = 1 << 16  # bytes of a tensor compared as bytes; larger ones are hashed a block at a time


def first_mismatch(identical: Mapping[str, Sequence[Sequence[int]]],
                   reader: Callable[[int], object]) -> tuple[str, Sequence[int]] | None:
    """The first (name, group of ranks), in the order of `identical` and of each name's groups, whose
    ranks' copies of the tensor differ; None if every group agrees. `reader(rank)`: a rank's reader."""
    for names, groups in _runs(identical):
        bad = [(i, g) for g, group in enumerate(groups) for i in _differing(names, group, reader)]
        if bad:
            i, g = min(bad)
            return names[i], groups[g]
    return None


def _runs(identical: Mapping[str, Sequence[Sequence[int]]]) -> Iterator[tuple[list[str], Sequence]]:
    """Runs of at most ``RUN`` consecutive names with the same groups."""
    names: list[str] = []
    groups = None
    for name, its_groups in identical.items():
        if names and (its_groups != groups or len(names) >= RUN):
            yield names, groups
            names = []
        names.append(name)
        groups = its_groups
    if names:
        yield names, groups


def _differing(names: list[str], group: Sequence[int], reader: Callable[[int], object]) -> list[int]:
    """Indices of `names` whose bytes are not the same on every rank of `group`."""
    readers = [reader(r) for r in group]
    # spans read through each reader's own window (one reader serving two ranks would share it)
    windows = all(hasattr(r, "read_near") for r in readers) and len(set(map(id, readers))) == len(readers)
    spans = [whole_spans_of(r, names) if windows else [None] * len(names) for r in readers]
    differing = []
    for i, name in enumerate(names):
        first = spans[0][i]
        if first is None or first[3] > SMALL or any(s[i] is None or s[i][3] != first[3] for s in spans[1:]):
            if len({tensor_digest(r, name) for r in readers}) > 1:
                differing.append(i)
            continue
        want = bytes(readers[0].read_near(first[2], first[3]))
        if any(r.read_near(s[i][2], first[3]) != want for r, s in zip(readers[1:], spans[1:])):
            differing.append(i)
    return differing

