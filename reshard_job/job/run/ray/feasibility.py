"""Whether the live nodes of a Ray cluster can run the tasks at all.

Ray queues a task no node can run (a placement resource nobody offers, more CPUs than any node
has) for ever, silently. So tasks are refused before anything starts, and while they wait the
check is repeated: a node holding a placement resource may leave, and is given
``node_loss_grace`` seconds to come back before the run fails naming what is missing.
"""

from __future__ import annotations

import time
from typing import Mapping

from reshard_job.execute.tasks import RankTask
from reshard_job.job.config.ray_address import clip
from reshard_job.job.run.ray.errors import RayExecutorError

FEASIBILITY_CHECK_INTERVAL = 5.0  # seconds between checks that waiting tasks still have a node
NODE_LOSS_GRACE = 60.0  # seconds a lost placement node may take to come back

Needs = dict[str, float]  # Ray resource -> amount one task needs


def alive_nodes(ray) -> list[dict]:
    return [n for n in ray.nodes() if n.get("Alive")]


def check_feasible(needs: dict[int, Needs], by_key: dict[int, RankTask], nodes: list[dict], address: str, *,
                   waited: float | None) -> None:
    """Refuse tasks no live node can run: Ray would queue them for ever."""
    unmet = sorted((by_key[key].target_rank, key) for key, need in needs.items()
                   if not any(_fits(need, n) for n in nodes))
    if not unmet:
        return
    rank, key = unmet[0]
    need = ", ".join(f"{k}={_amount(k, v)}" for k, v in needs[key].items())
    others = "" if len(unmet) == 1 else f" (and {len(unmet) - 1} other rank(s))"
    offers = f"has offered for the last {waited:.0f} s (a node left?)" if waited else "offers"
    raise RayExecutorError(clip(f"target rank {rank}{others} needs {need}, which no live node of the Ray "
                                f"cluster at {address} {offers} (nodes: {_describe_nodes(nodes)})", 600))


def check_still_feasible(ray, waiting: dict[int, Needs], by_key: dict[int, RankTask], lost_since: dict[str, float],
                         address: str, node_loss_grace: float) -> None:
    """A node holding a placement resource may leave while its ranks wait; give it time to return."""
    try:
        nodes = alive_nodes(ray)
    except Exception:  # the GCS is restarting; Ray itself fails the tasks if it does not return
        return
    now = time.monotonic()
    unmet = {key: need for key, need in waiting.items() if not any(_fits(need, n) for n in nodes)}
    missing_now = {_need_key(need) for need in unmet.values()}
    for gone in [k for k in lost_since if k not in missing_now]:
        del lost_since[gone]
    expired = {key: need for key, need in unmet.items()
               if now - lost_since.setdefault(_need_key(need), now) >= node_loss_grace}
    if expired:
        check_feasible(expired, by_key, nodes, address, waited=node_loss_grace)


def check_nodes_offer(needs: dict[str, Needs], nodes: list[dict], what: str, address: str, *,
                      waited: float | None, holding: Mapping[str, str] | None = None) -> None:
    """Refuse node tasks whose resource no live node offers (`holding`: what each node holds, for messages)."""
    unmet = sorted(res for res, need in needs.items() if not any(_fits(need, n) for n in nodes))
    if not unmet:
        return
    unmet = [f"{res} ({holding[res]})" if holding and res in holding else res for res in unmet]
    since = f" for the last {waited:.0f} s (a node left?)" if waited else ""
    raise RayExecutorError(clip(f"{what}: no live node of the Ray cluster at {address} offers "
                                f"{', '.join(unmet)}{since} (nodes: {_describe_nodes(nodes)})", 600))


def check_nodes_still_offer(ray, waiting: dict[str, Needs], what: str, lost_since: dict[str, float],
                            address: str, node_loss_grace: float) -> None:
    """``check_still_feasible`` for node tasks, keyed by the resource each one needs."""
    try:
        nodes = alive_nodes(ray)
    except Exception:  # the GCS is restarting; Ray itself fails the tasks if it does not return
        return
    now = time.monotonic()
    unmet = {res for res, need in waiting.items() if not any(_fits(need, n) for n in nodes)}
    for gone in [r for r in lost_since if r not in unmet]:
        del lost_since[gone]
    expired = {res: waiting[res] for res in unmet if now - lost_since.setdefault(res, now) >= node_loss_grace}
    if expired:
        check_nodes_offer(expired, nodes, what, address, waited=node_loss_grace)


def _fits(need: Needs, node: dict) -> bool:
    have = node.get("Resources", {})
    return all(have.get(k, 0) >= v for k, v in need.items())


def _need_key(need: Needs) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(need.items()))


def _amount(name: str, value: float) -> str:
    if name in ("memory", "object_store_memory"):
        from reshard_job.text import human_size

        return human_size(value)
    return f"{value:g}"


def _describe_nodes(nodes: list[dict]) -> str:
    return "; ".join(f"{n.get('NodeManagerAddress', '?')} {_describe_resources(n.get('Resources', {}))}"
                     for n in nodes) or "none"


def _describe_resources(resources: dict) -> str:
    shown = {k: v for k, v in resources.items() if not k.startswith("node:") and k != "object_store_memory"}
    return "{" + ", ".join(f"{k}={_amount(k, v)}" for k, v in sorted(shown.items())) + "}"
