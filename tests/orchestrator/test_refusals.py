"""When the router refuses (shed under load, no engine), the caller gets its verdict and retry delay,
and nothing of the send is stored; memory_store errors become the statuses they name."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
import pytest
from grpc.aio import AioRpcError, Metadata

from chatmesh.chat.v1 import chat_pb2
from chatmesh.errors import ServiceError
from chatmesh.router.v1 import router_pb2, router_pb2_grpc
from memory_store.errors import InvalidArgument, NotFound, Unavailable
from orchestrator.errors import from_exception, from_rpc_error
from tests.fixtures.engines import EngineFactory
from tests.fixtures.orchestrator import ChatClient, MeshFactory, collect


def router_error(code: grpc.StatusCode, retry_after_s: float | None = None) -> AioRpcError:
    trailers = (
        Metadata(*ServiceError(code, "no", retry_after_s).trailer())
        if retry_after_s is not None
        else Metadata()
    )
    return AioRpcError(code, Metadata(), trailers, "no")


def test_the_routers_refusals_pass_through_with_their_retry_delay() -> None:
    shed = from_rpc_error(router_error(grpc.StatusCode.RESOURCE_EXHAUSTED, 2.5), "the router")
    assert (shed.code, shed.retry_after_s) == (grpc.StatusCode.RESOURCE_EXHAUSTED, 2.5)
    assert (
        from_rpc_error(router_error(grpc.StatusCode.UNAVAILABLE), "the router").code
        == grpc.StatusCode.UNAVAILABLE
    )
    assert (
        from_rpc_error(router_error(grpc.StatusCode.NOT_FOUND), "the router").code
        == grpc.StatusCode.NOT_FOUND
    )
    # Anything else the router says is its own failure: retry later, no internals shown.
    internal = from_rpc_error(router_error(grpc.StatusCode.INTERNAL), "the router")
    assert internal.code == grpc.StatusCode.UNAVAILABLE and internal.retry_after_s


def test_capacity_failures_keep_code_and_delay_but_not_the_routers_or_drivers_words() -> None:
    said = "the request failed on 2 engine(s): engine-0: UNAVAILABLE: ipv4:127.0.0.1:50061 refused"
    trailers = Metadata(*ServiceError(grpc.StatusCode.UNAVAILABLE, said).trailer())
    error = from_rpc_error(AioRpcError(grpc.StatusCode.UNAVAILABLE, Metadata(), trailers, said), "the router")
    assert (error.code, error.retry_after_s) == (grpc.StatusCode.UNAVAILABLE, 1.0)
    assert "engine-0" not in error.message and "127.0.0.1" not in error.message and "retry" in error.message
    assert said in (error.private or "")
    busy = from_rpc_error(router_error(grpc.StatusCode.RESOURCE_EXHAUSTED, 2.5), "the router")
    assert busy.retry_after_s == 2.5 and busy.message != "no"
    storage = from_exception(Unavailable("NoHostAvailable: 127.0.0.1:9042 timed out"))
    assert storage.code == grpc.StatusCode.UNAVAILABLE and storage.retry_after_s
    assert "127.0.0.1" not in storage.message and "127.0.0.1" in (storage.private or "")


def test_memory_store_errors_become_the_status_they_name() -> None:
    assert from_exception(NotFound("chat x not found")).code == grpc.StatusCode.NOT_FOUND
    assert from_exception(InvalidArgument("bad cursor")).message == "bad cursor"
    assert from_exception(Unavailable("slow")).code == grpc.StatusCode.UNAVAILABLE
    unexpected = from_exception(KeyError("secret internals"))
    assert unexpected.code == grpc.StatusCode.INTERNAL and "secret" not in unexpected.message
    assert "secret internals" in unexpected.private


async def until_no_healthy_engine(router: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with grpc.aio.insecure_channel(router) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        while any(
            e.healthy for e in (await stub.ListEngines(router_pb2.ListEnginesRequest(), timeout=5)).engines
        ):
            assert time.monotonic() < deadline, "the router still sees a healthy engine"
            await asyncio.sleep(0.1)


async def test_a_send_no_engine_can_serve_is_unavailable_and_stores_nothing(
    start_mesh: MeshFactory, start_engines: EngineFactory, connect: Callable[..., ChatClient]
) -> None:
    mesh = start_mesh(1, "null")
    client = connect(mesh.orchestrator.address)
    chat = await client.create_chat()
    start_engines.launcher.stop(mesh.engines[0].name)
    await until_no_healthy_engine(mesh.router_address)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await collect(client.send(chat.chat_id, "anyone there?"))
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    page = await client.call("ListMessages", chat_pb2.ListMessagesRequest(chat_id=chat.chat_id))
    assert list(page.messages) == []
    assert (
        await client.call("GetChat", chat_pb2.GetChatRequest(chat_id=chat.chat_id))
    ).chat.active_run_id == ""
