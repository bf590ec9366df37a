"""Every gRPC server gets health, reflection, a clean drain, and retry hints on its errors."""

import asyncio
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from chatmesh.engine.v1 import engine_pb2, engine_pb2_grpc
from chatmesh.errors import ServiceError, abort, retry_after_s
from meshkit.launcher import free_port
from meshkit.serving import PortInUseError, start_grpc_server

SERVICE = engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name


class SlowLoad(engine_pb2_grpc.EngineServiceServicer):
    """Streams five load reports 100 ms apart, and sheds GetLoad with a retry hint."""

    async def WatchLoad(self, request, context):
        for i in range(5):
            yield engine_pb2.WatchLoadResponse(load=engine_pb2.EngineLoad(waiting_requests=i))
            await asyncio.sleep(0.1)

    async def GetLoad(self, request, context):
        await abort(context, ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", 1.5))


def add(server):
    engine_pb2_grpc.add_EngineServiceServicer_to_server(SlowLoad(), server)
    return [SERVICE]


async def test_health_and_reflection_are_served():
    handle = await start_grpc_server(add, free_port())
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for name in ("", SERVICE):
                reply = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            async for reply in stub.ServerReflectionInfo(iter([request]), timeout=5):
                names = {s.name for s in reply.list_services_response.service}
                break
            assert {SERVICE, "grpc.health.v1.Health"} <= names
    finally:
        await handle.server.stop(0)


@pytest.mark.parametrize("garbage", [b"\xff\xff\xff", b"\x0a\x03\xff\xfe\xfd"], ids=["corrupt", "not-utf8"])
async def test_a_request_that_is_not_its_message_is_invalid_argument(garbage: bytes):
    # grpcio alone ends such a call UNKNOWN, naming protobuf's DecodeError.
    handle = await start_grpc_server(add, free_port())
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            for method, call in (("Check", channel.unary_unary), ("Watch", channel.unary_stream)):
                rpc = call(
                    f"/grpc.health.v1.Health/{method}", request_serializer=bytes, response_deserializer=bytes
                )
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    reply = rpc(garbage, timeout=5)
                    if method == "Watch":
                        await reply.read()
                    else:
                        await reply
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
                assert "DecodeError" not in (refused.value.details() or "")
            health = health_pb2_grpc.HealthStub(channel)  # well-formed requests are untouched
            reply = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await handle.server.stop(0)


async def test_drain_finishes_open_streams_and_refuses_new_calls():
    handle = await start_grpc_server(add, free_port())
    async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        stream = stub.WatchLoad(engine_pb2.WatchLoadRequest(), timeout=10)
        first = await stream.read()
        drained = asyncio.create_task(handle.drain(grace_s=5, notice_s=0.3))
        await asyncio.sleep(0.05)
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
        rest = []
        while (msg := await stream.read()) is not grpc.aio.EOF:
            rest.append(msg)
        await drained
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=2)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert [m.load.waiting_requests for m in [first, *rest]] == [0, 1, 2, 3, 4]


async def test_error_carries_retry_delay():
    handle = await start_grpc_server(add, free_port())
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await engine_pb2_grpc.EngineServiceStub(channel).GetLoad(
                    engine_pb2.GetLoadRequest(), timeout=5
                )
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert err.value.details() == "queue full"
        assert retry_after_s(err.value) == pytest.approx(1.5)
    finally:
        await handle.server.stop(0)


async def test_second_server_on_a_taken_port_fails_clearly():
    handle = await start_grpc_server(add, free_port())
    try:
        with pytest.raises(PortInUseError, match=str(handle.port)):
            await start_grpc_server(add, handle.port)
    finally:
        await handle.server.stop(0)


def _burst(port: int, calls: int, ready: threading.Event, go: threading.Event, sent: threading.Event):
    """``calls`` health checks at once from a thread of their own: once connected it says ``ready``,
    waits for ``go``, sends them all and says ``sent``; the code each one ended with."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        grpc.channel_ready_future(channel).result(timeout=5)
        ready.set()
        go.wait(timeout=30)
        check = health_pb2_grpc.HealthStub(channel).Check
        futures = [check.future(health_pb2.HealthCheckRequest(), timeout=30) for _ in range(calls)]
        sent.set()
        return [future.code() for future in futures]


async def _codes_while_busy(options: dict, calls: int, busy_s: float) -> list[grpc.StatusCode]:
    """A server with ``options`` gets ``calls`` at once while its event loop is busy: from before the
    burst is sent until ``busy_s`` after it was."""
    handle = await start_grpc_server(add, free_port(), **options)
    try:
        ready, go, sent = threading.Event(), threading.Event(), threading.Event()
        burst = asyncio.ensure_future(asyncio.to_thread(_burst, handle.port, calls, ready, go, sent))
        assert await asyncio.to_thread(ready.wait, 30)  # connected (the server's loop takes part)
        # Busy on purpose from here (the loop blocks): the burst waits in gRPC. A fixed head start for the
        # thread once let a loaded machine send the burst after the busy spell was over.
        go.set()
        assert sent.wait(timeout=30)
        time.sleep(busy_s)  # noqa: ASYNC251
        codes = await burst
    finally:
        await handle.server.stop(0)
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.CANCELLED}
    return codes


@pytest.mark.parametrize(
    "options, shed", [({"max_pending_calls": 5}, True), ({}, False)], ids=["5", "default"]
)
async def test_calls_beyond_max_pending_calls_are_shed_while_the_service_is_busy(options, shed):
    """While the event loop is busy, new calls wait in gRPC until the service takes them. Past
    ``max_pending_calls`` gRPC sheds them with CANCELLED (with gRPC's default of 1,000 a burst of 2,000
    streams lost a few percent); the default holds a burst of 300 whole."""
    codes = await _codes_while_busy(options, 300, 1.0)
    assert (grpc.StatusCode.CANCELLED in codes) is shed


@pytest.mark.parametrize("options, shed", [({"max_pending_s": 1}, True), ({}, False)], ids=["1s", "default"])
async def test_a_call_not_taken_within_max_pending_s_is_shed(options, shed):
    """A call that waited longer than ``max_pending_s`` for the busy service is shed CANCELLED (gRPC
    sweeps them as new calls arrive). At 4,000 streams opened at once, the orchestrator's gRPC shed half
    of them after 30 s, its default."""
    codes = await _codes_while_busy(options, 2000, 3.0)
    assert (grpc.StatusCode.CANCELLED in codes) is shed
