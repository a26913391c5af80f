"""What a conversion leaves out, said before anything is written: one WARNING line each."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from reshard_job.text import shorten

if TYPE_CHECKING:
    from reshard_job.plan.model import Plan
    from reshard_job.sources.rank_folders import LoadedStrategy

log = logging.getLogger("reshard_job")


def warn_omitted(plan: Plan, missing) -> None:
    """Whatever the outputs leave out is said once, in one line (and listed in the manifest); not
    when missing files refuse the run anyway."""
    if plan.omitted and not missing:
        names = [o["name"] for o in plan.omitted]
        reasons = sorted({o["reason"].split(";")[0] for o in plan.omitted})
        log.warning("%d parameter(s) left out of the outputs (listed in manifest.json, plan.omitted): %s%s (%s)",
                    len(names), ", ".join(repr(shorten(n, 60)) for n in names[:5]), ", ..." if len(names) > 5 else "",
                    "; ".join(reasons[:3]))


def warn_target_only(plan: Plan) -> None:
    """Optimizer states the target strategy lays out that no source holds: one line (and the
    manifest's ``plan.not_in_sources``), since the outputs lack what the target network expects."""
    names = plan.target_only
    if names:
        log.warning("the target strategy lays out %d optimizer state(s) or buffer(s) that no source holds, so the "
                    "outputs lack them (the target network starts them afresh; listed in manifest.json, "
                    "plan.not_in_sources): %s%s", len(names), ", ".join(repr(shorten(n, 60)) for n in names[:5]),
                    ", ..." if len(names) > 5 else "")


def warn_absent(strategy: LoadedStrategy, index) -> None:
    """Parameters of the source strategy that the files of their stages lack. A stage none of whose
    files was given (the API's conversion of one rank, given the files it reads) says nothing: the
    plan, which would have named the missing files, needed nothing from it."""
    topo, stages = strategy.topology, {strategy.topology.stage_of_rank(r) for r in index}
    absent = [n for n, per in topo.layouts.items()
              if not stages.isdisjoint(per) and not any(n in names for names in index.values())]
    if absent:
        log.warning("%d parameter(s) of the source strategy are in no source checkpoint and will not be in "
                    "the outputs: %s%s", len(absent), ", ".join(repr(shorten(n, 60)) for n in absent[:5]),
                    ", ..." if len(absent) > 5 else "")
