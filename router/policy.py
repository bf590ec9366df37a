"""Placement policies: pure functions from (the request, each candidate's cached prefix and load, weights)
to one engine. No I/O, no clock: the service gathers the inputs, these decide.

``kv_aware`` is NVIDIA Dynamo's cost, per engine::

    cost = overlap_weight · prefill_blocks + decode_blocks

``prefill_blocks`` are the prompt's blocks still to compute there after its cached prefix (tokens ÷
block size), ``decode_blocks`` the blocks of the work already running or queued there (each request's
context so far). 0 is pure load balancing. The cheapest engine wins (or, with a temperature > 0, one
is sampled with softmax over the normalized costs). A saturated engine loses even when it holds the
prefix, because its decode blocks outweigh what the hit saves.

The default weight is 16, not Dynamo's 1. Dynamo's value suits GPU engines, whose batched decode is
memory-bound, so every active KV block costs decode time. Our CPU engines are compute-bound: a running
request costs about one token of compute per step, whatever its context, so its context blocks overstate
its remaining work roughly by context ÷ remaining output (20-30 in multi-turn chat), while every
prefill block is 16 tokens of real compute. Measured on the router benchmark (bench/bench_router.py,
README): weight 1 moved a third of follow-up turns away from their cached history (hit rate 74 % against
the oracle's 89 %); weight 16 kept 89 % and had the lowest TTFT. Use ``--overlap-weight 1`` for GPU
engines.

Ties are broken without herding: by rendezvous hashing of the session id (one chat keeps going to the
same engine while costs are equal; different chats spread evenly), or at random without a session.

``round_robin`` and ``random`` ignore the cache (baselines); ``oracle`` always takes the longest cached
prefix, ignoring load (the benchmark's reference for the hit rate a placement could reach).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from meshkit.config import setting

POLICIES = ("kv_aware", "round_robin", "random", "oracle")

DEFAULT_OVERLAP_WEIGHT = 16.0

# Costs closer than this are a tie (they are sums of block counts and block fractions).
_TIE = 1e-9


@dataclass(frozen=True)
class CostWeights:
    # Prefill blocks against decode blocks (Dynamo's default: 1).
    overlap: float = setting(
        DEFAULT_OVERLAP_WEIGHT,
        "kv_aware: weight of blocks to prefill against active blocks",
        flag="overlap-weight",
    )
    temperature: float = setting(0.0, "kv_aware: 0 picks the cheapest engine; > 0 samples (softmax)")


@dataclass(frozen=True)
class Candidate:
    """What the policy knows about one engine that may take the request."""

    engine_id: str
    block_size: int
    cached_blocks: int  # leading prompt blocks the index says this engine holds
    decode_blocks: float  # blocks of the work running or queued on it


@dataclass(frozen=True)
class Choice:
    engine_id: str
    cached_blocks: int
    cost: float  # the kv_aware cost of the chosen engine (computed for every policy, for the metrics)


def prefill_blocks(prompt_tokens: int, cached_blocks: int, block_size: int) -> float:
    """Blocks still to compute on an engine holding ``cached_blocks`` of the prompt."""
    return max(prompt_tokens - cached_blocks * block_size, 0) / block_size


def cost(prefill: float, decode: float, weights: CostWeights) -> float:
    return weights.overlap * prefill + decode


def predicted_cached_tokens(prompt_tokens: int, cached_blocks: int, block_size: int) -> int:
    """Prompt tokens an engine will serve from its cache: whole blocks, leaving the last token to compute
    (its logits choose the first output token)."""
    return min(cached_blocks, (prompt_tokens - 1) // block_size) * block_size


def choose(
    policy: str,
    prompt_tokens: int,
    candidates: Sequence[Candidate],
    weights: CostWeights,
    session_id: str = "",
    rng: random.Random | None = None,
    turn: int = 0,
) -> Choice:
    """The engine ``policy`` places the request on. ``turn`` counts earlier decisions (round_robin)."""
    if not candidates:
        raise ValueError("no candidates to choose from")
    rng = rng or random.Random()
    costs = {
        c.engine_id: cost(
            prefill_blocks(prompt_tokens, c.cached_blocks, c.block_size), c.decode_blocks, weights
        )
        for c in candidates
    }
    ordered = sorted(candidates, key=lambda c: c.engine_id)
    if policy == "kv_aware":
        picked = _cheapest(ordered, costs, weights.temperature, session_id, rng)
    elif policy == "round_robin":
        picked = ordered[turn % len(ordered)]
    elif policy == "random":
        picked = rng.choice(ordered)
    elif policy == "oracle":
        longest = max(c.cached_blocks for c in ordered)
        holders = [c for c in ordered if c.cached_blocks == longest]
        least = min(c.decode_blocks for c in holders)
        picked = tie_break([c for c in holders if c.decode_blocks == least], session_id, rng)
    else:
        raise ValueError(f"unknown policy {policy!r}; expected one of {', '.join(POLICIES)}")
    return Choice(picked.engine_id, picked.cached_blocks, costs[picked.engine_id])


def _cheapest(
    ordered: list[Candidate], costs: dict[str, float], temperature: float, session_id: str, rng: random.Random
) -> Candidate:
    low = min(costs.values())
    if temperature > 0:
        high = max(costs.values())
        if high - low > _TIE:
            # Dynamo's softmax sampling: costs scaled to [0, 1], cheaper engines exponentially likelier.
            weights = [math.exp(-(costs[c.engine_id] - low) / (high - low) / temperature) for c in ordered]
            return rng.choices(ordered, weights)[0]
    return tie_break([c for c in ordered if costs[c.engine_id] - low <= _TIE], session_id, rng)


def tie_break(tied: list[Candidate], session_id: str, rng: random.Random) -> Candidate:
    """One of equally good engines: the session's rendezvous-hash favourite, or a random one."""
    if len(tied) == 1:
        return tied[0]
    if session_id:
        return max(tied, key=lambda c: _rendezvous(session_id, c.engine_id))
    return rng.choice(tied)


def _rendezvous(session_id: str, engine_id: str) -> bytes:
    return hashlib.blake2b(f"{session_id}\0{engine_id}".encode(), digest_size=8).digest()
