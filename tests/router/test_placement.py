"""Placement glue without processes: per-model pools, tokenizer checks, health, admission by tier,
and each engine's cached prefix taken from the index with that engine's own block size."""

import math
import random

import grpc
import pytest
from prometheus_client import CollectorRegistry

from chatmesh.block_hash import BLOCK_HASH_SEED, block_hashes
from chatmesh.engine.v1 import engine_pb2
from chatmesh.errors import ServiceError
from chatmesh.router.v1 import router_pb2
from chatmesh.tiers import tier_of_proto
from router.config import RouterConfig
from router.engines import EngineState
from router.index import PrefixIndex
from router.loads import LoadTable
from router.metrics import RouterMetrics
from router.placement import Placer, RequestPlan
from router.policy import CostWeights

PROMPT = list(range(200, 200 + 100))


class Registry:
    """What Placer reads of the real registry: the engines, the index and the load table."""

    def __init__(self, *engines: EngineState) -> None:
        self._engines = list(engines)
        self.index = PrefixIndex()
        self.loads = LoadTable()
        for engine in engines:
            self.index.add_engine(engine.engine_id, 10_000)
            engine.attach(self.loads, self.index.slot(engine.engine_id))

    def engines(self) -> list[EngineState]:
        return self._engines


def engine(
    engine_id: str,
    model: str = "small",
    fingerprint: str = "tok-a",
    block_size: int = 16,
    waiting: int = 0,
    max_waiting: int = 8,
    healthy: bool = True,
    reachable: bool = True,
) -> EngineState:
    state = EngineState(engine_id, f"{engine_id}:1", channel=None, stub=None)
    if reachable:
        state.info = engine_pb2.GetModelInfoResponse(
            model=model,
            tokenizer_fingerprint=fingerprint,
            block_size=block_size,
            block_hash_seed=BLOCK_HASH_SEED,
        )
        state.connected = True
        state.report(
            engine_pb2.EngineLoad(waiting_requests=waiting, max_waiting_requests=max_waiting, serving=healthy)
        )
    return state


def placer(registry: Registry, **config) -> Placer:
    return Placer(registry, RouterConfig(**config), RouterMetrics(CollectorRegistry()), random.Random(0))


def place(placer: Placer, tier=router_pb2.TIER_FREE, admit=True, exclude=(), **plan) -> str:
    request = RequestPlan("r", PROMPT, tier=tier, **plan)
    return placer.place(request, set(exclude), admit).engine.engine_id


def refused(placer: Placer, **kwargs) -> ServiceError:
    with pytest.raises(ServiceError) as err:
        place(placer, **kwargs)
    return err.value


def test_a_request_goes_only_to_engines_of_its_model():
    registry = Registry(engine("a1", "small"), engine("b1", "large"), engine("b2", "large"))
    chooser = placer(registry)
    assert {place(chooser, model="large") for _ in range(20)} == {"b1", "b2"}
    assert place(chooser, model="small") == "a1"
    assert refused(chooser, model="huge").code == grpc.StatusCode.NOT_FOUND


def test_without_a_model_the_default_or_the_only_model_served_is_used():
    two_models = Registry(engine("a1", "small"), engine("b1", "large"))
    err = refused(placer(two_models))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "large, small" in err.message
    assert place(placer(two_models, default_model="large")) == "b1"
    assert place(placer(Registry(engine("a1"), engine("a2")))) in {"a1", "a2"}


def test_an_unknown_model_is_unavailable_until_every_engine_has_been_reached():
    registry = Registry(engine("a1", "small"), engine("x", reachable=False))
    err = refused(placer(registry), model="large")
    assert err.code == grpc.StatusCode.UNAVAILABLE and "1 of 2 engines not reached" in err.message


def test_engines_with_another_tokenizer_are_not_candidates():
    registry = Registry(engine("a1", fingerprint="tok-a"), engine("a2", fingerprint="tok-b"))
    chooser = placer(registry)
    assert {place(chooser, tokenizer_fingerprint="tok-b") for _ in range(10)} == {"a2"}
    assert refused(chooser, tokenizer_fingerprint="tok-c").code == grpc.StatusCode.FAILED_PRECONDITION


def test_unhealthy_and_already_tried_engines_are_skipped():
    registry = Registry(engine("a1", healthy=False), engine("a2"), engine("a3"))
    chooser = placer(registry)
    assert place(chooser, exclude={"a3"}) == "a2"
    err = refused(chooser, exclude={"a2", "a3"})
    assert err.code == grpc.StatusCode.UNAVAILABLE and "already tried: a2, a3" in err.message


