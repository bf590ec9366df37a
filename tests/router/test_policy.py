"""Placement policies as pure functions: costs, choices, tie-breaking, baselines."""

import random
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pytest

from router.policy import (
    Choice,
    CostWeights,
    Pool,
    choose_in,
    cost,
    engine_key,
    predicted_cached_tokens,
    prefill_blocks,
)


@dataclass(frozen=True)
class Candidate:
    """One engine that may take the request, as placement's load table holds it."""

    engine_id: str
    block_size: int
    cached_blocks: int
    decode_blocks: float
    sessions: int = 0


def choose(
    policy: str,
    prompt_tokens: int,
    candidates: list[Candidate],
    weights: CostWeights,
    session_id: str = "",
    rng: random.Random | None = None,
    turn: int = 0,
) -> Choice:
    """``choose_in`` over ``candidates`` laid out as placement lays out its pool: columns in engine-id order."""
    ordered = sorted(candidates, key=lambda c: c.engine_id)
    pool = Pool(
        np.arange(len(ordered)),
        np.array([c.engine_id for c in ordered], dtype=object),
        np.array([engine_key(c.engine_id) for c in ordered], dtype=np.uint64),
        np.array([c.block_size for c in ordered], dtype=np.int64),
        np.array([c.cached_blocks for c in ordered], dtype=np.int64),
        np.array([c.decode_blocks for c in ordered], dtype=np.float64),
        np.array([c.sessions for c in ordered], dtype=np.int64),
    )
    return choose_in(policy, prompt_tokens, pool, weights, session_id, rng, turn)


BS = 16
DYNAMO = CostWeights(overlap=1.0)  # Dynamo's default weight


def engines(*specs: tuple[int, float], block_size: int = BS) -> list[Candidate]:
    """Candidates w0, w1, ... from (cached blocks, decode blocks) pairs."""
    return [Candidate(f"w{i}", block_size, cached, decode) for i, (cached, decode) in enumerate(specs)]


@pytest.mark.parametrize(
    ("prefill", "decode", "weight", "expected"),
    [
        (8, 10, 1.0, 18),  # Dynamo's worked example, worker 1
        (5, 5, 1.0, 10),  # worker 2
        (2, 9, 1.0, 11),  # worker 3
        (8, 10, 0.0, 10),  # weight 0: pure load balancing
        (8, 10, 2.0, 26),
        (0, 0, 1.0, 0),
    ],
)
def test_cost_is_weighted_prefill_blocks_plus_decode_blocks(prefill, decode, weight, expected):
    assert cost(prefill, decode, CostWeights(overlap=weight)) == expected


def test_dynamo_worked_example_picks_worker_2():
    # A 10-block prompt; cached prefixes of 2, 5 and 8 blocks leave (8, 5, 2) blocks to prefill.
    candidates = engines((2, 10), (5, 5), (8, 9))
    assert choose("kv_aware", 10 * BS, candidates, DYNAMO).engine_id == "w1"
    assert cost(prefill_blocks(10 * BS, 5, BS), 5, DYNAMO) == 10  # the cheapest: w0 and w2 cost 18 and 11


@pytest.mark.parametrize(
    ("prompt_tokens", "cached", "expected"),
    [(160, 0, 10.0), (160, 4, 6.0), (160, 10, 0.0), (170, 10, 10 / 16), (170, 12, 0.0)],
)
def test_prefill_blocks_are_the_tokens_left_after_the_cached_prefix(prompt_tokens, cached, expected):
    assert prefill_blocks(prompt_tokens, cached, BS) == expected


@pytest.mark.parametrize(
    ("prompt_tokens", "cached", "expected"),
    [(100, 6, 96), (100, 3, 48), (96, 6, 80), (97, 6, 96), (10, 0, 0)],
)
def test_predicted_cache_hit_leaves_the_last_prompt_token_to_compute(prompt_tokens, cached, expected):
    # The engine always recomputes the prompt's last token (its logits choose the first output token).
    assert predicted_cached_tokens(prompt_tokens, cached, BS) == expected


@pytest.mark.parametrize(
    ("specs", "prompt_blocks", "weights", "expected"),
    [
        # A follow-up turn: w1 holds 30 of its 32 blocks, all engines idle → w1.
        ([(0, 0), (30, 0), (2, 0)], 32, DYNAMO, "w1"),
        # w1 is saturated: its load outweighs what the hit saves → the idle engine wins.
        ([(0, 0), (30, 400), (2, 40)], 32, DYNAMO, "w0"),
        ([(0, 0), (30, 600), (2, 40)], 32, CostWeights(), "w0"),  # the default weight gives way later
        # Same load everywhere: the hit decides.
        ([(0, 50), (30, 50)], 32, DYNAMO, "w1"),
        # A follow-up whose history is cached: Dynamo's weight leaves it for a slightly idler engine,
        # the default keeps it home (see router/policy.py on why).
        ([(0, 20), (30, 60)], 32, DYNAMO, "w0"),
        ([(0, 20), (30, 60)], 32, CostWeights(), "w1"),
        # Weight 0 ignores the cache: least loaded.
        ([(0, 5), (30, 50)], 32, CostWeights(overlap=0.0), "w0"),
        # A heavier prefill weight keeps affinity under more load.
        ([(0, 0), (30, 40)], 32, CostWeights(overlap=2.0), "w1"),
        ([(0, 0), (30, 40)], 32, DYNAMO, "w0"),
    ],
)
def test_kv_aware_picks_the_cheapest_engine(specs, prompt_blocks, weights, expected):
    choice = choose("kv_aware", prompt_blocks * BS, engines(*specs), weights, rng=random.Random(0))
    assert choice.engine_id == expected


