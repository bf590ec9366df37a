"""Admission by tier under overload: a pure function of the engines' queues.

An engine queues a request only when it cannot run it now (running slots or KV blocks are exhausted),
so its waiting queue measures overload directly. From each engine's advertised bound
(``max_waiting_requests``, beyond which it refuses work) the router derives a *safe depth*,
``free_queue_fraction`` of that bound:

- the free tier may go only to engines below their safe depth; when every engine is beyond it, free
  requests are shed (RESOURCE_EXHAUSTED with a retry delay) while paid ones still get in;
- paid tiers (pro, enterprise) may go to any engine with headroom (below its bound); only when no engine
  has any are they shed too.

The retry delay is how long the least loaded engine needs, at the rate it has been finishing requests,
to get back under the threshold the request's tier faces.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

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


def safe_depth(max_waiting: int, free_queue_fraction: float) -> int:
    return max(1, math.floor(max_waiting * free_queue_fraction))


def limit(queue: QueueView, tier: int, free_queue_fraction: float) -> int:
    """Queue depth at which ``queue``'s engine stops taking requests of ``tier``."""
    return queue.max_waiting if is_premium(tier) else safe_depth(queue.max_waiting, free_queue_fraction)


def admissible(queues: Sequence[QueueView], tier: int, free_queue_fraction: float) -> list[str]:
    """The engines that may take a request of ``tier`` now (empty: shed it)."""
    return [q.engine_id for q in queues if q.waiting < limit(q, tier, free_queue_fraction)]


def retry_after_s(queues: Sequence[QueueView], tier: int, free_queue_fraction: float) -> float:
    """When a shed request of ``tier`` should come back: the soonest any engine drains below its limit."""
    waits = []
    for q in queues:
        excess = q.waiting - limit(q, tier, free_queue_fraction) + 1
        waits.append(excess / q.drain_rate if q.drain_rate > 0 else RETRY_UNKNOWN_RATE_S)
    return min(RETRY_MAX_S, max(RETRY_MIN_S, min(waits, default=RETRY_UNKNOWN_RATE_S)))