def test_free_is_shed_beyond_safe_depth_but_a_failover_goes_wherever_there_is_headroom():
    registry = Registry(engine("a1", waiting=4, max_waiting=8), engine("a2", waiting=7, max_waiting=8))
    chooser = placer(registry, free_queue_fraction=0.5)
    err = refused(chooser, tier=router_pb2.TIER_FREE)
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.retry_after_s is not None
    assert place(chooser, tier=router_pb2.TIER_PRO) in {"a1", "a2"}
    assert place(chooser, tier=router_pb2.TIER_FREE, admit=False) in {"a1", "a2"}
    assert (
        chooser.metrics.registry.get_sample_value("chatmesh_router_shed_requests_total", {"tier": "free"})
        == 1
    )


def test_each_engine_is_matched_with_hashes_of_its_own_block_size():
    registry = Registry(engine("bs16", block_size=16), engine("bs32", block_size=32))
    registry.index.store("bs32", block_hashes(PROMPT, 32))  # all 3 full 32-token blocks
    registry.index.store("bs16", block_hashes(PROMPT, 16)[:2])
    placement = placer(registry).place(RequestPlan("r", PROMPT), set(), admit=True)
    assert placement.engine.engine_id == "bs32" and placement.predicted_cached_tokens == 96


# Degrade: "small" has a cheaper model, "small-lite"; its pool takes free requests "small" refuses.
DEGRADE = {"degrade": (("small", "small-lite"),), "free_queue_fraction": 0.5}


def busy_primary_and_lite(lite_waiting: int, lite_fingerprint: str = "tok-a") -> Registry:
    return Registry(
        engine("a1", "small", waiting=4, max_waiting=8),  # at the free tier's safe depth
        engine("lite1", "small-lite", fingerprint=lite_fingerprint, waiting=lite_waiting, max_waiting=8),
    )


def degraded(chooser: Placer) -> float | None:
    return chooser.metrics.registry.get_sample_value(
        "chatmesh_router_degraded_requests_total", {"model": "small", "served_model": "small-lite"}
    )


def test_a_free_request_its_pool_refuses_is_degraded_to_the_cheaper_pool():
    chooser = placer(busy_primary_and_lite(lite_waiting=0), **DEGRADE)
    placement = chooser.place(RequestPlan("r", PROMPT, model="small"), set(), admit=True)
    assert (placement.engine.engine_id, placement.model, placement.degraded) == ("lite1", "small-lite", True)
    assert degraded(chooser) == 1
    # With headroom left for it, a free request stays on its own model.
    calm = placer(Registry(engine("a1", "small"), engine("lite1", "small-lite")), **DEGRADE)
    placement = calm.place(RequestPlan("r", PROMPT, model="small"), set(), admit=True)
    assert (placement.engine.engine_id, placement.model, placement.degraded) == ("a1", "small", False)


def test_paid_tiers_are_never_degraded():
    registry = Registry(
        engine("a1", "small", waiting=8, max_waiting=8), engine("lite1", "small-lite", max_waiting=8)
    )
    chooser = placer(registry, **DEGRADE)
    for tier in (router_pb2.TIER_PRO, router_pb2.TIER_ENTERPRISE):
        err = refused(chooser, tier=tier, model="small")
        assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert degraded(chooser) is None


def test_the_cheaper_pool_takes_free_requests_up_to_its_bound_then_they_are_shed():
    # Past the free tier's safe depth of the cheaper pool (4 of 8) it still takes them: it exists for them.
    assert place(placer(busy_primary_and_lite(lite_waiting=7), **DEGRADE), model="small") == "lite1"
    chooser = placer(busy_primary_and_lite(lite_waiting=8), **DEGRADE)
    err = refused(chooser, model="small")
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.retry_after_s is not None
    assert degraded(chooser) is None
    shed = chooser.metrics.registry.get_sample_value("chatmesh_router_shed_requests_total", {"tier": "free"})
    assert shed == 1


