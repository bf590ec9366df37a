"""Admission by tier as a pure function of the engines' queues: the count rule (the cap) and the wait rule
(predicted wait against the tier's TTFT objective)."""

import pytest

from chatmesh.router.v1 import router_pb2
from chatmesh.tiers import TTFT_OBJECTIVES_S
from router.admission import QueueView, admissible, retry_after_s, safe_depth

FREE, PRO, ENTERPRISE, UNSPECIFIED = (
    router_pb2.TIER_FREE,
    router_pb2.TIER_PRO,
    router_pb2.TIER_ENTERPRISE,
    router_pb2.TIER_UNSPECIFIED,
)


def queues(*waiting: int, max_waiting: int = 10, drain_rate: float = 0.0) -> list[QueueView]:
    """Engines whose queued requests are all free-tier (so every tier's ahead is the whole queue)."""
    return [QueueView(f"e{i}", w, max_waiting, drain_rate, ahead=(w, w, w)) for i, w in enumerate(waiting)]


def engine(
    ahead: tuple[int, int, int],
    drain_rate: float,
    head_ttft_s: float = 0.0,
    name: str = "e0",
    higher_rate: tuple[float, float, float] = (0.0, 0.0, 0.0),
) -> QueueView:
    """One engine with a large bound (only the wait rule binds), queued per tier rank as ``ahead``."""
    return QueueView(name, ahead[0], 256, drain_rate, ahead, head_ttft_s, higher_rate)


# -- the count rule ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("max_waiting", "fraction", "expected"),
    [(10, 0.5, 5), (256, 0.5, 128), (3, 0.5, 1), (1, 0.1, 1), (10, 1.0, 10)],
)
def test_safe_depth_is_a_fraction_of_the_advertised_queue_bound(max_waiting, fraction, expected):
    assert safe_depth(max_waiting, fraction) == expected


@pytest.mark.parametrize(
    ("waiting", "tier", "expected"),
    [
        ((0, 0), FREE, ["e0", "e1"]),
        ((7, 4), FREE, ["e1"]),  # e0 is beyond its safe depth (5)
        ((5, 9), FREE, []),  # every engine beyond: free is shed
        ((5, 9), UNSPECIFIED, []),  # an unspecified tier is the free tier
        ((5, 9), PRO, ["e0", "e1"]),  # ... while paid tiers still get in
        ((5, 9), ENTERPRISE, ["e0", "e1"]),
        ((10, 9), PRO, ["e1"]),
        ((10, 10), PRO, []),  # no headroom anywhere: paid tiers are shed too
        ((10, 10), ENTERPRISE, []),
    ],
)
def test_free_tier_is_shed_first_and_premium_while_any_engine_has_headroom(waiting, tier, expected):
    assert admissible(queues(*waiting), tier, 0.5) == expected


def test_retry_delay_is_the_time_the_least_loaded_engine_needs_to_drain_below_the_limit():
    # Free limit 5: e1 needs (6 - 5 + 1) = 2 finishes at 4/s → 0.5 s; e0 needs 5 at 4/s.
    assert retry_after_s(queues(9, 6, drain_rate=4.0), FREE, 0.5) == pytest.approx(0.5)
    # Premium limit 10: (12 - 10 + 1) = 3 finishes at 2/s.
    assert retry_after_s(queues(12, 14, drain_rate=2.0), PRO, 0.5) == pytest.approx(1.5)


def test_retry_delay_is_bounded_and_has_a_default_without_a_drain_rate():
    assert retry_after_s(queues(500, drain_rate=1.0), FREE, 0.5) == 30.0
    assert retry_after_s(queues(6, drain_rate=1000.0), FREE, 0.5) == 0.5
    assert retry_after_s(queues(9, 9), FREE, 0.5) == 1.0


# -- the wait rule ------------------------------------------------------------------------------------------


def test_the_seeds_target_is_the_enterprise_objective_and_lower_tiers_get_looser_ones():
    assert TTFT_OBJECTIVES_S == {"free": 2.0, "pro": 1.0, "enterprise": 0.5}


@pytest.mark.parametrize(
    ("ahead", "fits"),
    [
        (0, True),  # nothing queued: no wait
        (14, True),  # (14 + 1) / 8 per s = 1.875 s <= 2 s
        (15, True),  # 16 / 8 = 2.0 s: exactly the objective
        (16, False),  # 17 / 8 = 2.125 s > 2 s, though the count rule (128 for free) would take it
        (100, False),
    ],
)
def test_a_request_goes_only_where_its_predicted_wait_fits_its_objective(ahead, fits):
    admitted = admissible([engine((ahead, ahead, ahead), drain_rate=8.0)], FREE, 0.5, objective_s=2.0)
    assert admitted == (["e0"] if fits else [])


def test_the_count_rule_stays_the_cap_whatever_the_drain_rate():
    # 5 queued free requests at the safe depth (5 of 10): a fast engine still refuses free work.
    assert admissible(queues(5, drain_rate=1000.0), FREE, 0.5, objective_s=2.0) == []
    assert admissible(queues(5, drain_rate=1000.0), PRO, 0.5, objective_s=1.0) == ["e0"]


