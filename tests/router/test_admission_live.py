"""Tiers against a real engine with a tiny queue: free is shed first, premium while there is headroom,
and the tier reaches the engine's scheduler as a priority."""

import grpc
import pytest

from chatmesh.engine.v1 import engine_pb2, engine_pb2_grpc
from chatmesh.errors import ServiceError
from chatmesh.router.v1 import router_pb2, router_pb2_grpc
from chatmesh.tokenizer import ChatMessage
from tests.engine.service_client import wait_until
from tests.router.router_client import Stream, generate, start_frame

MAX_RUNNING, MAX_WAITING = 2, 4  # the router's safe depth for the free tier: 2 queued
FREE, PRO, ENTERPRISE = router_pb2.TIER_FREE, router_pb2.TIER_PRO, router_pb2.TIER_ENTERPRISE
LONG = 4000  # tokens: at 20 tokens/s nothing finishes during a test


@pytest.fixture(scope="module")
def small(start_engines, start_router):
    [engine] = start_engines(
        1,
        "null",
        null_tokens_per_s=20,
        max_running_requests=MAX_RUNNING,
        max_waiting_requests=MAX_WAITING,
    )
    return start_router([engine], free_queue_fraction=0.5)


@pytest.fixture
async def stubs(small):
    async with (
        grpc.aio.insecure_channel(small.address) as router_channel,
        grpc.aio.insecure_channel(small.engines[0].address) as engine_channel,
    ):
        yield (
            router_pb2_grpc.RouterServiceStub(router_channel),
            engine_pb2_grpc.EngineServiceStub(engine_channel),
        )


@pytest.fixture
def streams():
    """Streams the test opens; all cancelled at the end."""
    opened: list[Stream] = []
    yield opened
    for stream in opened:
        stream.drop()


async def load(engine) -> engine_pb2.EngineLoad:
    return (await engine.GetLoad(engine_pb2.GetLoadRequest(), timeout=10)).load


async def open_stream(router, streams, tok, tier: int, tag: str) -> Stream:
    prompt = tok.encode_chat([ChatMessage("user", f"Request {tag}.")])
    stream = Stream.start(router, start_frame(prompt, max_tokens=LONG, tier=tier))
    streams.append(stream)
    await stream.until("routed")
    return stream


async def test_enterprise_displaces_free_work_in_the_engine_while_free_waits(stubs, streams, tok):
    router, _ = stubs
    for i in range(MAX_RUNNING):
        await (await open_stream(router, streams, tok, FREE, f"running-{i}")).until("tokens")
    queued_free = await open_stream(router, streams, tok, FREE, "queued-free")
    enterprise = await open_stream(router, streams, tok, ENTERPRISE, "enterprise")
    await enterprise.until("tokens")  # HIGH went past the queued LOW one and displaced a running LOW one
    queued_free.send_cancel()
    outcome = await queued_free.rest()
    assert outcome.finished.finish_reason == engine_pb2.FINISH_REASON_CANCELLED
    assert outcome.token_ids == [], "the free request was still queued behind the enterprise one"


async def test_overload_sheds_free_first_then_premium_when_no_engine_has_headroom(stubs, streams, tok):
    router, engine = stubs
    await wait_until(lambda: _idle(engine), what="the engine to be idle")
    for i in range(MAX_RUNNING):
        await (await open_stream(router, streams, tok, PRO, f"running-{i}")).until("tokens")
    for i in range(MAX_WAITING // 2):
        await open_stream(router, streams, tok, PRO, f"queued-{i}")
    prompt = tok.encode_chat([ChatMessage("user", "Am I in?")])
    # The queue is at the free tier's safe depth: free is shed, with a retry delay.
    with pytest.raises(ServiceError) as err:
        await generate(router, start_frame(prompt, tier=FREE))
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "free tier" in err.value.message
    assert 0.5 <= err.value.retry_after_s <= 30
    # ... while paid tiers still get in, up to the engine's own bound.
    for i in range(MAX_WAITING - MAX_WAITING // 2):
        await open_stream(router, streams, tok, PRO, f"premium-{i}")
    await wait_until(lambda: _waiting(engine, MAX_WAITING), what="the engine queue to fill")
    with pytest.raises(ServiceError) as err:
        await generate(router, start_frame(prompt, tier=ENTERPRISE))
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.retry_after_s is not None


async def _idle(engine) -> bool:
    current = await load(engine)
    return current.running_requests == 0 and current.waiting_requests == 0


async def _waiting(engine, count: int) -> bool:
    return (await load(engine)).waiting_requests == count
