"""Session hints without processes: what a hint vouches for, the LRU bound, the pure rule
(``policy.with_hint``), and the Placer applying it only when the index predicts no better engine and
admission lets the hinted engine take the request."""

import numpy as np

from chatmesh.block_hash import block_hashes
from chatmesh.router.v1 import router_pb2
from router.placement import Placer, RequestPlan
from router.policy import with_hint
from router.sessions import SessionHint, SessionHints, SessionsHeld
from tests.router.test_placement import Registry, engine, placer

BLOCK = 16
FIRST = list(range(1000, 1100))  # 100 tokens: 6 full blocks
ANSWER = list(range(5000, 5040))  # 40 tokens: prompt + answer but its last token = 139 tokens, 8 blocks
FOLLOW_UP = FIRST + ANSWER + list(range(7000, 7030))  # 170 tokens: 10 blocks, the first 8 as computed
SESSION = "chat-1"


def test_a_hint_vouches_for_the_deepest_anchor_the_prompt_extends():
    context = block_hashes(FOLLOW_UP)[:8]
    hint = SessionHint("a", ((8, context[7]), (6, context[5])))
    assert hint.vouched_blocks(block_hashes(FOLLOW_UP)) == 8
    # The answer re-encoded differently: only the prompt's blocks are the same.
    reworded = FIRST + list(range(6000, 6070))
    assert hint.vouched_blocks(block_hashes(reworded)) == 6
    # Another prefix (a summary replaced the history), or a prompt shorter than the anchors.
    assert hint.vouched_blocks(block_hashes(list(range(9000, 9200)))) == 0
    assert hint.vouched_blocks(block_hashes(FIRST[:80])) == 0


def test_hints_are_bounded_least_recently_finished_first():
    hints = SessionHints(capacity=2)
    for session in ("s1", "s2", "s1", "s3"):  # s1 finished again: s2 is now the oldest
        hints.remember(session, "a", [11, 12], 1)
    assert len(hints) == 2 and hints.get("s2") is None
    assert hints.get("s1") == SessionHint("a", ((2, 12), (1, 11)))
    off = SessionHints(capacity=0)
    off.remember("s1", "a", [11], 1)
    assert len(off) == 0 and hints.get("") is None


def test_the_rule_credits_the_hinted_engine_only_where_the_index_predicts_no_better_one():
    cached = np.array([6, 2, 2])
    assert with_hint(cached, 0, 8).tolist() == [8, 2, 2]
    assert cached.tolist() == [6, 2, 2]  # the input is not changed
    assert with_hint(cached, 0, 5) is cached  # the index already knows more than the hint says
    assert with_hint(np.array([6, 7, 2]), 0, 9).tolist() == [6, 7, 2]  # another engine holds more
    assert with_hint(np.array([2, 2, 2]), 1, 8).tolist() == [2, 8, 2]  # nothing of it heard yet


def busy_pair(a_waiting: int = 0, b_load_tokens: int = 0) -> Registry:
    """Engines a and b; a ran the session's first turn and is busier (100 blocks of other work); the
    index heard of the first prompt's blocks on a, not of the answer's."""
    registry = Registry(engine("a", waiting=a_waiting), engine("b"))
    a, b = registry.engines()
    a.dispatched("other", 100 * BLOCK)
    if b_load_tokens:
        b.dispatched("other", b_load_tokens)
    registry.index.store("a", block_hashes(FIRST))
    return registry


def follow_up_on(chooser: Placer, prompt: list[int] = FOLLOW_UP) -> tuple[str, int]:
    placement = chooser.place(RequestPlan("r2", prompt, session_id=SESSION), set(), admit=True)
    return placement.engine.engine_id, placement.predicted_cached_tokens


def first_turn_finished_on_a(chooser: Placer) -> None:
    a = chooser.registry.engines()[0]
    chooser.remember(RequestPlan("r1", FIRST, session_id=SESSION), a, ANSWER)


def hinted(chooser: Placer) -> float | None:
    return chooser.metrics.registry.get_sample_value("chatmesh_router_session_hinted_placements_total")


def test_the_follow_up_goes_back_to_the_engine_that_computed_it_before_the_index_heard():
    # a: 16·(170 - 96)/16 + 100 = 174 by the index; b: 170. With the answer's blocks, a: 42 + 100.
    without = placer(busy_pair(), session_hints=0)
    first_turn_finished_on_a(without)
    assert follow_up_on(without) == ("b", 0)

    chooser = placer(busy_pair())
    first_turn_finished_on_a(chooser)
    assert follow_up_on(chooser) == ("a", 8 * BLOCK)
    assert hinted(chooser) == 1


def test_a_longer_match_in_the_index_wins_over_the_hint():
    # b holds 7 blocks by the index, a 6 (8 with the hint); equal loads: the hint would pick a.
    registry = busy_pair(b_load_tokens=100 * BLOCK)
    registry.index.store("b", block_hashes(FOLLOW_UP)[:7])
    chooser = placer(registry)
    first_turn_finished_on_a(chooser)
    assert follow_up_on(chooser) == ("b", 7 * BLOCK)
    assert hinted(chooser) == 0


def test_the_hint_never_overrides_admission():
    # a's queue is at the free tier's safe depth: the free follow-up goes to b, hint or not.
    chooser = placer(busy_pair(a_waiting=4), free_queue_fraction=0.5)
    first_turn_finished_on_a(chooser)
    assert follow_up_on(chooser) == ("b", 0)
    paid = RequestPlan("r3", FOLLOW_UP, tier=router_pb2.TIER_PRO, session_id=SESSION)
    assert chooser.place(paid, set(), admit=True).engine.engine_id == "a"  # admitted there: hinted


def test_a_prompt_that_does_not_extend_the_sessions_context_is_placed_by_the_index_alone():
    chooser = placer(busy_pair())
    first_turn_finished_on_a(chooser)
    summarized = list(range(9000, 9170))  # same session, a new prefix
    assert follow_up_on(chooser, summarized) == ("b", 0)
    assert hinted(chooser) == 0


class _Engine:
    def __init__(self) -> None:
        self.sessions = 0

    def hold_sessions(self, delta: int) -> None:
        self.sessions += delta


def test_sessions_held_are_bounded_oldest_placement_first():
    a, b = _Engine(), _Engine()
    held = SessionsHeld(idle_s=100, capacity=2)
    held.placed("s1", a, 0.0)
    held.placed("s2", b, 1.0)
    held.placed("s1", b, 2.0)  # moves: counted once, where its latest request went
    assert (a.sessions, b.sessions, len(held)) == (0, 2, 2)
    held.placed("s3", a, 3.0)  # over capacity: s2 (placed longest ago) is dropped
    assert (a.sessions, b.sessions, len(held)) == (1, 1, 2)
    held.expire(102.5)  # s1 (at 2.0) is idle past 100 s; s3 (at 3.0) is not
    assert (a.sessions, b.sessions, len(held)) == (1, 0, 1)
