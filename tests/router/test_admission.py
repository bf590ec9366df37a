"""Admission by tier as a pure function of the engines' queues."""

import pytest

from chatmesh.router.v1 import router_pb2
from router.admission import QueueView, admissible, retry_after_s, safe_depth

FREE, PRO, ENTERPRISE, UNSPECIFIED = (
    router_pb2.TIER_FREE,
    router_pb2.TIER_PRO,
    router_pb2.TIER_ENTERPRISE,
    router_pb2.TIER_UNSPECIFIED,
)


def queues(*waiting: int, max_waiting: int = 10, drain_rate: float = 0.0) -> list[QueueView]:
    return [QueueView(f"e{i}", w, max_waiting, drain_rate) for i, w in enumerate(waiting)]


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