def test_no_degrade_without_a_cheaper_model_or_to_another_tokenizer_or_on_failover():
    assert refused(placer(busy_primary_and_lite(0)), model="small").code == grpc.StatusCode.RESOURCE_EXHAUSTED
    other_tokenizer = placer(busy_primary_and_lite(0, lite_fingerprint="tok-b"), **DEGRADE)
    err = refused(other_tokenizer, model="small", tokenizer_fingerprint="tok-a")
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    # A failover goes wherever its own pool has headroom; it is never moved to another model's pool.
    failover = placer(busy_primary_and_lite(0), **DEGRADE).place(
        RequestPlan("r", PROMPT, model="small"), set(), admit=False
    )
    assert (failover.engine.engine_id, failover.degraded) == ("a1", False)


def test_degrade_pairs_are_checked():
    assert RouterConfig(degrade=(("a", "a-lite"),)).cheaper_models() == {"a": "a-lite"}
    for pairs in ((("a", "b"), ("a", "c")), (("a", "b"), ("b", "c"))):
        with pytest.raises(ValueError, match="--degrade"):
            RouterConfig(degrade=pairs)


# Admission by predicted wait, through EngineState's own bookkeeping (a fake clock in seconds).


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def measured_engine(engine_id: str, clock: Clock, finishes_per_s: float = 4.0) -> EngineState:
    """An engine this router has seen finish 9 requests at ``finishes_per_s``, each with its first token
    50 ms after it was sent to an empty queue; then it has a bound of 256 queued."""
    state = engine(engine_id, max_waiting=256)
    state.clock = clock
    for i in range(9):
        state.dispatched(f"warm-{i}", 10)
        clock.now += 0.05
        state.progressed(f"warm-{i}", 11)
        clock.now += 1 / finishes_per_s - 0.05
        state.ended(f"warm-{i}", completed=True)
    return state


def queue_on(state: EngineState, count: int, tier: int) -> list[str]:
    """Sends ``count`` requests of ``tier`` that queue there; their ids."""
    ids = [f"{state.engine_id}-queued-{len(state.inflight)}-{i}" for i in range(count)]
    for request_id in ids:
        state.dispatched(request_id, 10, tier_of_proto(tier).rank)
    return ids


def test_engine_state_measures_its_drain_rate_and_head_of_queue_ttft_and_queues_by_tier():
    clock = Clock()
    state = measured_engine("a1", clock)
    assert state.drain_rate() == pytest.approx(4.0)
    assert state.head_ttft_s == pytest.approx(0.05)
    queue_on(state, 5, router_pb2.TIER_FREE)
    queue_on(state, 2, router_pb2.TIER_PRO)
    [enterprise] = queue_on(state, 1, router_pb2.TIER_ENTERPRISE)
    view = state.queue_view()
    assert view.waiting == 8 and view.ahead == (8, 3, 1)
    assert view.higher_rate == (0.0, 0.0, 0.0)  # the engine reports no queue: nothing passes anyone
    state.report(
        engine_pb2.EngineLoad(waiting_requests=8, blocked_requests=8, max_waiting_requests=256, serving=True)
    )
    view = state.queue_view()
    # A queued request's first token takes it out of the queue; one that queued says nothing of the
    # engine's head-of-queue TTFT.
    clock.now += 3.0
    state.progressed(enterprise, 11)
    assert state.queue_view().ahead == (7, 2, 0) and state.head_ttft_s == pytest.approx(0.05)
    # With a queue at the engine, each tier is passed by the higher tiers' recent admission rate (the
    # warm-up's 9 free requests pass no one); the rate decays once a tier stops arriving.
    assert view.higher_rate[2] == 0.0
    assert view.higher_rate[1] == pytest.approx(1.0, rel=0.01)  # 1 enterprise request / the 1 s tau
    assert view.higher_rate[0] == pytest.approx(3.0, rel=0.01)  # and 2 pro
    clock.now += 1.0
    assert state.queue_view().higher_rate[0] == pytest.approx(3.0 * math.exp(-4), rel=0.01)
    # What another router sent (the report beyond this router's own) is ahead of every tier.
    state.report(
        engine_pb2.EngineLoad(
            waiting_requests=10, blocked_requests=10, max_waiting_requests=256, serving=True
        )
    )
    assert state.queue_view().ahead == (10, 5, 3)


