"""Session hints with the real router code over real gRPC, in front of two real null engines: a chat's
second turn, arriving before the index heard of the first turn's blocks, goes back to the engine that
computed them (and is served from its cache there); without hints it goes to the idler engine.

The router runs in this process (``EngineRegistry`` + ``RouterService`` on a gRPC server on 127.0.0.1)
so the test can hold its index back: once the first turn's KV events have arrived, the test removes
those blocks from the index again, which is the index as it is during the events' lag. The engine that
ran the first turn is made the busier one by a long request sent to it directly (foreign load the
router learns from the engine's load reports), so load alone would send the second turn elsewhere.
"""

import contextlib

import grpc
import pytest
from prometheus_client import CollectorRegistry

from chatmesh.block_hash import block_hashes
from chatmesh.engine.v1 import engine_pb2
from chatmesh.router.v1 import router_pb2_grpc
from router.config import EngineAddress, RouterConfig
from router.metrics import RouterMetrics
from router.registry import EngineRegistry
from router.service import RouterService
from tests.engine import service_client
from tests.engine.service_client import wait_until
from tests.router.router_client import generate, start_frame

BLOCK = 16
ANSWER_TOKENS = 40


@pytest.fixture(scope="module")
def engines(start_engines):
    return start_engines(2, "null", null_tokens_per_s=200)


@contextlib.asynccontextmanager
async def in_process_router(engines, session_hints: int):
    config = RouterConfig(
        engines=tuple(EngineAddress(f"e{i}", e.address) for i, e in enumerate(engines)),
        session_hints=session_hints,
    )
    metrics = RouterMetrics(CollectorRegistry())
    registry = EngineRegistry(config, metrics)
    server = grpc.aio.server()
    router_pb2_grpc.add_RouterServiceServicer_to_server(RouterService(registry, config, metrics), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    registry.start()
    try:
        await wait_until(lambda: _all_healthy(registry), what="both engines connected")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield registry, router_pb2_grpc.RouterServiceStub(channel)
    finally:
        await server.stop(grace=None)
        await registry.close()


async def _all_healthy(registry: EngineRegistry) -> bool:
    return all(engine.healthy for engine in registry.engines())


@contextlib.asynccontextmanager
async def busy(engine_address: str, registry: EngineRegistry, engine_id: str, first_token: int):
    """A long request of another client on the engine, until the router sees its load."""
    async with service_client.engine_stub(engine_address) as stub:
        sampling = engine_pb2.SamplingParams(max_tokens=7000, ignore_eos=True)
        prompt = list(range(first_token, first_token + 25 * BLOCK))  # 25 blocks of context
        hog = service_client.Stream.start(
            stub, engine_pb2.GenerateStart(request_id="hog", prompt_token_ids=prompt, sampling=sampling)
        )
        state = next(e for e in registry.engines() if e.engine_id == engine_id)
        try:
            await wait_until(_loaded(state), what="the router saw the other client's load")
            yield
        finally:
            hog.send_cancel()
            await hog.rest()


def _loaded(state):
    async def check() -> bool:
        return state.decode_blocks() >= 25

    return check


@pytest.mark.parametrize("hints", [True, False], ids=["hints", "no-hints"])
async def test_a_second_turn_before_the_index_heard_goes_back_to_the_first_turns_engine(engines, hints):
    base = 20_000 if hints else 30_000  # each case its own tokens: the engines keep what they cached
    first = list(range(base, base + 100))
    session = f"chat-{base}"
    async with in_process_router(engines, session_hints=100 if hints else 0) as (registry, stub):
        one = await generate(stub, start_frame(first, ANSWER_TOKENS, session_id=session))
        ran = one.engine_id
        other = next(e.engine_id for e in registry.engines() if e.engine_id != ran)

        # The engine computed the prompt and every answer token but the last: 139 tokens, 8 blocks.
        computed = block_hashes(first + one.token_ids[:-1])
        assert len(computed) == 8

        async def heard() -> bool:
            return registry.index.match(computed, [ran])[ran] == len(computed)

        await wait_until(heard, what="the first turn's KV events")
        registry.index.remove(ran, computed)  # the index during the events' lag: nothing of this chat

        address = next(e.address for i, e in enumerate(engines) if f"e{i}" == ran)
        async with busy(address, registry, ran, base + 5000):
            second = first + one.token_ids + list(range(base + 200, base + 230))
            two = await generate(stub, start_frame(second, 8, session_id=session))

    usage = two.finished.usage
    if hints:
        assert two.engine_id == ran
        assert two.routed[0].predicted_cached_tokens == 8 * BLOCK
        assert usage.cached_prompt_tokens >= 8 * BLOCK  # the engine really had it
    else:
        assert two.engine_id == other  # the index saw nothing; load sent it to the idle engine
        assert usage.cached_prompt_tokens == 0
