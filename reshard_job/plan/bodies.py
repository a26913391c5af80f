"""Planning, phase 2, per target rank: a rank's plan up to its number (``RankBody``), made from its
groups' results (``Planner._group_result``) spread over the parameters of its target stage.

What the ranks of a stage share (which parameters the stage holds, in plan order, and their
groups) is made once per stage (``_stage_rows``); a rank then costs one result per group and a
few C-level passes over the stage's parameters, not a loop over them: a model of a few hundred
thousand small parameters on many target ranks paid that loop for each rank.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

from reshard_job.plan.model import COUNTED_NEVER, ParamPlans, ParamSource, RankSummary, TensorFacts


class RankBody(NamedTuple):
    """A target rank's plan up to its number (shared by target ranks that read alike)."""

    params: ParamPlans
    summary: RankSummary
    unavailable: frozenset[int]  # source ranks parameters without any file at hand would be read from


class RankBodies:
    """``Planner``'s per-rank part (see the module docstring)."""

    def _make_body(self, t_stage: int, r: int) -> RankBody:
        """Target local rank r's plan: its groups' results, spread over the stage's parameters in
        the stage's order (``_stage_rows``, the same for every rank of the stage)."""
        if self.remove_redundancy:  # which parameters a rank writes depends on the rank
            return self._make_body_each(t_stage, r)
        first, groups, counted_here, tensors, counts = self._stage_rows(t_stage)
        rho = r % self.src.stage_devices
        results, sources, unavailable = {}, set(), set()
        for g, ps in first.items():  # in order of first appearance: the first failing one is raised
            res = results[g] = self._group_result(ps, t_stage, r, rho)
            if ps.meta is None:
                unavailable.update(res)
            else:
                sources.update(c.source_rank for c in res[0][1])
        slice_of = {g: results[g][0] for g in counts}
        if all(counted_here):
            slices = tuple(map(slice_of.__getitem__, groups))
        else:  # counted in its first stage only
            never = {g: s[:3] + (self._place(s[3].origin, COUNTED_NEVER),) for g, s in slice_of.items()}
            slices = tuple(slice_of[g] if here else never[g] for g, here in zip(groups, counted_here))
        read = sum(n * results[g][1] for g, n in counts.items())
        written = sum(n * slice_of[g][2] for g, n in counts.items())
        largest = max((slice_of[g][2] for g in counts), default=0)
        return RankBody(ParamPlans(tensors, slices), RankSummary(tuple(sorted(sources)), read, written, largest),
                     frozenset(unavailable))

    def _stage_rows(self, t_stage: int) -> tuple:
        """What target stage t_stage's plans share, made once: the first parameter of each group it
        holds, and its parameters in plan order (laid out ones, then those copied unchanged, as
        MindSpore orders them) as their groups, whether this stage counts them, their tensor facts,
        and how many parameters each group has here."""
        hit = self._rows.get(t_stage)
        if hit is not None:
            return hit
        first: dict[int, ParamSource] = {}
        resharded: list[ParamSource] = []
        copied: list[ParamSource] = []
        for ps in self.params:
            if ps.dst_layouts is not None and t_stage not in ps.dst_layouts:
                continue  # lives in another target pipeline stage
            first.setdefault(ps.group, ps)
            if ps.meta is not None:
                (resharded if ps.reshard else copied).append(ps)
        rows = resharded + copied
        groups = [ps.group for ps in rows]
        counted_here = [t_stage == (min(ps.dst_layouts) if ps.dst_layouts else 0) for ps in rows]
        hit = self._rows[t_stage] = (first, groups, counted_here, tuple(ps.tensor for ps in rows), Counter(groups))
        return hit

    def _make_body_each(self, t_stage: int, r: int) -> RankBody:
        rho = r % self.src.stage_devices
        results: list = [None] * len(self._groups)
        tensors: list[TensorFacts] = []
        slices: list[tuple] = []
        copied: list[tuple[TensorFacts, tuple]] = []  # pass-through parameters come last, as in MindSpore
        unavailable: set[int] = set()
        sources: set[int] = set()
        read = written = largest = 0
        owners = self._stage_owners(t_stage) if self.remove_redundancy else None
        never: dict[int, tuple] = {}  # group -> its slice in a stage that does not count it
        for ps in self.params:
            if ps.dst_layouts is not None and t_stage not in ps.dst_layouts:
                continue  # lives in another target pipeline stage
            if owners is not None and not owners.writes(r, ps.name):
                continue  # another rank of its redundancy group writes it
            res = results[ps.group]
            if res is None:
                res = results[ps.group] = self._group_result(ps, t_stage, r, rho)
                if ps.meta is not None:
                    sources.update(c.source_rank for c in res[0][1])
            if ps.meta is None:
                unavailable.update(res)
                continue
            slice_, bytes_read = res
            if t_stage != (min(ps.dst_layouts) if ps.dst_layouts else 0):  # counted in its first stage only
                slice_ = never.get(ps.group) or never.setdefault(ps.group, slice_[:3] + (
                    self._place(slice_[3].origin, COUNTED_NEVER),))
            if ps.reshard:
                tensors.append(ps.tensor)
                slices.append(slice_)
            else:
                copied.append((ps.tensor, slice_))
            nbytes = slice_[2]
            read += bytes_read
            written += nbytes
            if nbytes > largest:
                largest = nbytes
        for tensor, slice_ in copied:
            tensors.append(tensor)
            slices.append(slice_)
        params = ParamPlans(tuple(tensors), tuple(slices))
        return RankBody(params, RankSummary(tuple(sorted(sources)), read, written, largest), frozenset(unavailable))

