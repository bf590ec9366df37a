"""Admission by tier as a pure function of the engines' queues: the count rule (the cap) and the wait rule
(predicted wait against the tier's TTFT objective: queued requests, or the steps of an engine that
reports its step time)."""

from collections.abc import Sequence

import numpy as np
import pytest

from chatmesh.router.v1 import router_pb2
from chatmesh.tiers import TTFT_OBJECTIVES_S, tier_of_proto
from router.admission import (
    Queues,
    QueueView,
    StepModel,
    Steps,
    admissible_rows,
    compute_ttft_s,
    first_token_after_start_s,
    limits,
    retry_after_rows,
    safe_depth,
)

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


def columns(
    views: Sequence[QueueView],
    tier: int,
    own_prefill: int | Sequence[int],
    higher_objectives_s: tuple[float, ...],
) -> Queues:
    """``views`` as the columns placement reads from its load table, as a request of ``tier`` sees them."""
    rank = tier_of_proto(tier).rank
    return Queues(
        np.array([q.waiting for q in views], dtype=np.int64),
        np.array([q.max_waiting for q in views], dtype=np.int64),
        np.array([q.ahead[rank] for q in views], dtype=np.int64),
        np.array([q.drain_rate for q in views], dtype=np.float64),
        np.array([q.head_ttft_s for q in views], dtype=np.float64),
        np.array([q.higher_rate[rank] for q in views], dtype=np.float64),
        Steps.of([q.steps for q in views], rank),
        own_prefill=np.broadcast_to(np.asarray(own_prefill, dtype=np.int64), (len(views),)),
        higher_objectives_s=higher_objectives_s,
    )


def admissible(
    views: Sequence[QueueView],
    tier: int,
    free_queue_fraction: float,
    objective_s: float | None = None,
    own_prefill: int | Sequence[int] = 1,
    higher_objectives_s: tuple[float, ...] = (),
) -> list[str]:
    """The engines of ``views`` that may take a request of ``tier`` now (empty: shed it)."""
    queues = columns(views, tier, own_prefill, higher_objectives_s)
    rows = admissible_rows(queues, limits(queues.max_waiting, tier, free_queue_fraction), objective_s)
    return [q.engine_id for q, ok in zip(views, rows, strict=True) if ok]


def retry_after_s(
    views: Sequence[QueueView],
    tier: int,
    free_queue_fraction: float,
    objective_s: float | None = None,
    own_prefill: int | Sequence[int] = 1,
    higher_objectives_s: tuple[float, ...] = (),
) -> float:
    """When a shed request of ``tier`` should come back to ``views``."""
    queues = columns(views, tier, own_prefill, higher_objectives_s)
    return retry_after_rows(queues, limits(queues.max_waiting, tier, free_queue_fraction), objective_s)


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


# -- the wait on an engine that computes: the steps until the request's prefill is done ---------------


def stepping(
    prefill_ahead: tuple[int, int, int] = (0, 0, 0),
    decoding: int = 0,
    pending: int | None = None,
    name: str = "e0",
    budget: int = 512,
    fixed_s: float = 0.01,
    token_s: float = 0.002,
) -> QueueView:
    """An engine that queues nothing and reports its step time: 10 ms + 2 ms a token by default."""
    pending = prefill_ahead[0] if pending is None else pending
    steps = StepModel(budget, fixed_s, token_s, decoding, pending, prefill_ahead)
    return QueueView(name, 0, 256, 8.0, (0, 0, 0), steps=steps)


def test_the_time_to_a_first_token_is_the_step_in_progress_and_the_steps_of_the_prefill_ahead_and_its_own():
    steps = Steps.of([stepping((900, 900, 900), decoding=12).steps], 0)
    # The step in progress: 12 decodes + min(500 room, 900 pending) = 512 tokens, 1.034 s. Then 900 + 100
    # tokens at 500 a step: one full step of 512 tokens (1.034 s) and a last one of 12 + 500 (1.034 s).
    assert compute_ttft_s(steps, np.array([100]), steps.prefill_ahead)[0] == pytest.approx(3 * 1.034)
    # From its own first step: 100 tokens and 12 decodes, one step.
    assert first_token_after_start_s(steps, np.array([100]))[0] == pytest.approx(0.01 + 0.002 * 112)
    # An idle engine: its own step alone, nothing in progress.
    idle = Steps.of([stepping().steps], 0)
    assert compute_ttft_s(idle, np.array([40]), idle.prefill_ahead)[0] == pytest.approx(0.01 + 0.002 * 40)


