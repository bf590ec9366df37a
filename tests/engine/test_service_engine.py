"""EngineService over a real gRPC socket, against real ``python -m engine --backend null`` processes."""

import asyncio
import signal
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from chatmesh.block_hash import BLOCK_HASH_SEED, block_hashes
from chatmesh.engine.v1 import engine_pb2, engine_pb2_grpc
from chatmesh.errors import ServiceError
from chatmesh.tokenizer import ChatMessage, load_tokenizer
from tests.engine.core_helpers import released_pieces
from tests.engine.service_client import (
    TIMEOUT_S,
    Stream,
    capital_question,
    engine_stub,
    start_frame,
    wait_until,
)

SERVICE = engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def prompt(tok):
    return capital_question(tok)


@pytest.fixture
async def stub(null_engine):
    async with engine_stub(null_engine.address) as stub:
        yield stub


async def load(stub) -> engine_pb2.EngineLoad:
    return (await stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT_S)).load


async def idle(stub) -> bool:
    current = await load(stub)
    return current.running_requests == 0 and current.waiting_requests == 0 and current.kv_blocks_used == 0


async def test_model_info_advertises_the_model_and_the_cache_contract(stub, tok):
    info = await stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=TIMEOUT_S)
    assert info.model == "SmolLM2-135M-Instruct"
    assert info.tokenizer_fingerprint == tok.fingerprint
    assert (info.block_size, info.block_hash_seed) == (16, BLOCK_HASH_SEED)
    assert info.backend == "null" and info.tensor_parallel_size == 1
    assert info.context_length == 8192 and info.vocab_size == tok.vocab_size
    assert list(info.eos_token_ids) == list(tok.eos_token_ids)
    assert len(info.engine_instance_id) == 32 and info.kv_blocks_total > 0