def test_requests_not_started_wait_only_beyond_the_running_slots_the_engine_reported_free():
    clock = Clock()
    state = measured_engine("a1", clock)
    state.report(
        engine_pb2.EngineLoad(
            running_requests=60, max_running_requests=64, max_waiting_requests=256, serving=True
        )
    )
    queue_on(state, 4, router_pb2.TIER_ENTERPRISE)  # a burst that the 4 free slots start at once
    assert state.queue_view().waiting == 0
    # Two of them started (a token came back): the slots they took are gone until the next report.
    [first, second, *_] = list(state.inflight)[-4:]
    state.progressed(first, 11)
    state.progressed(second, 11)
    queue_on(state, 1, router_pb2.TIER_ENTERPRISE)
    assert state.queue_view().waiting == 1
    # The next report counts those two among the running.
    state.report(
        engine_pb2.EngineLoad(
            running_requests=62, max_running_requests=64, max_waiting_requests=256, serving=True
        )
    )
    assert state.queue_view().waiting == 1
    queue_on(state, 3, router_pb2.TIER_FREE)  # queued behind the enterprise one (higher tiers start first)
    view = state.queue_view()
    assert view.waiting == 4 and view.ahead == (4, 1, 1)
    # Requests that reached the engine between two steps wait there, but only for the next step: the
    # slots they will take are not free (another router's one among them, here), but they are no queue.
    state.report(
        engine_pb2.EngineLoad(running_requests=56, max_running_requests=64, waiting_requests=7, serving=True)
    )
    assert state.queue_view().waiting == 0
    # An engine that blocks requests has no free slot, whatever it runs; one that does not say how many
    # it runs has none either.
    state.report(
        engine_pb2.EngineLoad(
            running_requests=1, max_running_requests=64, waiting_requests=7, blocked_requests=1, serving=True
        )
    )
    assert state.queue_view().waiting == 7
    state.report(engine_pb2.EngineLoad(running_requests=1, serving=True))
    assert state.queue_view().waiting == 6  # all of this router's requests not started


def test_free_is_shed_by_predicted_wait_long_before_the_queue_is_deep():
    clock = Clock()
    registry = Registry(measured_engine("a1", clock))
    queue_on(registry.engines()[0], 8, router_pb2.TIER_FREE)  # 9 / 4 per s = 2.25 s > free's 2 s
    chooser = placer(registry)
    err = refused(chooser, tier=router_pb2.TIER_FREE)
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.retry_after_s == pytest.approx(0.5)  # 0.3 s until it fits, at least 0.5 s
    # Paid tiers wait behind none of the free requests.
    assert place(chooser, tier=router_pb2.TIER_PRO) == "a1"
    # The count rule alone would take it (8 < 128), and so does a failover: its stream has started.
    assert place(placer(registry, admission="count"), tier=router_pb2.TIER_FREE) == "a1"
    assert place(chooser, tier=router_pb2.TIER_FREE, admit=False) == "a1"


def test_objectives_are_settings_per_tier():
    clock = Clock()
    registry = Registry(measured_engine("a1", clock))
    queue_on(registry.engines()[0], 8, router_pb2.TIER_FREE)
    looser = {"free": 3.0, "pro": 1.0, "enterprise": 0.5}
    assert place(placer(registry, ttft_objective_s=looser), tier=router_pb2.TIER_FREE) == "a1"
    with pytest.raises(ValueError, match="TTFT objectives"):
        RouterConfig(ttft_objective_s={"free": 0.0, "pro": 1.0, "enterprise": 0.5})
    with pytest.raises(ValueError, match="admission"):
        RouterConfig(admission="depth")


def test_a_free_request_too_slow_for_its_pool_is_degraded_where_its_wait_fits():
    clock = Clock()
    primary, lite = measured_engine("a1", clock), measured_engine("lite1", clock)
    lite.info = engine_pb2.GetModelInfoResponse(
        model="small-lite", tokenizer_fingerprint="tok-a", block_size=16, block_hash_seed=BLOCK_HASH_SEED
    )
    registry = Registry(primary, lite)
    queue_on(primary, 8, router_pb2.TIER_FREE)  # 9 / 4 = 2.25 s: too long
    queue_on(lite, 6, router_pb2.TIER_FREE)  # 7 / 4 = 1.75 s: fits 2 s less its 50 ms first token
    chooser = placer(registry, degrade=(("small", "small-lite"),))
    assert place(chooser, model="small") == "lite1"
    queue_on(lite, 1, router_pb2.TIER_FREE)
    assert refused(chooser, model="small").code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_new_chats_sharing_a_cached_prefix_spread_over_engines_by_the_sessions_they_hold():
    """The router benchmark's long chats: one engine holds the shared system prompt, and without the
    session term every new chat followed it while another engine stayed idle."""
    engines = [engine(f"e{i}") for i in range(4)]
    registry = Registry(*engines)
    registry.index.store("e0", block_hashes(PROMPT, 16))  # the shared prompt, cached on e0 only
    chooser = placer(registry, weights=CostWeights(session=256))
    placed = [
        place(chooser, tier=router_pb2.TIER_PRO, session_id=f"chat-{i}", opens_session=True) for i in range(8)
    ]
    assert sorted(placed) == ["e0", "e0", "e1", "e1", "e2", "e2", "e3", "e3"]
    assert [e.sessions for e in engines] == [2, 2, 2, 2]
    # A later turn of a chat is not a new session: its cached prefix wins whatever e0 holds.
    assert all(place(chooser, tier=router_pb2.TIER_PRO, session_id=f"chat-{i}") == "e0" for i in range(8))
    assert [e.sessions for e in engines] == [8, 0, 0, 0]
    # Without the session term (the default) the new chats all follow the prefix.
    old = placer(Registry(*[engine(f"f{i}") for i in range(4)]))
    old.registry.index.store("f0", block_hashes(PROMPT, 16))
    assert {place(old, session_id=f"chat-{i}", opens_session=True) for i in range(8)} == {"f0"}