def test_an_engine_that_queues_nothing_is_refused_when_the_prefill_ahead_outlasts_the_objective():
    # 200 tokens ahead and 20 decoding: in progress 10 + 2 x 220 ms = 0.45 s, then one step of
    # 20 + 200 + 40 = 260 tokens, 0.53 s: 0.98 s fits pro's 1 s; 300 ahead does not.
    assert admissible([stepping((200, 200, 200), decoding=20)], PRO, 0.5, 1.0, own_prefill=40) == ["e0"]
    assert admissible([stepping((300, 300, 300), decoding=20)], PRO, 0.5, 1.0, own_prefill=40) == []
    # The retry delay is how much longer than the objective it would wait: with 600 ahead, a full step
    # in progress (1.034 s), then 640 tokens at 492 a step: a full one and one of 20 + 148 tokens.
    late = retry_after_s([stepping((600, 600, 600), decoding=20)], PRO, 0.5, 1.0, own_prefill=40)
    assert late == pytest.approx(2 * 1.034 + 0.01 + 0.002 * 168 - 1.0)


def test_a_tier_waits_only_for_the_prefill_of_its_own_and_higher_tiers():
    # 300 free prompt tokens pending, none of higher tiers: only the step in progress (0.65 s) holds
    # pro back (then its own step: 0.13 s); free also waits for those 300 tokens (a step of 0.73 s).
    mixed = [stepping((300, 0, 0), decoding=20, pending=300)]
    assert admissible(mixed, FREE, 0.5, 1.0, own_prefill=40) == []
    assert admissible(mixed, PRO, 0.5, 1.0, own_prefill=40) == ["e0"]


def test_a_request_whose_own_prefill_outlasts_its_objective_is_served_where_nothing_is_ahead():
    # 1,000 tokens of its own are two steps, ~2 s: more than pro's 1 s on any engine.
    long_prompt = 1_000
    fleet = [
        stepping((0, 0, 0), decoding=4, name="clear"),
        stepping((100, 100, 100), decoding=4, name="ahead"),
    ]
    assert admissible(fleet, PRO, 0.5, 1.0, own_prefill=long_prompt) == ["clear"]


def test_an_engine_that_reports_no_step_time_keeps_the_queue_count_rule():
    # The same engine with no step model: nothing queued, so it fits whatever its steps would take.
    unknown = QueueView("e0", 0, 256, 8.0, (0, 0, 0), steps=StepModel(0, 0.0, 0.0, 20, 5_000, (5_000,) * 3))
    assert admissible([unknown], FREE, 0.5, 2.0, own_prefill=40) == ["e0"]


def test_a_lower_tier_is_refused_before_its_decoding_slows_the_steps_past_a_higher_tiers_objective():
    # Nothing pending, 80 decoding: free's own first token (a decode step, 0.17 s, then 80 + 40 tokens,
    # 0.25 s) fits its 2 s. But an enterprise request sent next, with this one decoding too, would wait
    # 0.172 + 0.252 = 0.424 s: within 0.5 s; at 100 decoding, 0.212 + 0.292 = 0.504 s: not.
    enterprise = (TTFT_OBJECTIVES_S["pro"], TTFT_OBJECTIVES_S["enterprise"])
    assert admissible([stepping(decoding=80)], FREE, 0.5, 2.0, 40, enterprise) == ["e0"]
    assert admissible([stepping(decoding=100)], FREE, 0.5, 2.0, 40, enterprise) == []
    assert admissible([stepping(decoding=100)], FREE, 0.5, 2.0, 40) == ["e0"], "with no tier above"
    # Enterprise itself has no tier above to leave room for: at 99 decoding, 0.208 + 0.288 s fits 0.5 s.
    assert admissible([stepping(decoding=99)], ENTERPRISE, 0.5, 0.5, 40) == ["e0"]


def test_a_turn_refused_where_its_history_is_cached_is_not_let_in_where_it_is_not():
    # Cached on "home": 40 tokens of its own, but 400 of pro's pending there (past 1 s). On "away" it
    # would prefill its whole 500-token history: 1.01 s on an idle engine, 1.05 s beside 10 decoding.
    # A prompt that fits the objective somewhere (40 tokens: 0.09 s) is held to it everywhere, not let
    # in late where its history is not cached.
    fleet = [stepping((400, 400, 400), decoding=10, name="home"), stepping(decoding=10, name="away")]
    assert admissible(fleet, PRO, 0.5, 1.0, own_prefill=(40, 500)) == []
    # A prompt long everywhere is still served where nothing else is pending.
    assert admissible(fleet, PRO, 0.5, 1.0, own_prefill=(600, 600)) == ["away"]


def test_the_engines_recent_margin_is_added_to_every_prediction_there():
    # With 40 decoding, 0.09 + 0.17 s predicted fits enterprise's 0.5 s; not with first tokens lately
    # 0.3 s later than predicted there.
    steps = StepModel(512, 0.01, 0.002, 40, 0, (0, 0, 0), margin_s=0.3)
    late = QueueView("e0", 0, 256, 8.0, (0, 0, 0), steps=steps)
    assert admissible([stepping(decoding=40)], ENTERPRISE, 0.5, 0.5, own_prefill=40) == ["e0"]
    assert admissible([late], ENTERPRISE, 0.5, 0.5, own_prefill=40) == []
