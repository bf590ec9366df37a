"""The router's index follows a real engine's KV events: blocks enter when stored, leave when evicted.

The registry runs in this process (so the test can look into its index) and talks to a real
``python -m engine --backend null`` over gRPC; the engine's pool is tiny so that evictions happen.
"""

import contextlib

import grpc
import pytest
from prometheus_client import CollectorRegistry

from chatmesh.block_hash import block_hashes
from chatmesh.engine.v1 import engine_pb2, engine_pb2_grpc
from router.config import EngineAddress, RouterConfig
from router.metrics import RouterMetrics
from router.registry import EngineRegistry
from tests.engine.service_client import Stream, start_frame, wait_until

POOL_BLOCKS = 48
BLOCK = 16


@pytest.fixture(scope="module")
def tiny_engine(start_engines):
    [engine] = start_engines(1, "null", num_kv_blocks=POOL_BLOCKS, null_tokens_per_s=0)
    return engine


@contextlib.asynccontextmanager
async def watching(engine):
    """A registry following ``engine`` (as engine "tiny"), in this process."""
    config = RouterConfig(engines=(EngineAddress("tiny", engine.address),))
    registry = EngineRegistry(config, RouterMetrics(CollectorRegistry()))
    registry.start()
    try:
        await wait_until(_healthy(registry), what="the engine connected")
        yield registry
    finally:
        await registry.close()


@pytest.fixture
async def engine_stub(tiny_engine):
    async with grpc.aio.insecure_channel(tiny_engine.address) as channel:
        yield engine_pb2_grpc.EngineServiceStub(channel)


async def run(stub, request_id: str, prompt: list[int]) -> None:
    outcome = await Stream.start(stub, start_frame(request_id, prompt, max_tokens=1)).rest()
    assert outcome.finished.finish_reason == engine_pb2.FINISH_REASON_LENGTH


def prefix(index, prompt: list[int]) -> int:
    return index.match(block_hashes(prompt), ["tiny"])["tiny"]


async def test_stored_blocks_enter_the_index_and_evicted_ones_leave(tiny_engine, engine_stub):
    async with watching(tiny_engine) as registry:
        index = registry.index
        first = list(range(1000, 1000 + 20 * BLOCK + 3))  # 20 full blocks
        await run(engine_stub, "first", first)
        await wait_until(_holds(index, first, 20), what="the first prompt's blocks indexed")
        assert index.size("tiny") == 20

        # 47.5 blocks: the pool must evict every block of the first prompt to make room.
        second = list(range(5000, 5000 + 47 * BLOCK + 8))
        await run(engine_stub, "second", second)
        await wait_until(_holds(index, second, 47), what="the second prompt's blocks indexed")
        assert prefix(index, first) == 0
        assert index.size("tiny") <= POOL_BLOCKS


async def test_a_new_subscriber_learns_the_cache_from_the_engines_snapshot(tiny_engine, engine_stub):
    third = list(range(9000, 9000 + 10 * BLOCK + 1))
    await run(engine_stub, "third", third)  # before the registry exists: no event will tell it
    async with watching(tiny_engine) as registry:
        await wait_until(_holds(registry.index, third, 10), what="the snapshot indexed")


def _healthy(registry):
    async def check() -> bool:
        return all(engine.healthy for engine in registry.engines())

    return check


def _holds(index, prompt: list[int], blocks: int):
    async def check() -> bool:
        return prefix(index, prompt) == blocks

    return check
