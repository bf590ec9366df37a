"""EngineService in this process, over a real gRPC socket: situations a test must steer step by step."""

import contextlib
from dataclasses import replace

import grpc
import pytest

from chatmesh.engine.v1 import engine_pb2, engine_pb2_grpc
from chatmesh.errors import ServiceError
from chatmesh.tokenizer import ChatMessage
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.loading import create_runner
from engine.request import EngineRequest, SamplingParams
from engine.service import EngineService
from meshkit.launcher import free_port
from meshkit.serving import start_grpc_server
from tests.engine.core_helpers import make_engine, prompt, released_pieces, tokenizer
from tests.engine.service_client import TIMEOUT_S, Stream, start_frame, wait_until

SERVICE = engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name


@contextlib.asynccontextmanager
async def served(engine: LLMEngine, start_thread: bool = True):
    """Serves ``engine`` on a free port; yields (stub, service, server handle)."""
    service = EngineService(engine)

    def add(server):
        engine_pb2_grpc.add_EngineServiceServicer_to_server(service, server)
        return [SERVICE]

    handle = await start_grpc_server(add, free_port())
    if start_thread:
        engine.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            yield engine_pb2_grpc.EngineServiceStub(channel), service, handle
    finally:
        engine.stop(timeout_s=5)
        await handle.server.stop(0)


def null_engine(**config) -> LLMEngine:
    tok = tokenizer()
    base = EngineConfig(backend="null", null_tokens_per_s=20, num_kv_blocks=1024)
    config = replace(base, **config)
    runner = create_runner("null", None, tok, null_tokens_per_s=config.null_tokens_per_s)
    return LLMEngine(config, runner, tok)


@pytest.fixture(scope="module")
def chat_prompt():
    return tokenizer().encode_chat([ChatMessage("user", "Hello!")])


async def test_a_full_queue_answers_resource_exhausted_with_a_retry_delay(chat_prompt):
    engine = null_engine(max_running_requests=1, max_waiting_requests=1)
    async with served(engine) as (stub, _, _):
        running = Stream.start(stub, start_frame("running", chat_prompt, max_tokens=2000))
        await running.read()
        await running.read()  # a token: it holds the one running slot
        queued = Stream.start(stub, start_frame("queued", chat_prompt, max_tokens=3))
        await queued.read()  # accepted, waiting for the slot
        with pytest.raises(ServiceError) as err:
            await Stream.start(stub, start_frame("refused", chat_prompt, max_tokens=3)).rest()
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "full" in err.value.message
        assert err.value.retry_after_s > 0
        running.send_cancel()
        assert (await running.rest()).finished.finish_reason == engine_pb2.FINISH_REASON_CANCELLED
        assert (await queued.rest()).finished.finish_reason == engine_pb2.FINISH_REASON_LENGTH


async def test_a_kv_events_subscriber_that_falls_behind_is_cut_off_to_resync():
    test = make_engine(kv_events_buffer=3)
    async with served(test.engine, start_thread=False) as (stub, _, _):
        events = stub.KvEvents(engine_pb2.KvEventsRequest(), timeout=TIMEOUT_S)
        assert (await events.read()).WhichOneof("kind") == "snapshot"
        # Without yielding to the event loop, the engine publishes more batches than the buffer holds.
        for i in range(6):
            test.engine.add_request(
                EngineRequest(f"r{i}", tuple(prompt(9, salt=i)), SamplingParams(max_tokens=1))
            )
            test.engine.step()
        assert test.engine.events.sequence_number >= 4
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while True:
                await events.read()
        assert err.value.code() == grpc.StatusCode.ABORTED
        assert "resubscribe" in err.value.details()


async def test_steps_a_reader_has_not_taken_arrive_merged_and_split_back_into_per_token_pieces(chat_prompt):
    # The null backend repeats " The quick brown fox jumps over the lazy dog. ..."
    engine = null_engine(null_tokens_per_s=0)
    async with served(engine, start_thread=False) as (stub, _, _):
        start = start_frame("merged", chat_prompt, max_tokens=40)
        start.sampling.stop.append("lazy dog")
        stream = Stream.start(stub, start)
        await stream.read()  # accepted: the request waits in the engine's inbox
        # Without yielding to the event loop, every step's output waits for one delivery: one frame.
        while engine.has_unfinished_requests():
            engine.step()
        outcome = await stream.rest()
    assert outcome.frames == 1 and len(outcome.token_ids) > 2
    assert outcome.finished.matched_stop == "lazy dog"
    assert outcome.pieces == released_pieces(tokenizer(), outcome.token_ids, ["lazy dog"])
    assert "".join(piece for _, piece in outcome.pieces) == outcome.text


async def test_a_failed_model_runner_ends_streams_unavailable_and_stops_serving(chat_prompt):
    test = make_engine()
    async with served(test.engine) as (stub, service, _):
        test.runner.fail_with = RuntimeError("device lost")
        with pytest.raises(ServiceError) as err:
            await Stream.start(stub, start_frame("doomed", chat_prompt, max_tokens=5)).rest()
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        assert "device lost" in err.value.message
        assert service.failed.is_set()
        load = (await stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT_S)).load
        assert not load.serving
        with pytest.raises(ServiceError) as err:
            await Stream.start(stub, start_frame("after", chat_prompt, max_tokens=5)).rest()
        assert err.value.code == grpc.StatusCode.UNAVAILABLE


async def test_drain_refuses_new_requests_and_ends_watch_streams(chat_prompt):
    engine = null_engine(null_tokens_per_s=0)
    async with served(engine) as (stub, service, _):
        watch = stub.WatchLoad(engine_pb2.WatchLoadRequest(interval_ms=1000), timeout=TIMEOUT_S)
        events = stub.KvEvents(engine_pb2.KvEventsRequest(), timeout=TIMEOUT_S)
        assert (await watch.read()).load.serving
        await events.read()
        await service.drain()
        assert not (await watch.read()).load.serving
        assert await watch.read() is grpc.aio.EOF, (
            "the watch ends right after the drain, not after its interval"
        )
        assert await events.read() is grpc.aio.EOF
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.KvEvents(engine_pb2.KvEventsRequest(), timeout=TIMEOUT_S).read()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(ServiceError) as err:
            await Stream.start(stub, start_frame("late", chat_prompt, max_tokens=5)).rest()
        assert err.value.code == grpc.StatusCode.UNAVAILABLE


async def test_many_concurrent_streams_on_the_null_backend_all_complete(chat_prompt):
    engine = null_engine(null_tokens_per_s=0, max_running_requests=128, max_batched_tokens=8192)
    async with served(engine) as (stub, _, _):
        streams = [Stream.start(stub, start_frame(f"s{i}", chat_prompt, max_tokens=50)) for i in range(200)]
        outcomes = [await s.rest() for s in streams]
        assert all(len(o.token_ids) == 50 for o in outcomes)
        assert all(o.finished.finish_reason == engine_pb2.FINISH_REASON_LENGTH for o in outcomes)
        await wait_until(lambda: _no_blocks_used(stub), what="every block back in the pool after 200 streams")


async def _no_blocks_used(stub) -> bool:
    load = (await stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT_S)).load
    return load.kv_blocks_used == 0 and load.running_requests == 0
