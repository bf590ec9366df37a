"""Admission by tier under overload: a pure function of the engines' queues.

Two rules, both written over arrays (one row per engine) because placement asks them of every engine of
a pool for every request.

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

**On an engine that computes, the wait is the steps until its prefill is done.** Queued requests are
not what keeps a request from its first token on a real model: a CPU engine runs 64 requests at once
and queues none, yet every request it starts must wait for the step in progress, then for the steps
that compute the prompt tokens ahead of it and its own, each of those steps also carrying one token of
every request decoding there (issue 54: 1.7 s median on two SmolLM2 engines with nothing queued). An
engine that steps itself reports what that takes (``EngineLoad``: its prompt tokens still to compute,
its step's token budget, and its step time fitted as ``fixed + per token x tokens``), so, with
``room = budget - decoding`` prompt tokens a step::

    time to first token = step(decoding + min(room, every prompt token pending))    the step in progress
                        + steps(prompt tokens ahead of it + its own) x step(budget)  its prefill's steps
    admit where   slot wait + time to first token <= objective
            and   for each higher tier: the time to first token of its next request, with this one
                  decoding there too, <= that tier's objective

*Ahead* counts the pending prompt tokens of this router's requests of its tier and higher ones not
started yet, and everything another router sent there (counted ahead of everyone); *its own* are its
prompt tokens beyond the engine's cached prefix (from the prefix index); *decoding* are the requests
running there and those ahead, which will be decoding by then. The *slot wait* is the count-based wait
above (0 while nothing is blocked for want of running slots or KV blocks). A request whose own prefill
would exceed its objective even on an idle engine, with its prompt cached as deep as anywhere in its
pool (a long prompt), is held instead to what it takes with no other prompt token pending there: it is
still served, where nothing else delays it.
The second line is what engines' priorities cannot give: a step carries every tier's tokens, so each
request a lower tier adds makes every later step longer for the tiers above too (one decode token in
each). A lower tier is refused before it slows the steps past what a higher tier's objective allows;
the higher tier's next request is taken to be as long as this one. Every prediction there also gets the
engine's *margin*: how much later than predicted this router's recent requests there got their first
tokens (the hops, a CPU shared with other work, the line's own error), at its 90th percentile, so that
the objective holds at the tail, not the median. An engine that reports no step time (hosted
engines, or before its first step) keeps the rule above: ``head-of-queue TTFT`` stands for its compute.

**Cold start.** Until an engine has finished two requests its drain rate is unknown, and the count
rule alone decides for it.

The retry delay of a shed request is the predicted time until the soonest engine would take it: for
the count rule, until it drains below the tier's depth; for the wait rule, until its predicted wait has
fallen to the budget (``wait - budget``: the queue ahead drains at the drain rate).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from chatmesh.router.v1 import router_pb2
from chatmesh.tiers import TIERS

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
    steps: StepModel | None = None  # what its steps take (None: it does not say)


@dataclass(frozen=True)
class StepModel:
    """What an engine's steps take (its load report), and the prompt tokens pending there."""

    budget: int  # tokens one step computes at most
    fixed_s: float  # step time = fixed_s + token_s x tokens computed
    token_s: float
    decoding: int  # requests that will be decoding while a new request's prefill runs
    prefill_pending: int  # every prompt token still to compute there
    prefill_ahead: tuple[int, ...]  # per tier rank: of those, the ones a new request of that rank waits for
    margin_s: float = 0.0  # how much later than predicted first tokens came there lately (added to each)


# An engine that reports no step time: every column 0.
NO_STEPS = StepModel(0, 0.0, 0.0, 0, 0, (0,) * len(TIERS))


@dataclass(frozen=True)
class Queues:
    """The engines' queues as columns, as a request of one tier sees them (one row per engine)."""

    waiting: np.ndarray  # every request queued there
    max_waiting: np.ndarray  # the engine's bound
    ahead: np.ndarray  # queued requests this request would wait behind
    drain_rate: np.ndarray  # requests finished per second lately (0: unknown)
    head_ttft_s: np.ndarray  # time to a first token at the head of the queue (0: unknown)
    higher_rate: np.ndarray  # requests of higher tiers sent there per second lately
    steps: Steps | None = None  # the engines' step models (rows without one: all zeros)
    own_prefill: np.ndarray | None = None  # the request's own prompt tokens to compute there
    # Its prompt tokens beyond the deepest prefix any engine of its pool caches (0: own_prefill's least).
    shortest_prefill: int = 0
    # The TTFT objectives of the tiers above the request's, lowest first (Steps.higher_ahead's columns):
    # admitting it must not slow the engine's steps past what they allow.
    higher_objectives_s: tuple[float, ...] = ()


