"""Every service runs on uvloop unless CHATMESH_EVENT_LOOP says asyncio, and gRPC serves on either."""

import asyncio
import gc
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import uvloop
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshkit import event_loop
from meshkit.launcher import free_port
from meshkit.serving import start_grpc_server


async def _health_round_trip() -> tuple[type, int]:
    """A real server and client on the running loop: the loop's type and the health status."""
    handle = await start_grpc_server(lambda server: [], free_port())
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
    finally:
        await handle.server.stop(0)
    return type(asyncio.get_running_loop()), reply.status


def _run_in_a_thread_of_its_own() -> tuple[type, int]:
    """``event_loop.run`` as a service's main does, in a thread: asyncio.run leaves its thread with no
    current loop, which must not leak into the tests after this one."""
    with ThreadPoolExecutor(1) as thread:
        return thread.submit(lambda: event_loop.run(_health_round_trip())).result()


def test_services_serve_grpc_on_uvloop_by_default(monkeypatch):
    monkeypatch.delenv(event_loop.ENV, raising=False)
    loop_type, status = _run_in_a_thread_of_its_own()
    assert issubclass(loop_type, uvloop.Loop)
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_asyncio_loop_on_request(monkeypatch):
    monkeypatch.setenv(event_loop.ENV, "asyncio")
    loop_type, status = _run_in_a_thread_of_its_own()
    assert not issubclass(loop_type, uvloop.Loop)
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_an_unknown_loop_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(event_loop.ENV, "trio")
    with pytest.raises(SystemExit, match="CHATMESH_EVENT_LOOP='trio': expected one of uvloop, asyncio"):
        event_loop.chosen()


async def _collector_settings() -> tuple[tuple[int, int, int], int]:
    return gc.get_threshold(), gc.get_freeze_count()


def test_services_run_with_the_collector_tuned_for_a_server_and_leave_it_as_it_was():
    before = gc.get_threshold()
    with ThreadPoolExecutor(1) as thread:
        threshold, frozen = thread.submit(lambda: event_loop.run(_collector_settings())).result()
    assert threshold == (event_loop.YOUNG_GENERATION, *before[1:])
    assert frozen > 10_000, "the imports' objects are frozen out of every collection"
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