def test_a_session_is_held_where_its_latest_request_went_until_it_has_been_idle_too_long():
    now = [0.0]
    engines = [engine("a"), engine("b")]
    registry = Registry(*engines)
    chooser = Placer(
        registry,
        RouterConfig(session_idle_s=60, weights=CostWeights(session=256)),
        RouterMetrics(CollectorRegistry()),
        random.Random(0),
        clock=lambda: now[0],
    )
    first = place(chooser, session_id="s1", opens_session=True)
    other = "b" if first == "a" else "a"
    held = {e.engine_id: e for e in engines}
    assert (held[first].sessions, held[other].sessions) == (1, 0)
    assert registry.loads.sessions[registry.index.slot(first)] == 1  # placement reads the column
    assert place(chooser, session_id="s2", opens_session=True) == other  # the emptier engine
    now[0] = 30.0
    place(chooser, session_id="s1", exclude={first})  # a failover moves the session with it
    assert (held[first].sessions, held[other].sessions) == (0, 2)
    now[0] = 61.0  # s2 placed at 0 expires; s1 was placed again at 30
    place(chooser, session_id="s3", opens_session=True)
    assert held[first].sessions + held[other].sessions == 2  # s1 and s3
    now[0] = 200.0
    place(chooser, session_id="", opens_session=True)  # no session: nothing is held for it
    assert held[first].sessions + held[other].sessions == 0


class AdmissionFirst(Placer):
    """Placement the long way only: admission over every engine, then the policy among those admitted."""

    def _pick_if_admitted(self, *args: object) -> None:
        return None


def random_fleet(seed: int) -> Registry:
    """Eight engines with random queues, drain rates, foreign load and cached prefixes of PROMPT."""
    rng = random.Random(seed)
    engines = []
    for i in range(8):
        clock = Clock()
        state = measured_engine(f"e{i}", clock, finishes_per_s=rng.choice([0.5, 2.0, 10.0]))
        state.report(
            engine_pb2.EngineLoad(
                waiting_requests=(waiting := rng.choice([0, 0, 1, 4, 12])),
                blocked_requests=waiting,
                max_waiting_requests=rng.choice([8, 256]),
                kv_blocks_used=rng.randrange(60),
                serving=True,
            )
        )
        engines.append(state)
    registry = Registry(*engines)
    for state in engines:
        registry.index.store(state.engine_id, block_hashes(PROMPT, 16)[: rng.randrange(7)])
    return registry


@pytest.mark.parametrize("policy", ["kv_aware", "oracle"])
def test_the_pick_asked_of_admission_alone_is_the_pick_among_the_admitted_engines(policy):
    for seed in range(60):
        quick, slow = random_fleet(seed), random_fleet(seed)
        chooser = Placer(quick, RouterConfig(policy=policy), RouterMetrics(CollectorRegistry()))
        reference = AdmissionFirst(slow, RouterConfig(policy=policy), RouterMetrics(CollectorRegistry()))
        for n, tier in enumerate([router_pb2.TIER_FREE, router_pb2.TIER_PRO, router_pb2.TIER_ENTERPRISE] * 3):
            plan = dict(tier=tier, session_id=f"s{seed}-{n}", opens_session=n % 2 == 0)
            try:
                expected = place(reference, **plan)
            except ServiceError as refused:
                assert refused.code == refused_code(chooser, **plan), f"seed {seed}"
                continue
            assert place(chooser, **plan) == expected, f"seed {seed}, request {n}"