async def test_health_is_serving(null_engine):
    async with grpc.aio.insecure_channel(null_engine.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", SERVICE):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=TIMEOUT_S)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            # Watch too (gRPC's client-side health checking uses it): it failed UNKNOWN under tracing.
            watch = health.Watch(health_pb2.HealthCheckRequest(service=name), timeout=TIMEOUT_S)
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()


async def test_generate_answers_accepted_then_contiguous_tokens_then_one_finished(stub, tok, prompt):
    stream = Stream.start(stub, start_frame("gen-1", prompt, max_tokens=30))
    accepted = await stream.read()
    assert accepted.WhichOneof("kind") == "accepted"
    assert accepted.accepted.context_tokens == len(prompt)
    outcome = await stream.rest()
    assert outcome.first_index == 0 and len(outcome.token_ids) == 30
    assert outcome.finished.finish_reason == engine_pb2.FINISH_REASON_LENGTH
    assert outcome.finished.usage.prompt_tokens == len(prompt)
    assert outcome.finished.usage.completion_tokens == 30
    assert outcome.text == tok.decode(outcome.token_ids)


async def test_a_repeated_prompt_is_served_from_the_prefix_cache(stub, prompt):
    for request_id in ("cache-1", "cache-2"):
        outcome = await Stream.start(stub, start_frame(request_id, prompt, max_tokens=2)).rest()
    assert outcome.finished.usage.cached_prompt_tokens == (len(prompt) - 1) // 16 * 16 > 0
    current = await load(stub)
    assert current.prefix_hit_tokens > 0 and current.prefix_queried_tokens >= current.prefix_hit_tokens


BAD_REQUESTS = {
    "empty prompt": ({"prompt_token_ids": []}, grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids"),
    "max_tokens 0": ({"max_tokens": 0}, grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    "context overflow": ({"max_tokens": 8190}, grpc.StatusCode.INVALID_ARGUMENT, "context window"),
    "token beyond the vocabulary": (
        {"prompt_token_ids": [49152]},
        grpc.StatusCode.INVALID_ARGUMENT,
        "vocabulary",
    ),
    "temperature out of range": ({"temperature": 3.0}, grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    "empty request id": ({"request_id": ""}, grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
    "another model": ({"model": "llama-70b"}, grpc.StatusCode.FAILED_PRECONDITION, "llama-70b"),
    "another tokenizer": (
        {"tokenizer_fingerprint": "other:0123"},
        grpc.StatusCode.FAILED_PRECONDITION,
        "re-tokenize",
    ),
}


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=list(BAD_REQUESTS))
async def test_bad_requests_get_clear_statuses(stub, prompt, case):
    change, code, mentions = BAD_REQUESTS[case]
    start = start_frame("bad", prompt, max_tokens=change.pop("max_tokens", 8))
    if "temperature" in change:
        start.sampling.temperature = change.pop("temperature")
    for name, value in change.items():
        if name == "prompt_token_ids":
            del start.prompt_token_ids[:]
            start.prompt_token_ids.extend(value)
        else:
            setattr(start, name, value)
    with pytest.raises(ServiceError) as err:
        await Stream.start(stub, start).rest()
    assert err.value.code == code
    assert mentions in err.value.message


@pytest.mark.parametrize(
    ("knob", "value", "mentions"),
    [
        ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2]"),
        ("frequency_penalty", float("nan"), "frequency_penalty"),
        ("min_p", 1.5, "min_p"),
        ("top_logprobs", 21, "top_logprobs"),
        ("logit_bias", {49152: 1.0}, "beyond the vocabulary"),
        ("logit_bias", {5: 101.0}, "[-100, 100]"),
    ],
    ids=["presence", "frequency-nan", "min-p", "top-logprobs", "bias-token", "bias-value"],
)
async def test_bad_sampling_knobs_are_invalid_argument_naming_them(stub, prompt, knob, value, mentions):
    start = start_frame("bad-knob", prompt, max_tokens=4)
    if knob == "logit_bias":
        start.sampling.logit_bias.update(value)
    else:
        setattr(start.sampling, knob, value)
    with pytest.raises(ServiceError) as err:
        await Stream.start(stub, start).rest()
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert mentions in err.value.message


async def test_logprobs_come_per_token_with_the_tokens_bytes(stub, tok, prompt):
    start = start_frame("logprobs-1", prompt, max_tokens=12)
    start.sampling.logprobs, start.sampling.top_logprobs = True, 2
    outcome = await Stream.start(stub, start).rest()
    assert [lp.token_id for lp in outcome.logprobs] == outcome.token_ids
    assert all(len(lp.top) == 2 and lp.logprob <= 0.0 for lp in outcome.logprobs)
    spelled = b"".join(lp.token_bytes for lp in outcome.logprobs)
    assert spelled.decode("utf-8", errors="replace") == tok.decode(outcome.token_ids, skip_control=False)
    assert all(top.token_bytes == tok.token_bytes(top.token_id) for lp in outcome.logprobs for top in lp.top)
    plain = await Stream.start(stub, start_frame("logprobs-2", prompt, max_tokens=4)).rest()
    assert plain.logprobs == [], "none unless asked"


async def test_a_live_request_id_cannot_be_reused(stub, prompt):
    first = Stream.start(stub, start_frame("dup", prompt, max_tokens=2000))
    await first.read()
    with pytest.raises(ServiceError) as err:
        await Stream.start(stub, start_frame("dup", prompt, max_tokens=4)).rest()
    assert err.value.code == grpc.StatusCode.ALREADY_EXISTS
    first.send_cancel()
    assert (await first.rest()).finished.finish_reason == engine_pb2.FINISH_REASON_CANCELLED


async def test_a_cancel_frame_finishes_the_request_and_frees_its_blocks(stub, prompt):
    events = stub.KvEvents(engine_pb2.KvEventsRequest(), timeout=TIMEOUT_S)
    snapshot = (await events.read()).snapshot
    index = set(snapshot.block_hashes)

    stream = Stream.start(stub, start_frame("to-cancel", prompt, max_tokens=2000))
    await stream.read()  # accepted
    await stream.read()  # the first tokens: it is running and holds blocks
    assert (await load(stub)).kv_blocks_used > 0
    stream.send_cancel()
    outcome = await stream.rest()
    assert outcome.finished.finish_reason == engine_pb2.FINISH_REASON_CANCELLED
    assert outcome.finished.usage.completion_tokens >= 1
    await wait_until(lambda: idle(stub), what="the cancelled request's blocks back in the pool")

    # Events seen so far, replayed onto the snapshot, match what a fresh subscriber is told.
    fresh = stub.KvEvents(engine_pb2.KvEventsRequest(), timeout=TIMEOUT_S)
    fresh_snapshot = (await fresh.read()).snapshot
    last = snapshot.sequence_number
    while last < fresh_snapshot.sequence_number:
        batch = (await events.read()).batch
        assert batch.sequence_number == last + 1
        last = batch.sequence_number
        for event in batch.events:
            if event.WhichOneof("kind") == "stored":
                index.update(event.stored.block_hashes)
            else:
                index.difference_update(event.removed.block_hashes)
    assert index == set(fresh_snapshot.block_hashes)
    events.cancel()
    fresh.cancel()


async def test_stop_strings_end_the_stream_with_the_matched_stop(stub, tok, prompt):
    # The null backend repeats " The quick brown fox jumps over the lazy dog. ..."
    start = start_frame("stop", prompt, max_tokens=100)
    start.sampling.stop.append("lazy dog")
    outcome = await Stream.start(stub, start).rest()
    assert outcome.finished.finish_reason == engine_pb2.FINISH_REASON_STOP
    assert outcome.finished.matched_stop == "lazy dog"
    assert outcome.text.endswith("jumps over the ") and "lazy" not in outcome.text
    assert outcome.pieces == released_pieces(tok, outcome.token_ids, ["lazy dog"])


async def test_kv_events_start_with_a_snapshot_then_number_batches_by_one(stub, tok, null_engine):
    info = await stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=TIMEOUT_S)
    events = stub.KvEvents(engine_pb2.KvEventsRequest(), timeout=TIMEOUT_S)
    first = await events.read()
    assert first.WhichOneof("kind") == "snapshot"
    assert first.engine_instance_id == info.engine_instance_id
    index, last = set(first.snapshot.block_hashes), first.snapshot.sequence_number

    long_prompt = tok.encode_chat([ChatMessage("user", "Tell me about KV events. " * 12)])
    expected = block_hashes(long_prompt, 16)
    await Stream.start(stub, start_frame("events", long_prompt, max_tokens=3)).rest()
    while not set(expected) <= index:
        frame = await asyncio.wait_for(events.read(), TIMEOUT_S)
        assert frame.WhichOneof("kind") == "batch" and frame.engine_instance_id == info.engine_instance_id
        assert frame.batch.sequence_number == last + 1
        last = frame.batch.sequence_number
        for event in frame.batch.events:
            if event.WhichOneof("kind") == "stored":
                index.update(event.stored.block_hashes)
            else:
                index.difference_update(event.removed.block_hashes)
    events.cancel()


async def test_watch_load_reports_periodically_and_sees_running_requests(stub, prompt):
    watch = stub.WatchLoad(engine_pb2.WatchLoadRequest(interval_ms=20), timeout=TIMEOUT_S)
    first = await watch.read()
    assert first.load.serving and first.load.max_waiting_requests > 0
    stream = Stream.start(stub, start_frame("watched", prompt, max_tokens=2000))
    await stream.read()
    for _ in range(200):
        report = (await watch.read()).load
        if report.running_requests >= 1 and report.kv_blocks_used > 0:
            break
    else:
        raise AssertionError("no load report showed the running request")
    assert 0 < report.kv_usage <= 1
    stream.send_cancel()
    await stream.rest()
    watch.cancel()

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.WatchLoad(engine_pb2.WatchLoadRequest(interval_ms=5), timeout=TIMEOUT_S).read()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_prometheus_metrics_use_the_genai_names(stub, prompt, null_engine):
    await Stream.start(stub, start_frame("metrics", prompt, max_tokens=5)).rest()
    url = f"http://127.0.0.1:{null_engine.metrics_port}/metrics"
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read().decode())
    for name in (
        "gen_ai_server_time_to_first_token_seconds_count",
        "gen_ai_server_time_per_output_token_seconds_count",
        'gen_ai_server_request_duration_seconds_count{finish_reason="length"}',
        "chatmesh_engine_waiting_requests",
        "chatmesh_engine_running_requests",
        "chatmesh_engine_kv_cache_usage_ratio",
        "chatmesh_engine_prefix_cache_hit_ratio",
        "chatmesh_engine_preemptions_total",
        "chatmesh_engine_generated_tokens_total",
        "chatmesh_engine_prefill_pending_tokens",
        "chatmesh_engine_step_fixed_seconds",
        "chatmesh_engine_step_token_seconds",
    ):
        assert name in body, name
    ttft_count = next(
        line
        for line in body.splitlines()
        if line.startswith("gen_ai_server_time_to_first_token_seconds_count")
    )
    assert float(ttft_count.split()[-1]) >= 1


async def test_sigterm_drains_open_streams_refuses_new_ones_and_exits_cleanly(start_engines, prompt):
    [engine] = start_engines(1, "null", null_tokens_per_s=50, drain_grace_s=20)
    launcher = start_engines.launcher
    async with grpc.aio.insecure_channel(engine.address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        watch = stub.WatchLoad(engine_pb2.WatchLoadRequest(interval_ms=50), timeout=TIMEOUT_S)
        await watch.read()
        open_stream = Stream.start(stub, start_frame("draining", prompt, max_tokens=60))
        await open_stream.read()
        launcher.signal(engine.name, signal.SIGTERM)

        async def not_serving() -> bool:
            reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
            return reply.status == health_pb2.HealthCheckResponse.NOT_SERVING

        await wait_until(not_serving, what="health NOT_SERVING after SIGTERM")
        with pytest.raises(ServiceError) as err:
            await Stream.start(stub, start_frame("late", prompt, max_tokens=5)).rest()
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        # The watch stream ends with a last report saying the engine no longer serves.
        reports = []
        while (frame := await watch.read()) is not grpc.aio.EOF:
            reports.append(frame.load)
        assert reports and not reports[-1].serving
        outcome = await open_stream.rest()
        assert outcome.finished.finish_reason == engine_pb2.FINISH_REASON_LENGTH
        assert len(outcome.token_ids) == 60

    process = launcher.running[engine.name].process
    started = time.monotonic()
    assert await asyncio.to_thread(process.wait, 30) == 0
    assert time.monotonic() - started < 15, "the drain must not wait out the grace period once streams end"
    launcher.forget(engine.name)
    assert "step loop stopped" in launcher.log_tail(engine.name)
