"""Clients of the shared router (tests/fixtures/router.py) and of its engines, for the service tests."""

import grpc
import pytest

from chatmesh.engine.v1 import engine_pb2_grpc
from chatmesh.router.v1 import router_pb2_grpc
from chatmesh.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture
async def stub(router):
    async with grpc.aio.insecure_channel(router.address) as channel:
        yield router_pb2_grpc.RouterServiceStub(channel)


@pytest.fixture
async def engine_stubs(router):
    channels = {e.name: grpc.aio.insecure_channel(e.address) for e in router.engines}
    yield {name: engine_pb2_grpc.EngineServiceStub(channel) for name, channel in channels.items()}
    for channel in channels.values():
        await channel.close()
