"""Admission by tier under overload: a pure function of the engines' queues.

An engine queues a request only when it cannot run it now (running slots or KV blocks are exhausted),
so its waiting queue measures overload directly. From each engine's advertised bound
(``max_waiting_requests``, beyond which it refuses work) the router derives a *safe depth*,
``free_queue_fraction`` of that bound:

- the free tier may go only to engines below their safe depth; when every engine is beyond it, free
  requests are shed (RESOURCE_EXHAUSTED with a retry delay) while paid ones still get in;
- paid tiers (pro, enterprise) may go to any engine with headroom (below its bound); only when no engine
  has any are they shed too.

The rules are written over arrays (one row per engine) because placement asks them of every engine
of a pool for every request; ``admissible`` and ``retry_after_s`` say the same of ``QueueView``s.

The retry delay is how long the least loaded engine needs, at the rate it has been finishing requests,
to get back under the threshold the request's tier faces.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from chatmesh.router.v1 import router_pb2

RETRY_MIN_S = 0.5
RETRY_MAX_S = 30.0
RETRY_UNKNOWN_RATE_S = 1.0  # no request has finished yet to measure a drain rate from


@dataclass(frozen=True)
class QueueView:
    engine_id: str
    waiting: int  # the engine's last report plus what this router sent it since
    max_waiting: int  # the engine's advertised bound
    drain_rate: float  # requests it finished per second lately (0: unknown)


def is_premium(tier: int) -> bool:
    return tier in (router_pb2.TIER_PRO, router_pb2.TIER_ENTERPRISE)


def safe_depth(max_waiting: int | np.ndarray, free_queue_fraction: float) -> np.ndarray:
    """The free tier's queue limit: ``free_queue_fraction`` of the bound, at least 1 (per engine)."""
    return np.maximum(1, np.floor(np.asarray(max_waiting) * free_queue_fraction)).astype(np.int64)


def limits(max_waiting: np.ndarray, tier: int, free_queue_fraction: float) -> np.ndarray:
    """Queue depth at which each engine stops taking requests of ``tier``."""
    return max_waiting if is_premium(tier) else safe_depth(max_waiting, free_queue_fraction)


def admissible_rows(
    waiting: np.ndarray, max_waiting: np.ndarray, tier: int, free_queue_fraction: float
) -> np.ndarray:
    """Which engines may take a request of ``tier`` now (none: shed it)."""
    return waiting < limits(max_waiting, tier, free_queue_fraction)


def retry_after_rows(
    waiting: np.ndarray,
    max_waiting: np.ndarray,
    drain_rate: np.ndarray,
    tier: int,
    free_queue_fraction: float,
) -> float:
    """When a shed request of ``tier`` should come back: the soonest any engine drains below its limit."""
    if not len(waiting):
        return max(RETRY_MIN_S, RETRY_UNKNOWN_RATE_S)
    excess = waiting - limits(max_waiting, tier, free_queue_fraction) + 1
    known = drain_rate > 0
    waits = np.full(len(waiting), RETRY_UNKNOWN_RATE_S)
    waits[known] = excess[known] / drain_rate[known]
    return min(RETRY_MAX_S, max(RETRY_MIN_S, float(waits.min())))


def _columns(queues: Sequence[QueueView]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (
        np.array([q.waiting for q in queues], dtype=np.int64),
        np.array([q.max_waiting for q in queues], dtype=np.int64),
        np.array([q.drain_rate for q in queues], dtype=np.float64),
    )


def admissible(queues: Sequence[QueueView], tier: int, free_queue_fraction: float) -> list[str]:
    """The engines that may take a request of ``tier`` now (empty: shed it)."""
    waiting, max_waiting, _ = _columns(queues)
    rows = admissible_rows(waiting, max_waiting, tier, free_queue_fraction)
    return [q.engine_id for q, ok in zip(queues, rows, strict=True) if ok]


def retry_after_s(queues: Sequence[QueueView], tier: int, free_queue_fraction: float) -> float:
    """When a shed request of ``tier`` should come back: the soonest any engine drains below its limit."""
    return retry_after_rows(*_columns(queues), tier, free_queue_fraction)
