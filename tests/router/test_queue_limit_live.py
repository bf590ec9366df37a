"""A request admitted by predicted wait is not served after its TTFT objective: the router tells the
engine how long it may queue, and a request still queued unstarted then is refused, RESOURCE_EXHAUSTED
with a retry delay (a real router and a real paced null engine, over gRPC).

One engine runs one request at a time; a free request of 40 tokens at 20 tokens/s holds it for 2 s.
The free tier's objective is set to 1 s. A second free request sent meanwhile is admitted (the engine
has finished nothing yet, so no wait can be predicted), then waits behind the first: under the wait
rule it is refused about 1 s after it was sent; under the count rule it waits its turn (~2 s).
"""

import asyncio
import itertools
import time
import urllib.request

import grpc
import pytest

from chatmesh.errors import ServiceError
from chatmesh.router.v1 import router_pb2, router_pb2_grpc
from tests.router.router_client import Outcome, Stream, start_frame

OBJECTIVE_S, TOKENS, TOKENS_PER_S = 1.0, 40, 20.0  # the first request holds the engine 2 s
_serials = itertools.count()


@pytest.fixture(scope="module")
def one_slot(start_engines):
    return start_engines(1, "null", null_tokens_per_s=TOKENS_PER_S, max_running_requests=1)


def free() -> router_pb2.GenerateStart:
    return start_frame([1, 2, 3, 40 + next(_serials)], max_tokens=TOKENS, tier=router_pb2.TIER_FREE)


async def behind_a_running_request(address: str) -> tuple[float, Outcome, Outcome | ServiceError]:
    """Sends one free request, then, once it is running, another: (seconds until the second's first
    token or refusal, the first's outcome, the second's outcome or error)."""
    async with grpc.aio.insecure_channel(address) as channel:
        router = router_pb2_grpc.RouterServiceStub(channel)
        running = Stream.start(router, free())
        await running.until("tokens")
        sent = time.perf_counter()
        queued = Stream.start(router, free())
        await queued.until("routed")
        second: Outcome | ServiceError
        try:
            await queued.until("tokens")
            second = queued.outcome
        except ServiceError as error:
            second = error
        took = time.perf_counter() - sent
        first = await running.rest()
        if isinstance(second, Outcome):
            await queued.rest()
        return took, first, second


async def test_under_the_wait_rule_a_request_queued_past_its_objective_is_refused_at_the_objective(
    start_router, one_slot
):
    router = start_router(one_slot, ttft_objective_free_s=OBJECTIVE_S)
    took, first, second = await behind_a_running_request(router.address)
    assert isinstance(second, ServiceError), "served past its objective"
    assert second.code == grpc.StatusCode.RESOURCE_EXHAUSTED, second
    assert "free tier's time-to-first-token objective" in second.message
    delay = second.retry_after_s
    assert delay is not None and 0.5 <= delay <= 30
    # At the objective (less the engine's time to a first token), not when the slot freed (2 s).
    assert 0.5 * OBJECTIVE_S <= took <= 1.6 * OBJECTIVE_S, took
    assert len(first.token_ids) == TOKENS, "the running request is not disturbed"

    url = f"http://127.0.0.1:{router.metrics_port}/metrics"
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read().decode())
    assert 'chatmesh_router_queue_expired_requests_total{tier="free"} 1.0' in text
    # A refusal does not fail the engine: the next request is served.
    async with grpc.aio.insecure_channel(router.address) as channel:
        outcome = await Stream.start(router_pb2_grpc.RouterServiceStub(channel), free()).rest()
    assert len(outcome.token_ids) == TOKENS


async def test_under_the_count_rule_the_same_request_waits_its_turn(start_router, one_slot):
    router = start_router(one_slot, ttft_objective_free_s=OBJECTIVE_S, admission="count")
    took, first, second = await behind_a_running_request(router.address)
    assert isinstance(second, Outcome), second
    assert took > 1.5 * OBJECTIVE_S, "served after the running request, past the objective"
    assert len(first.token_ids) == TOKENS and len(second.token_ids) == TOKENS
