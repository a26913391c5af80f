"""What goes wrong on a Ray cluster, as one-line errors naming the rank, the node and the cause.

Workers raise ``RankTaskError`` (or ``TransientRankTaskError``, worth a retry) with the cause as
text and the traceback kept aside for logs; the driver turns whatever Ray hands back (the worker's
error wrapped by Ray, a worker or node that died, Ray's own multi-line messages) into one of
these, so a failing run always ends in one readable line.
"""

from __future__ import annotations

import logging
from typing import Callable

from reshard_job.errors import ReshardError
from reshard_job.job.config.ray_address import clip

log = logging.getLogger(__name__)

MESSAGE_LIMIT = 400  # characters of a cause quoted in an error message

# OSErrors that remote storage raises when a retry may well succeed. Local file-system errors
# arrive as StorageError (not transient) unless the storage layer marks them ``transient``.
TRANSIENT_ERRORS = (ConnectionError, TimeoutError)


class RayExecutorError(ReshardError):
    """The Ray cluster cannot run the conversion (unreachable, lacks a node the placement needs)."""


class RayConnectionError(RayExecutorError):
    """The Ray cluster at the given address cannot be reached."""

    def __init__(self, address: str, problem: str):
        self.address = address
        self.problem = problem
        super().__init__(f"cannot connect to the Ray cluster at {address}: {problem}")


class RankTaskError(ReshardError):
    """A target rank failed for good; the message names the rank, the node and the cause."""

    def __init__(self, target_rank: int, where: str, cause: str, *, attempts: int | None = None,
                 details: str = ""):
        self.target_rank = target_rank
        self.where = where
        self.cause = cause
        self.attempts = attempts
        self.details = details  # the worker's traceback, for logs; never shown to users
        tries = f" after {attempts} attempts" if attempts and attempts > 1 else ""
        super().__init__(f"target rank {target_rank} failed on {where}{tries}: {cause}")


class TransientRankTaskError(RankTaskError):
    """A failure worth retrying (remote storage timed out or reset the connection)."""


class NodeTaskError(RayExecutorError):
    """A node task (``RayExecutor.run_on_nodes``) failed; the message starts with where it ran."""


def first_line(err: BaseException) -> str:
    """An error's message as one line: its first line, completed by its last where the first only
    announces what follows (Ray's "Initialization failure from server:" then a server traceback)."""
    lines = [line.strip() for line in (str(err).strip() or type(err).__name__).splitlines() if line.strip()]
    text = lines[0]
    if text.endswith(":") and len(lines) > 1:
        text = f"{text} {lines[-1]}"
    return clip(text, MESSAGE_LIMIT)


def _worker_died(ray, err: Exception) -> bool:
    return isinstance(err, (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError,
                            ray.exceptions.LocalRayletDiedError))


def node_failure(ray, resource: str, what: str, err: Exception, max_retries: int) -> ReshardError:
    """The one-line error for a node task (``RayExecutor.run_on_nodes``) that failed for good."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, NodeTaskError):
        return RayExecutorError(clip(f"{what} failed on {cause}", MESSAGE_LIMIT + 200))
    if _worker_died(ray, err):
        return RayExecutorError(clip(f"{what} failed on the Ray node offering {resource} after "
                                     f"{1 + max_retries} attempts: its worker died on every attempt "
                                     f"({first_line(err)})", MESSAGE_LIMIT + 200))
    return RayExecutorError(clip(f"{what} failed on the Ray node offering {resource}: {first_line(err)}",
                                 MESSAGE_LIMIT + 200))


def rank_failure(ray, target_rank: int, err: Exception, max_retries: int,
                 last_seen: Callable[[], str]) -> ReshardError:
    """The one-line error for a rank task that failed for good; `last_seen` says where it last ran
    (asked only when the worker did not say so itself)."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, RankTaskError):
        if cause.details:
            log.debug("target rank %d, worker traceback:\n%s", cause.target_rank, cause.details)
        return RankTaskError(cause.target_rank, cause.where, cause.cause, attempts=cause.attempts,
                             details=cause.details)
    where = last_seen()
    if isinstance(cause, BaseException):  # the worker's own code failed outside the runner
        return RankTaskError(target_rank, where, clip(f"{type(cause).__name__}: {first_line(cause)}", MESSAGE_LIMIT))
    if _worker_died(ray, err):
        attempts = 1 + max_retries
        return RankTaskError(target_rank, where, clip(f"its worker died on every attempt ({first_line(err)})",
                                                      MESSAGE_LIMIT), attempts=attempts)
    return RankTaskError(target_rank, where, first_line(err))
