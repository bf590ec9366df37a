"""A real ``python -m engine --tensor-parallel-size 2`` over gRPC: it serves the model, and a rank killed
mid-stream takes it down cleanly (health NOT_SERVING, the stream ends UNAVAILABLE) instead of hanging."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from chatmesh.engine.v1 import engine_pb2, engine_pb2_grpc
from chatmesh.errors import ServiceError
from engine.model.cpu_runner import CpuModelRunner
from tests.engine.paged_driver import PagedDriver
from tests.engine.service_client import TIMEOUT_S, Stream, start_frame, wait_until
from tests.fixtures.engines import EngineProcess
from tests.fixtures.model import require_native

DEADLINE_S = 10.0


@pytest.fixture(scope="module")
def tp_engine(start_engines) -> EngineProcess:
    """One engine for this module; the last test kills one of its ranks."""
    require_native()
    [engine] = start_engines(1, "cpu", tensor_parallel_size=2, threads=1, num_kv_blocks=256)
    return engine


@pytest.fixture(scope="module")
def prompt(chat_tokenizer) -> list[int]:
    return chat_tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])


def worker_ranks(engine_pid: int) -> list[int]:
    """The engine's multiprocessing children that are ranks (not multiprocessing's resource tracker)."""
    children = Path(f"/proc/{engine_pid}/task/{engine_pid}/children").read_text().split()
    return [int(pid) for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def any_alive(pids: list[int]) -> bool:
    return any(Path(f"/proc/{pid}").exists() for pid in pids)


async def test_an_engine_with_two_ranks_serves_the_greedy_answer_of_one_process(
    tp_engine, prompt, native_runner: CpuModelRunner, chat_tokenizer
):
    [expected] = PagedDriver(native_runner, 64).generate([prompt], 8, stop_ids=chat_tokenizer.eos_token_ids)
    async with grpc.aio.insecure_channel(tp_engine.address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        info = await stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=TIMEOUT_S)
        assert (info.backend, info.tensor_parallel_size) == ("cpu", 2)
        start = start_frame("tp-greedy", prompt, max_tokens=8)
        start.sampling.temperature = 0
        outcome = await Stream.start(stub, start).rest()
    assert outcome.token_ids == expected.tokens
    assert "Paris" in outcome.text


async def test_killing_a_rank_mid_stream_ends_the_stream_unavailable_and_health_not_serving(
    tp_engine, prompt, start_engines
):
    engine_pid = start_engines.launcher.running[tp_engine.name].pid
    [rank1] = worker_ranks(engine_pid)
    async with grpc.aio.insecure_channel(tp_engine.address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        start = start_frame("tp-victim", prompt, max_tokens=2000)
        start.sampling.ignore_eos = True
        stream = Stream.start(stub, start)
        await stream.read()  # accepted
        await stream.read()  # the first tokens: the ranks are stepping
        os.kill(rank1, signal.SIGKILL)

        with pytest.raises(ServiceError) as err:
            await asyncio.wait_for(stream.rest(), DEADLINE_S)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        assert "rank 1" in err.value.message

        async def not_serving() -> bool:
            reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
            return reply.status == health_pb2.HealthCheckResponse.NOT_SERVING

        await wait_until(not_serving, DEADLINE_S, "health NOT_SERVING after a rank died")
        with pytest.raises(ServiceError) as err:
            await Stream.start(stub, start_frame("tp-late", prompt, max_tokens=4)).rest()
        assert err.value.code == grpc.StatusCode.UNAVAILABLE


async def test_sigterm_to_the_process_group_drains_streams_and_stops_every_rank(start_engines, prompt):
    """Ctrl-C or a process-group SIGTERM reaches the ranks too: they must keep computing until rank 0,
    draining, has finished the open streams, and then exit with it."""
    require_native()
    [engine] = start_engines(1, "cpu", tensor_parallel_size=2, threads=1, num_kv_blocks=64, drain_grace_s=30)
    launcher = start_engines.launcher
    process = launcher.running[engine.name].process
    ranks = worker_ranks(process.pid)
    async with grpc.aio.insecure_channel(engine.address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        stream = Stream.start(stub, start_frame("tp-drained", prompt, max_tokens=24))
        await stream.read()  # accepted
        launcher.signal(engine.name, signal.SIGTERM)
        outcome = await asyncio.wait_for(stream.rest(), TIMEOUT_S)
    assert outcome.finished.finish_reason in (engine_pb2.FINISH_REASON_LENGTH, engine_pb2.FINISH_REASON_STOP)
    assert outcome.token_ids
    assert await asyncio.to_thread(process.wait, TIMEOUT_S) == 0
    launcher.forget(engine.name)

    async def ranks_gone() -> bool:
        return not any_alive(ranks)

    await wait_until(ranks_gone, DEADLINE_S, "the ranks to exit with their engine")
