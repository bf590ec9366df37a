"""Admission by tier under overload: a pure function of the engines' queues.

Two rules, both written over arrays (one row per engine) because placement asks them of every engine of
a pool for every request; ``admissible`` and ``retry_after_s`` say the same of ``QueueView``s.

**The count rule, always the cap.** An engine queues a request only when it cannot run it now (running
slots or KV blocks are exhausted), so its waiting queue measures overload directly. From each engine's
advertised bound (``max_waiting_requests``, beyond which it refuses work) the router derives a *safe
depth*, ``free_queue_fraction`` of that bound: the free tier may go only to engines below their safe
depth, paid tiers (pro, enterprise) to any engine below its bound.

**The wait rule, on top (``--admission wait``, the default).** Capping a queue's length does not cap
its wait: 128 requests queued on an engine finishing 8 a second is 16 s. So a request of a tier may go
only to an engine whose *predicted wait* fits the tier's TTFT objective (``chatmesh.tiers``), less the
engine's own time to a first token at the head of its queue (its prefill and first step, as measured)::

    predicted wait = (requests queued ahead of it + 1) / (drain rate - higher tiers' admission rate)
                     (0 while nothing waits there; endless when higher tiers take the whole drain)
    admit where   predicted wait <= max(0, objective - head-of-queue TTFT)

*Ahead of it* counts the queued requests of its own tier and higher ones (engines schedule higher
priorities first) plus the queued requests this router did not send (other replicas', of unknown
tier: counted ahead of everyone). The *+1* is the slot it waits for: anything queued means every
running slot is taken. The *drain rate* is the requests per second the engine finished lately, as
this router saw them finish. Higher tiers arriving while it waits go ahead of it too, so its queue
drains only at what they leave over: the drain rate less the rate this router has lately been sending
that engine requests of higher tiers. An engine whose queue is empty always fits (its wait is 0): a
request whose own prefill alone exceeds its objective is still served, on an idle engine.

**Cold start.** Until an engine has finished two requests its drain rate is unknown, and the count
rule alone decides for it.

The retry delay of a shed request is the predicted time until the soonest engine would take it: for
the count rule, until it drains below the tier's depth; for the wait rule, until its predicted wait has
fallen to the budget (``wait - budget``: the queue ahead drains at the drain rate).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from chatmesh.router.v1 import router_pb2
from chatmesh.tiers import tier_of_proto

RETRY_MIN_S = 0.5
RETRY_MAX_S = 30.0
RETRY_UNKNOWN_RATE_S = 1.0  # no request has finished yet to measure a drain rate from

ADMISSION_RULES = ("wait", "count")


@dataclass(frozen=True)
class QueueView:
    engine_id: str
    waiting: int  # the engine's last report plus what this router sent it since
    max_waiting: int  # the engine's advertised bound
    drain_rate: float  # requests it finished per second lately (0: unknown)
    ahead: tuple[int, ...]  # per tier rank: queued requests a new one of that rank waits behind
    head_ttft_s: float = 0.0  # its time to a first token at the head of its queue (0: unknown)
    higher_rate: tuple[float, ...] = (0.0, 0.0, 0.0)  # per tier rank: higher tiers sent here per second


@dataclass(frozen=True)
class Queues:
    """The engines' queues as columns, as a request of one tier sees them (one row per engine)."""

    waiting: np.ndarray  # every request queued there
    max_waiting: np.ndarray  # the engine's bound
    ahead: np.ndarray  # queued requests this request would wait behind
    drain_rate: np.ndarray  # requests finished per second lately (0: unknown)
    head_ttft_s: np.ndarray  # time to a first token at the head of the queue (0: unknown)
    higher_rate: np.ndarray  # requests of higher tiers sent there per second lately


def is_premium(tier: int) -> bool:
    return tier in (router_pb2.TIER_PRO, router_pb2.TIER_ENTERPRISE)


