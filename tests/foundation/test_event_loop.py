"""Every service runs on uvloop unless CHATMESH_EVENT_LOOP says asyncio, and gRPC serves on either."""

import asyncio
import gc
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import uvloop
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

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


def _busy(seconds: float) -> None:
    """Keeps the calling thread computing: a loop on it runs nothing else meanwhile."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def test_the_lag_is_how_late_the_loop_ran_a_timer_while_its_thread_was_busy():
    lags: list[float] = []
    watcher = asyncio.create_task(event_loop.watch_lag(lags.append, every_s=0.05))
    await asyncio.sleep(0.2)
    idle = len(lags)
    _busy(0.4)
    await asyncio.sleep(0.2)
    watcher.cancel()
    assert idle >= 2 and min(lags) >= 0
    # The timer came due within 0.05 s of the block's start and ran when it ended.
    assert 0.35 <= max(lags[idle:]) < 1.0
    assert max(lags[:idle]) < 0.35


async def _lag_watched_while_running() -> list[str]:
    await asyncio.sleep(2.5 * event_loop.LAG_SAMPLE_S)
    return [task.get_name() for task in asyncio.all_tasks()]


def test_services_export_their_loops_lag():
    samples = "chatmesh_event_loop_lag_seconds_count"
    before = REGISTRY.get_sample_value(samples) or 0
    with ThreadPoolExecutor(1) as thread:
        tasks = thread.submit(lambda: event_loop.run(_lag_watched_while_running())).result()
    assert "event-loop-lag" in tasks
    assert REGISTRY.get_sample_value(samples) >= before + 2


def test_services_time_each_pass_of_the_collector_by_generation():
    full_passes = "chatmesh_event_loop_gc_pause_seconds_count"
    before = REGISTRY.get_sample_value(full_passes, {"generation": "2"}) or 0
    with ThreadPoolExecutor(1) as thread:
        thread.submit(lambda: event_loop.run(_collected())).result()
    after = REGISTRY.get_sample_value(full_passes, {"generation": "2"})
    assert after >= before + 1  # the run's own pass, and any the collector started by itself meanwhile
    assert REGISTRY.get_sample_value("chatmesh_event_loop_gc_pause_seconds_sum", {"generation": "2"}) > 0
    # Outside a service's run the collector is no longer timed.
    gc.collect(2)
    assert REGISTRY.get_sample_value(full_passes, {"generation": "2"}) == after


async def _collected() -> None:
    gc.collect(2)
