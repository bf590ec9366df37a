"""Admission by predicted wait on a real-model engine: a burst of chat turns that the engine would take
(it runs 64 requests at once and queues none) but whose prefill it cannot finish within the tier's
objective is refused at once, and what is admitted gets its first token within the objective.

One SmolLM2 engine with one compute thread (issue 54, item 9). Every request is a chat turn of a
450-token system prompt, which the engine holds cached after a first request, and a question of its
own of 40 tokens. A burst of 24 pro turns (objective 1 s) sent at once: taken together, their prefill
and the steps that carry it take several seconds on one CPU thread, so the turns started last would
get their first token seconds late. The engine queues none of them (it has 64 running slots), so a
wait measured in queued requests admits them all; a wait measured in the engine's steps admits the
turns it can start within the objective and refuses the rest in milliseconds.
"""

import asyncio
import random
import time

import grpc
import pytest

from chatmesh.errors import ServiceError
from chatmesh.router.v1 import router_pb2, router_pb2_grpc
from chatmesh.tiers import TTFT_OBJECTIVES_S
from tests.router.router_client import Stream, start_frame

SYSTEM_TOKENS, QUESTION_TOKENS, ANSWER_TOKENS, BURST = 450, 40, 16, 24
OBJECTIVE_S = TTFT_OBJECTIVES_S["pro"]
# This box is shared and noisy: the bound separates a first token at the objective from one seconds
# after it, not milliseconds.
SLACK = 1.5


@pytest.fixture(scope="module")
def real_engine_router(start_engines, start_router):
    [engine] = start_engines(1, "cpu", threads=1)
    return start_router([engine])  # the default admission: by predicted wait


def turn(system: list[int], rng: random.Random) -> router_pb2.GenerateStart:
    question = [rng.randrange(1_000, 40_000) for _ in range(QUESTION_TOKENS)]
    return start_frame(system + question, max_tokens=ANSWER_TOKENS, tier=router_pb2.TIER_PRO)


async def one_turn(router, start: router_pb2.GenerateStart) -> tuple[str, float, ServiceError | None]:
    """("admitted", its TTFT), ("refused", how long the refusal took, the error) when the router
    refused it, or ("dropped", ...) when an engine did (the request was routed)."""
    sent = time.perf_counter()
    stream = Stream.start(router, start)
    try:
        await stream.until("tokens")
        ttft = time.perf_counter() - sent
        await stream.rest()
        return "admitted", ttft, None
    except ServiceError as error:
        return "dropped" if stream.outcome.routed else "refused", time.perf_counter() - sent, error


async def test_a_burst_whose_prefill_cannot_start_in_time_is_refused_at_once_and_the_rest_served_in_time(
    real_engine_router,
):
    rng = random.Random(54)
    system = [rng.randrange(1_000, 40_000) for _ in range(SYSTEM_TOKENS)]
    async with grpc.aio.insecure_channel(real_engine_router.address) as channel:
        router = router_pb2_grpc.RouterServiceStub(channel)
        # Warm: the system prompt cached, the engine's step time measured, one request at a time.
        for _ in range(3):
            kind, _, error = await one_turn(router, turn(system, rng))
            assert kind == "admitted", error
        await asyncio.sleep(0.5)  # a load report after the warm-up's last step
        outcomes = await asyncio.gather(*(one_turn(router, turn(system, rng)) for _ in range(BURST)))

    admitted = sorted(seconds for kind, seconds, _ in outcomes if kind == "admitted")
    refused = [(seconds, error) for kind, seconds, error in outcomes if kind == "refused"]
    assert admitted, "an engine with nothing to do takes at least the first turn"
    # What is admitted gets its first token about within the objective, not seconds after it.
    assert admitted[-1] <= SLACK * OBJECTIVE_S, admitted
    # The rest is refused at once by the router, as the tier's refusal with a retry delay: neither
    # served late nor left to the engine to drop at the objective.
    assert refused, f"all {BURST} admitted: {admitted}"
    assert len(admitted) + len(refused) == BURST, [(k, round(s, 2)) for k, s, _ in outcomes]
    for _, error in refused:
        assert error is not None and error.code == grpc.StatusCode.RESOURCE_EXHAUSTED, error
        assert "pro tier" in error.message
        delay = error.retry_after_s
        assert delay is not None and 0.5 <= delay <= 30
    # A decision, not a wait (generous: 24 streams at once on a busy 2-core box; a wait is ~1 s).
    refusal_times = sorted(seconds for seconds, _ in refused)
    assert refusal_times[len(refusal_times) // 2] < 0.5, refusal_times