def test_cold_start_without_a_drain_rate_falls_back_to_the_count_rule():
    # No request has finished yet: the wait is unknown, so only the queue depth decides.
    cold = [engine((100, 100, 100), drain_rate=0.0)]
    assert admissible(cold, FREE, 0.5, objective_s=2.0) == ["e0"]  # 100 < 128, the free depth of 256
    assert admissible(cold, FREE, 0.5, objective_s=2.0) == admissible(cold, FREE, 0.5)
    assert retry_after_s([engine((200, 200, 200), 0.0)], FREE, 0.5, objective_s=2.0) == 1.0


def test_each_tier_waits_only_behind_its_own_and_higher_tiers_against_its_own_objective():
    # 20 free, 6 pro and 2 enterprise requests queued on an engine finishing 8 a second.
    mixed = [engine((28, 8, 2), drain_rate=8.0)]
    objectives = TTFT_OBJECTIVES_S
    # free: 29 / 8 = 3.6 s > 2 s; pro: 9 / 8 = 1.1 s > 1 s; enterprise: 3 / 8 = 0.375 s <= 0.5 s.
    assert admissible(mixed, FREE, 0.5, objectives["free"]) == []
    assert admissible(mixed, PRO, 0.5, objectives["pro"]) == []
    assert admissible(mixed, ENTERPRISE, 0.5, objectives["enterprise"]) == ["e0"]
    lighter = [engine((28, 7, 2), drain_rate=8.0)]  # pro: 8 / 8 = 1.0 s fits
    assert admissible(lighter, PRO, 0.5, objectives["pro"]) == ["e0"]


def test_the_engines_own_time_to_a_first_token_comes_out_of_the_budget():
    # 7 ahead at 8/s is a 1.0 s wait: it fits 2 s on a fast engine, not where the first token takes 1.5 s.
    assert admissible([engine((7, 7, 7), 8.0, head_ttft_s=0.01)], FREE, 0.5, 2.0) == ["e0"]
    assert admissible([engine((7, 7, 7), 8.0, head_ttft_s=1.5)], FREE, 0.5, 2.0) == []
    # An idle engine takes a request whose prefill alone exceeds its objective: it cannot do better.
    assert admissible([engine((0, 0, 0), 8.0, head_ttft_s=3.0)], ENTERPRISE, 0.5, 0.5) == ["e0"]


def test_among_engines_only_those_whose_wait_fits_are_candidates():
    fleet = [engine((30, 30, 30), 8.0, name="busy"), engine((3, 3, 3), 8.0, name="light")]
    assert admissible(fleet, FREE, 0.5, objective_s=2.0) == ["light"]


def test_the_retry_delay_is_the_predicted_time_until_the_soonest_engine_would_fit():
    # busy: 31 / 8 = 3.875 s against 2 s → 1.875 s; busier: 41 / 8 = 5.125 s → 3.125 s.
    fleet = [engine((30, 30, 30), 8.0, name="busy"), engine((40, 40, 40), 8.0, name="busier")]
    assert retry_after_s(fleet, FREE, 0.5, objective_s=2.0) == pytest.approx(1.875)
    # The budget is the objective less the head-of-queue TTFT: 3.875 - (2 - 0.5) = 2.375 s.
    slow_start = [engine((30, 30, 30), 8.0, head_ttft_s=0.5)]
    assert retry_after_s(slow_start, FREE, 0.5, objective_s=2.0) == pytest.approx(2.375)
    # Bounded like the count rule's: at least 0.5 s, at most 30 s.
    assert retry_after_s([engine((16, 16, 16), 8.0)], FREE, 0.5, objective_s=2.0) == 0.5
    assert retry_after_s([engine((1000, 1000, 1000), 8.0)], FREE, 0.5, objective_s=2.0) == 30.0


def test_the_retry_delay_waits_for_both_rules():
    # Free depth 5 of 10 needs 4 finishes at 2/s (2 s); its wait, 9 / 2 = 4.5 s, needs 2.5 s below 2 s.
    assert retry_after_s(queues(8, drain_rate=2.0), FREE, 0.5, objective_s=2.0) == pytest.approx(2.5)


def test_higher_tiers_arriving_meanwhile_slow_a_lower_tiers_queue_down_to_what_they_leave():
    # 7 free queued at 8 finishes a second is a 1 s wait; with pro and enterprise being sent at 4 a
    # second they pass it, and its queue drains at 4 a second: 2 s, still within free's 2 s.
    assert admissible([engine((7, 0, 0), 8.0, higher_rate=(4.0, 0.0, 0.0))], FREE, 0.5, 2.0) == ["e0"]
    assert admissible([engine((8, 0, 0), 8.0, higher_rate=(4.0, 0.0, 0.0))], FREE, 0.5, 2.0) == []
    # Higher tiers taking everything it finishes: a queued lower tier would wait without end.
    starved = [engine((1, 0, 0), 8.0, higher_rate=(8.0, 0.0, 0.0))]
    assert admissible(starved, FREE, 0.5, 2.0) == []
    assert retry_after_s(starved, FREE, 0.5, 2.0) == 30.0
    # ... while the top tier, passed by no one, is judged on the drain rate alone.
    assert admissible([engine((1, 0, 0), 8.0, higher_rate=(8.0, 0.0, 0.0))], ENTERPRISE, 0.5, 0.5) == ["e0"]
