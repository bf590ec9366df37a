"""``python -m router`` as a process: with no engines at all, and with engines found through DNS."""

import grpc
import pytest

from chatmesh.errors import ServiceError
from chatmesh.router.v1 import router_pb2_grpc
from chatmesh.tokenizer import ChatMessage, load_tokenizer
from tests.fixtures.router import wait_for_engines
from tests.router.router_client import generate, list_engines, start_frame


async def test_without_engines_requests_get_a_clear_unavailable(start_router):
    router = start_router([])
    async with grpc.aio.insecure_channel(router.address) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        assert await list_engines(stub) == {}
        with pytest.raises(ServiceError) as err:
            await generate(stub, start_frame([1, 2, 3]))
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert "no engines are configured" in err.value.message and "--engine" in err.value.message


async def test_engines_found_through_dns_serve_requests(start_router, router):
    # `localhost` may also resolve to ::1, where nothing listens: that address just stays unhealthy.
    engine = router.engines[0]
    dns_router = start_router([], engine_dns=f"localhost:{engine.port}", dns_refresh_s=1)
    wait_for_engines(dns_router.address, 1)
    async with grpc.aio.insecure_channel(dns_router.address) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        engines = await list_engines(stub)
        assert engines[f"127.0.0.1:{engine.port}"].healthy
        tok = load_tokenizer()
        outcome = await generate(
            stub, start_frame(tok.encode_chat([ChatMessage("user", "Hi")]), max_tokens=3)
        )
    assert outcome.engine_id == f"127.0.0.1:{engine.port}" and len(outcome.token_ids) == 3