@dataclass(frozen=True)
class Steps:
    """``StepModel`` as columns, as a request of one tier sees them (one row per engine)."""

    budget: np.ndarray
    fixed_s: np.ndarray
    token_s: np.ndarray
    decoding: np.ndarray
    prefill_pending: np.ndarray
    prefill_ahead: np.ndarray  # of the request's tier rank
    higher_ahead: np.ndarray  # of each tier rank above it, lowest first (one column each)
    margin_s: np.ndarray

    @classmethod
    def of(cls, models: Sequence[StepModel | None], rank: int) -> Steps:
        """The columns of ``models`` (None: an engine that reports no step time) for tier ``rank``."""
        known = [m or NO_STEPS for m in models]
        return cls(
            np.array([m.budget for m in known], dtype=np.int64),
            np.array([m.fixed_s for m in known], dtype=np.float64),
            np.array([m.token_s for m in known], dtype=np.float64),
            np.array([m.decoding for m in known], dtype=np.int64),
            np.array([m.prefill_pending for m in known], dtype=np.int64),
            np.array([m.prefill_ahead[rank] for m in known], dtype=np.int64),
            np.array([m.prefill_ahead[rank + 1 :] for m in known], dtype=np.int64).reshape(
                len(known), len(TIERS) - rank - 1
            ),
            np.array([m.margin_s for m in known], dtype=np.float64),
        )

    @property
    def known(self) -> np.ndarray:
        """Rows whose engine reports its step time."""
        return (self.budget > 0) & ((self.fixed_s > 0) | (self.token_s > 0))


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


def step_s(steps: Steps, tokens: np.ndarray) -> np.ndarray:
    """Each engine's time for a step of ``tokens`` tokens."""
    return steps.fixed_s + steps.token_s * tokens


def compute_ttft_s(steps: Steps, own_prefill: np.ndarray, ahead: np.ndarray) -> np.ndarray:
    """Each engine's time until the request's first token from the step in progress on: that step,
    then the steps that compute the ``ahead`` prompt tokens and the request's own."""
    decoding = np.minimum(steps.decoding, steps.budget)
    busy = decoding + steps.prefill_pending > 0
    in_progress = np.where(
        busy, step_s(steps, np.minimum(steps.budget, decoding + steps.prefill_pending)), 0.0
    )
    return in_progress + first_token_after_start_s(steps, ahead + np.maximum(1, own_prefill))


def first_token_after_start_s(steps: Steps, prefill: np.ndarray) -> np.ndarray:
    """Each engine's time from the step that starts computing ``prefill`` prompt tokens to the end of
    the step that finishes them (and samples the first token): full steps, then a last one that may be
    partial, each also carrying one token of every decoding request."""
    decoding = np.minimum(steps.decoding, steps.budget)
    room = np.maximum(1, steps.budget - decoding)
    tokens = np.maximum(1, prefill)
    full_steps = (tokens - 1) // room
    return full_steps * step_s(steps, steps.budget) + step_s(steps, decoding + tokens - full_steps * room)


def excess_wait_s(queues: Queues, objective_s: float) -> np.ndarray:
    """How much longer than its budget each engine would keep the request waiting (<= 0: it fits; an
    engine whose drain rate is unknown predicts no slot wait, so only its compute can refuse it).
    Where the engine reports its step time, the compute is the steps until the request's prefill is
    done, held to the objective (a long prompt: to ``allowed_ttft_s``); and, once it is taken, a
    request of each higher tier sent next must still fit its own objective. Elsewhere the compute is
    the measured head-of-queue TTFT."""
    slot_wait = predicted_wait_s(queues)
    excess = slot_wait - np.maximum(0.0, objective_s - queues.head_ttft_s)
    steps = queues.steps
    if steps is None or queues.own_prefill is None or not (known := steps.known).any():
        return excess
    rows = known.nonzero()[0]
    modeled = Steps(*(getattr(steps, name)[rows] for name in Steps.__dataclass_fields__))
    own = np.maximum(1, queues.own_prefill[rows])
    excess[rows] = slot_wait[rows] + compute_ttft_s(modeled, own, modeled.prefill_ahead) + modeled.margin_s
    shortest = queues.shortest_prefill or int(own.min())
    excess[rows] -= allowed_ttft_s(modeled, own, shortest, objective_s)
    # A higher tier's request sent next (of as many prompt tokens, for want of knowing its own) decodes
    # beside this one in every step after. (This one's prefill, a step or two, is not held against it:
    # that would refuse every long prompt wherever a higher tier has a tight objective.)
    taken = replace(modeled, decoding=modeled.decoding + 1)
    for column, higher_objective_s in enumerate(queues.higher_objectives_s):
        ttft = compute_ttft_s(taken, own, modeled.higher_ahead[:, column]) + modeled.margin_s
        allowed = allowed_ttft_s(taken, own, shortest, higher_objective_s)
        excess[rows] = np.maximum(excess[rows], ttft - allowed)
    return excess


def allowed_ttft_s(steps: Steps, own_prefill: np.ndarray, shortest: int, objective_s: float) -> np.ndarray:
    """The time to a first token each engine may take for a request of ``own_prefill`` prompt tokens
    there: the objective, for a request that would meet it on an idle engine with only ``shortest`` to
    compute (its prompt cached as deep as anywhere in its pool); for one that would not (a long prompt),
    what it takes there with no other prompt token pending (a decode step in progress, then its own
    prefill beside the decoding requests): it is served where nothing else delays it. (The best cache,
    not each engine's own: a chat turn whose history is cached on a busy engine must not be let in,
    later than its objective, where it is not.)"""
    none = np.zeros_like(own_prefill)
    best = np.full_like(own_prefill, shortest)
    idle = compute_ttft_s(replace(steps, decoding=none, prefill_pending=none), best, none) + steps.margin_s
    unhurried = compute_ttft_s(replace(steps, prefill_pending=none), own_prefill, none) + steps.margin_s
    return np.where(idle <= objective_s, objective_s, unhurried)


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
