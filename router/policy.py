"""Placement policies: pure functions from (the request, each candidate's cached prefix and load, weights)
to one engine. No I/O, no clock: the service gathers the inputs, these decide.

``kv_aware`` is NVIDIA Dynamo's cost, per engine::

    cost = overlap_weight · prefill_blocks + decode_blocks (+ session_weight · sessions)

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
docs/benchmarks/router.md): weight 1 moved a third of follow-up turns away from their cached history (hit rate 74 % against
the oracle's 89 %); weight 16 kept 89 % and had the lowest TTFT. Use ``--overlap-weight 1`` for GPU
engines.

Ties are broken without herding: by rendezvous hashing of the session id (splitmix64 over the XOR of
the session's and each engine's 64-bit keys, vectorized) (one chat keeps going to the
same engine while costs are equal; different chats spread evenly), or at random without a session.

The policies are computed over columns (``Pool``: one row per engine, in engine-id order), so that a
decision over a thousand engines is a few vector operations.

The session term (off by default: ``session_weight`` 0) counts only for a request that opens a session
(a chat's first message): ``sessions`` are the sessions whose latest request went to that engine lately
(router/sessions.py). A chat's later turns go where its history is cached, so where its first turn lands
decides where all of them run; load running right now cannot see that, and between turns a chat holds
no running work. So new chats that share a system prompt follow the one engine that caches it, and in
the router benchmark's long chats one engine of four stayed idle. With a weight (256: each session held
counts as 16 blocks of prefill at the default overlap weight) new chats spread by the sessions engines
hold, and a cached shared prefix decides between engines holding about as many. Measured, it did spread
them (48 requests on each engine instead of 120, 36, 36, 0) but gained no throughput on our CPU engines
(two share each core, so an idle one leaves its core to its partner, and a bigger batch costs less per
token) and none in the simulation, with TTFT no better or a little worse (docs/benchmarks/router.md); hence off.

A session hint (``with_hint``, router/sessions.py) credits the engine that last ran the chat with the
blocks the router saw it compute, for when the KV events saying so have not reached the index yet; it
is applied before the policy, only when the index predicts no engine holding more.

``round_robin`` and ``random`` ignore the cache (baselines); ``oracle`` always takes the longest cached
prefix, ignoring load (the benchmark's reference for the hit rate a placement could reach).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

import numpy as np

from meshkit.config import setting

POLICIES = ("kv_aware", "round_robin", "random", "oracle")

DEFAULT_OVERLAP_WEIGHT = 16.0

# A session an engine holds, for a request opening a new one (0: not weighed; see the module's docstring).
DEFAULT_SESSION_WEIGHT = 0.0

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
    session: float = setting(
        DEFAULT_SESSION_WEIGHT,
        "kv_aware: a request opening a session weighs each session an engine holds as this many blocks",
        flag="session-weight",
    )


@dataclass(frozen=True)
class Pool:
    """The candidates as columns, one entry per engine, in engine-id order. Names and rendezvous keys are
    looked up through ``rows`` (so a caller holding them for many engines passes them whole)."""

    rows: np.ndarray  # each candidate's position in ``engine_ids`` and ``rendezvous_keys``
    engine_ids: np.ndarray  # of str
    rendezvous_keys: np.ndarray  # engine_key of each engine id (uint64)
    block_size: np.ndarray | int
    cached_blocks: np.ndarray
    decode_blocks: np.ndarray
    sessions: np.ndarray | int = 0  # sessions each holds, for a request that opens one (0 otherwise)


@dataclass(frozen=True)
class Choice:
    engine_id: str
    cached_blocks: int


def prefill_blocks(prompt_tokens: int, cached_blocks, block_size):
    """Blocks still to compute on an engine holding ``cached_blocks`` of the prompt (numbers or arrays)."""
    return np.maximum(prompt_tokens / block_size - cached_blocks, 0)  # two vector operations, not four


def cost(prefill, decode, weights: CostWeights, sessions=0):
    """The kv_aware cost (numbers or arrays); ``sessions`` only for a request that opens a session."""
    load = weights.overlap * prefill + decode
    if isinstance(sessions, np.ndarray) or sessions:
        return load + weights.session * sessions
    return load  # most requests: one vector operation fewer a decision


def with_hint(cached_blocks: np.ndarray, hinted: int, vouched_blocks: int) -> np.ndarray:
    """Each candidate's cached blocks with a session hint applied: candidate ``hinted`` (a position in
    ``cached_blocks``) is credited with the ``vouched_blocks`` the router saw it compute for the session,
    if the index has not heard of them all yet. Only when the index predicts no better engine: if another
    candidate holds a longer prefix than the hinted one by the index, the index is right (the chat moved
    since, or the hinted engine evicted it) and the hint is ignored. The policy then weighs the credit
    against load as it would a real match, among candidates admission already let through."""
    indexed = cached_blocks[hinted]
    if vouched_blocks <= indexed or cached_blocks.max() > indexed:
        return cached_blocks
    credited = cached_blocks.copy()
    credited[hinted] = vouched_blocks
    return credited


def predicted_cached_tokens(prompt_tokens: int, cached_blocks: int, block_size: int) -> int:
    """Prompt tokens an engine will serve from its cache: whole blocks, leaving the last token to compute
    (its logits choose the first output token)."""
    return min(cached_blocks, (prompt_tokens - 1) // block_size) * block_size


def choose_in(
    policy: str,
    prompt_tokens: int,
    pool: Pool,
    weights: CostWeights,
    session_id: str = "",
    rng: random.Random | None = None,
    turn: int = 0,
) -> Choice:
    """The engine ``policy`` places the request on, over the pool's columns. ``turn`` counts earlier
    decisions (round_robin)."""
    if not len(pool.rows):
        raise ValueError("no candidates to choose from")
    rng = rng or random.Random()
    costs = cost(
        prefill_blocks(prompt_tokens, pool.cached_blocks, pool.block_size),
        pool.decode_blocks,
        weights,
        pool.sessions,
    )
    if policy == "kv_aware":
        picked = _cheapest(pool, costs, weights.temperature, session_id, rng)
    elif policy == "round_robin":
        picked = turn % len(costs)
    elif policy == "random":
        picked = rng.randrange(len(costs))
    elif policy == "oracle":
        holders = (pool.cached_blocks == pool.cached_blocks.max()).nonzero()[0]
        load = pool.decode_blocks[holders]
        picked = tie_break(pool, holders[load == load.min()], session_id, rng)
    else:
        raise ValueError(f"unknown policy {policy!r}; expected one of {', '.join(POLICIES)}")
    return Choice(pool.engine_ids[pool.rows[picked]], int(pool.cached_blocks[picked]))


def _cheapest(pool: Pool, costs: np.ndarray, temperature: float, session_id: str, rng: random.Random) -> int:
    low = costs.min()
    if temperature > 0:
        high = costs.max()
        if high - low > _TIE:
            # Dynamo's softmax sampling: costs scaled to [0, 1], cheaper engines exponentially likelier.
            weights = np.exp(-(costs - low) / (high - low) / temperature)
            return rng.choices(range(len(costs)), weights.tolist())[0]
    return tie_break(pool, (costs - low <= _TIE).nonzero()[0], session_id, rng)


def tie_break(pool: Pool, tied: np.ndarray, session_id: str, rng: random.Random) -> int:
    """One of equally good rows: the session's rendezvous-hash favourite, or a random one."""
    if len(tied) == 1:
        return int(tied[0])
    if session_id:
        scores = _mix(pool.rendezvous_keys[pool.rows[tied]] ^ np.uint64(engine_key(session_id)))
        return int(tied[np.argmax(scores)])
    return int(rng.choice(tied))


def engine_key(name: str) -> int:
    """A stable 64-bit hash of an engine id or a session id (the rendezvous hash mixes the two)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def _mix(keys: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: every bit of the result depends on every bit of the key."""
    keys = (keys ^ (keys >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    keys = (keys ^ (keys >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return keys ^ (keys >> np.uint64(31))