def safe_depth(max_waiting: int | np.ndarray, free_queue_fraction: float) -> np.ndarray:
    """The free tier's queue limit: ``free_queue_fraction`` of the bound, at least 1 (per engine)."""
    return np.maximum(1, np.floor(np.asarray(max_waiting) * free_queue_fraction)).astype(np.int64)


def limits(max_waiting: np.ndarray, tier: int, free_queue_fraction: float) -> np.ndarray:
    """Queue depth at which each engine stops taking requests of ``tier`` (the count rule)."""
    return max_waiting if is_premium(tier) else safe_depth(max_waiting, free_queue_fraction)


def predicted_wait_s(queues: Queues) -> np.ndarray:
    """Each engine's predicted queue wait for the request (0 where nothing waits or the rate is unknown;
    infinite where higher tiers are taking everything the engine finishes)."""
    waits = np.zeros(len(queues.waiting))
    saturated = (queues.drain_rate > 0) & (queues.waiting > 0)
    left_over = queues.drain_rate - queues.higher_rate
    draining = saturated & (left_over > 0)
    waits[saturated] = np.inf
    waits[draining] = (queues.ahead[draining] + 1) / left_over[draining]
    return waits


def excess_wait_s(queues: Queues, objective_s: float) -> np.ndarray:
    """How much longer than its budget each engine would keep the request waiting (<= 0: it fits; an
    engine whose drain rate is unknown predicts no wait, so it always fits)."""
    return predicted_wait_s(queues) - np.maximum(0.0, objective_s - queues.head_ttft_s)


def admissible_rows(queues: Queues, limit: np.ndarray, objective_s: float | None) -> np.ndarray:
    """Which engines may take the request now (none: shed it). ``limit``: the count rule's depths;
    ``objective_s``: the tier's TTFT objective, or None for the count rule alone."""
    under_cap = queues.waiting < limit
    if objective_s is None:
        return under_cap
    return under_cap & (excess_wait_s(queues, objective_s) <= 0)


def retry_after_rows(queues: Queues, limit: np.ndarray, objective_s: float | None) -> float:
    """When a shed request should come back: the soonest any engine is predicted to take it."""
    if not len(queues.waiting):
        return max(RETRY_MIN_S, RETRY_UNKNOWN_RATE_S)
    known = queues.drain_rate > 0
    waits = np.full(len(queues.waiting), RETRY_UNKNOWN_RATE_S)
    over_cap = np.maximum(0, queues.waiting - limit + 1)
    waits[known] = over_cap[known] / queues.drain_rate[known]
    if objective_s is not None:
        waits = np.maximum(waits, excess_wait_s(queues, objective_s))
    return min(RETRY_MAX_S, max(RETRY_MIN_S, float(waits.min())))


def _columns(views: Sequence[QueueView], tier: int) -> Queues:
    rank = tier_of_proto(tier).rank
    return Queues(
        np.array([q.waiting for q in views], dtype=np.int64),
        np.array([q.max_waiting for q in views], dtype=np.int64),
        np.array([q.ahead[rank] for q in views], dtype=np.int64),
        np.array([q.drain_rate for q in views], dtype=np.float64),
        np.array([q.head_ttft_s for q in views], dtype=np.float64),
        np.array([q.higher_rate[rank] for q in views], dtype=np.float64),
    )


def admissible(
    views: Sequence[QueueView], tier: int, free_queue_fraction: float, objective_s: float | None = None
) -> list[str]:
    """The engines that may take a request of ``tier`` now (empty: shed it)."""
    queues = _columns(views, tier)
    rows = admissible_rows(queues, limits(queues.max_waiting, tier, free_queue_fraction), objective_s)
    return [q.engine_id for q, ok in zip(views, rows, strict=True) if ok]


def retry_after_s(
    views: Sequence[QueueView], tier: int, free_queue_fraction: float, objective_s: float | None = None
) -> float:
    """When a shed request of ``tier`` should come back: the soonest any engine is predicted to take it."""
    queues = _columns(views, tier)
    return retry_after_rows(queues, limits(queues.max_waiting, tier, free_queue_fraction), objective_s)