def test_a_session_keeps_its_engine_while_costs_tie():
    tied = engines((0, 0), (0, 0), (0, 0), (0, 0))
    picks = {
        choose("kv_aware", 64, tied, CostWeights(), "chat-42", random.Random(i)).engine_id for i in range(20)
    }
    assert len(picks) == 1


def test_ties_spread_sessions_evenly_instead_of_herding():
    tied = engines((0, 0), (0, 0), (0, 0), (0, 0))
    counts = Counter(choose("kv_aware", 64, tied, CostWeights(), f"chat-{i}").engine_id for i in range(4000))
    assert set(counts) == {"w0", "w1", "w2", "w3"}
    assert max(counts.values()) < 1.15 * min(counts.values())


def test_ties_without_a_session_are_random():
    tied = engines((0, 0), (0, 0), (0, 0))
    rng = random.Random(7)
    counts = Counter(choose("kv_aware", 64, tied, CostWeights(), "", rng).engine_id for _ in range(3000))
    assert max(counts.values()) < 1.15 * min(counts.values())


def test_ties_are_only_among_the_cheapest():
    candidates = engines((0, 0), (0, 0), (0, 1))
    picks = {choose("kv_aware", 64, candidates, CostWeights(), f"s{i}").engine_id for i in range(200)}
    assert picks == {"w0", "w1"}


def test_temperature_samples_cheaper_engines_more_often():
    candidates = engines((0, 0), (0, 10), (0, 20))
    rng = random.Random(1)
    counts = Counter(
        choose("kv_aware", 64, candidates, CostWeights(temperature=0.5), "", rng).engine_id
        for _ in range(3000)
    )
    assert counts["w0"] > counts["w1"] > counts["w2"] > 0


def test_round_robin_cycles_in_engine_order_ignoring_cache_and_load():
    candidates = engines((9, 100), (0, 0), (0, 0))
    picks = [choose("round_robin", 64, candidates, CostWeights(), turn=turn).engine_id for turn in range(6)]
    assert picks == ["w0", "w1", "w2", "w0", "w1", "w2"]


def test_random_spreads_uniformly():
    candidates = engines((9, 0), (0, 0))
    rng = random.Random(3)
    counts = Counter(choose("random", 64, candidates, CostWeights(), "s", rng).engine_id for _ in range(2000))
    assert abs(counts["w0"] - counts["w1"]) < 200


@pytest.mark.parametrize(
    ("specs", "expected"),
    [
        ([(3, 0), (9, 500), (5, 0)], {"w1"}),  # longest prefix, whatever the load
        ([(4, 10), (4, 2), (1, 0)], {"w1"}),  # equal prefixes: the less loaded one
        ([(0, 0), (0, 0), (0, 1)], {"w0", "w1"}),  # nothing cached: least loaded, then spread
    ],
)
def test_oracle_takes_the_longest_cached_prefix(specs, expected):
    picks = {choose("oracle", 320, engines(*specs), CostWeights(), f"s{i}").engine_id for i in range(100)}
    assert picks == expected


def test_the_choice_reports_the_cached_blocks_of_the_engine_picked():
    choice = choose("round_robin", 10 * BS, engines((2, 10), (5, 5)), DYNAMO, turn=1)
    assert (choice.engine_id, choice.cached_blocks) == ("w1", 5)


def test_unknown_policy_and_empty_candidates_are_refused():
    with pytest.raises(ValueError, match="unknown policy"):
        choose("fastest", 64, engines((0, 0)), CostWeights())
    with pytest.raises(ValueError, match="no candidates"):
        choose("kv_aware", 64, [], CostWeights())


def test_a_request_opening_a_session_weighs_the_sessions_each_engine_holds():
    # w0 holds the 23-block shared system prompt and 3 sessions; w1 holds neither.
    held = [Candidate("w0", BS, 23, 0.0, sessions=3), Candidate("w1", BS, 0, 0.0, sessions=0)]
    weights = CostWeights(session=256)  # and overlap 16
    assert choose("kv_aware", 24 * BS, held, weights).engine_id == "w1"
    assert cost(1, 0, weights, 3) == 16 + 3 * 256
    # With sessions about even the cached prefix decides.
    even = [Candidate("w0", BS, 23, 0.0, sessions=3), Candidate("w1", BS, 0, 0.0, sessions=2)]
    assert choose("kv_aware", 24 * BS, even, weights).engine_id == "w0"
    # Weight 0, the default: new chats follow the prefix.
    assert choose("kv_aware", 24 * BS, held, CostWeights()).engine_id == "w0"