def refused_code(chooser: Placer, **plan) -> grpc.StatusCode:
    return refused(chooser, **plan).code


def stepping_report(running: int = 0, prefill: int = 0, token_s: float = 0.002) -> engine_pb2.EngineLoad:
    """An engine that queues nothing and steps at 10 ms + ``token_s`` a token, 512 tokens a step at most."""
    return engine_pb2.EngineLoad(
        running_requests=running,
        max_running_requests=64,
        max_waiting_requests=256,
        serving=True,
        prefill_tokens=prefill,
        max_batched_tokens=512,
        step_fixed_s=0.01,
        step_token_s=token_s,
    )


def test_engine_state_counts_the_prompt_tokens_its_requests_still_have_to_prefill_by_tier():
    clock = Clock()
    state = measured_engine("a1", clock)
    state.report(stepping_report(running=3, prefill=700))  # another router's 700 tokens pending there
    assert state.step_model().prefill_ahead == (700, 700, 700)
    state.dispatched("free", 500, tier_of_proto(router_pb2.TIER_FREE).rank, cached_tokens=450)
    state.dispatched("pro", 480, tier_of_proto(router_pb2.TIER_PRO).rank, cached_tokens=448)
    model = state.step_model()
    # A free request waits for both, a pro one for the pro one, enterprise only for the foreign tokens.
    assert model.prefill_ahead == (700 + 50 + 32, 700 + 32, 700) and model.prefill_pending == 782
    assert model.decoding == 3 + 2  # the running ones, and these two once their prefill is done
    # The next report counts them in the engine's pending tokens: they are not foreign.
    state.report(stepping_report(running=3, prefill=782))
    assert state.step_model().prefill_ahead == (782, 732, 700)
    state.progressed("pro", 481)  # its first token: its prefill is done
    state.ended("free", completed=False)  # refused or cancelled before its first token
    assert state.step_model().prefill_ahead == (700, 700, 700)
    # An engine that reports no step time has no step model: admission counts its queue.
    state.report(engine_pb2.EngineLoad(running_requests=3, max_waiting_requests=256, serving=True))
    assert state.step_model() is None


def test_an_engine_that_queues_nothing_refuses_at_once_what_its_steps_cannot_start_in_time():
    clock = Clock()
    state = measured_engine("a1", clock)
    registry = Registry(state)
    state.report(stepping_report(running=20, token_s=0.0005))  # a full step: 0.266 s
    chooser = placer(registry)
    pro = router_pb2.TIER_PRO
    assert place(chooser, tier=pro) == "a1"
    # 2,000 pro prompt tokens pending there, nothing queued: a pro request's 100 tokens are the fifth
    # step after the one in progress (~1.4 s), past its 1 s objective.
    state.dispatched("long", 2_000, tier_of_proto(pro).rank)
    assert state.queue_view().waiting == 0
    err = refused(chooser, tier=pro)
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.retry_after_s >= 0.5
    # Enterprise waits for none of it but the step in progress (0.27 + 0.07 s); free waits for it too.
    assert place(chooser, tier=router_pb2.TIER_ENTERPRISE) == "a1"
    assert refused(chooser, tier=router_pb2.TIER_FREE).code == grpc.StatusCode.RESOURCE_EXHAUSTED
    # Under the count rule the same engine takes everything.
    assert place(placer(registry, admission="count"), tier=pro) == "a1"


def test_engine_state_learns_how_much_later_than_predicted_first_tokens_come():
    clock = Clock()
    state = measured_engine("a1", clock)
    state.report(stepping_report())
    assert state.step_model().margin_s == 0.0
    for i in range(10):  # predicted 10 + 2 x 41 ms = 92 ms on an idle engine; each comes 300 ms later
        state.report(stepping_report())
        state.dispatched(f"late-{i}", 41, tier_of_proto(router_pb2.TIER_PRO).rank)
        clock.now += 0.092 + 0.3
        state.progressed(f"late-{i}", 42)
        state.ended(f"late-{i}", completed=True)
    assert state.step_model().margin_s == pytest.approx(0.3)
    # The queue limit leaves room for it too: its own prefill after starting, and the margin.
    state.report(stepping_report())
    assert state.start_to_first_token_s(41) == pytest.approx(0.092 + 0.3)
