"""RouterService over real gRPC, in front of real ``python -m engine --backend null`` processes.

The null backend runs the whole engine core (KV block pool, prefix cache, KV events, scheduler), so
placement, the index and stream relaying are exercised for real; only the model's arithmetic is skipped.
"""

import asyncio
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from chatmesh.engine.v1 import engine_pb2, engine_pb2_grpc
from chatmesh.errors import ServiceError
from chatmesh.router.v1 import router_pb2
from chatmesh.tokenizer import ChatMessage
from tests.engine import service_client as engine_client
from tests.engine.service_client import wait_until
from tests.router.router_client import TIMEOUT_S, Stream, generate, list_engines, start_frame

SERVICE = router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name
BLOCK = 16


def chat(tok, system: str, *turns: str) -> list[int]:
    messages = [ChatMessage("system", system)]
    for i, text in enumerate(turns):
        messages.append(ChatMessage("user" if i % 2 == 0 else "assistant", text))
    return tok.encode_chat(messages)


async def engine_idle(stub: engine_pb2_grpc.EngineServiceStub) -> bool:
    load = (await stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT_S)).load
    return load.running_requests == 0 and load.waiting_requests == 0 and load.kv_blocks_used == 0


async def test_health_is_serving_and_reflection_lists_the_service(router):
    async with grpc.aio.insecure_channel(router.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", SERVICE):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=TIMEOUT_S)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        async for reply in reflect.ServerReflectionInfo(iter([request]), timeout=TIMEOUT_S):
            assert SERVICE in {s.name for s in reply.list_services_response.service}


async def test_stream_is_routed_then_contiguous_tokens_then_finished_with_usage(stub, tok, router):
    prompt = chat(tok, "You are terse.", "Name a colour.")
    outcome = await generate(stub, start_frame(prompt, max_tokens=24, tokenizer_fingerprint=tok.fingerprint))
    assert [r.attempt for r in outcome.routed] == [1]
    assert outcome.engine_id in {e.name for e in router.engines}
    assert len(outcome.token_ids) == 24
    assert outcome.text == tok.decode(outcome.token_ids)
    assert outcome.finished.finish_reason == engine_pb2.FINISH_REASON_LENGTH
    usage = outcome.finished.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), 24)


async def test_follow_up_turns_land_on_the_engine_holding_the_conversation(stub, tok, router):
    # No session ids: nothing but the KV index can steer a follow-up back to its conversation. New
    # conversations share no prefix, so on idle engines their ties are broken at random: with 6 of them,
    # all on one engine 1 run in 32 (a full run saw it); with 12, 1 in 2,048.
    conversations = {
        f"conv-{i}": [f"You are assistant number {i}. " * 12, f"Question {i}?"] for i in range(12)
    }
    placed: dict[str, str] = {}
    for turn in range(3):
        for name, history in conversations.items():
            prompt = chat(tok, *history)
            outcome = await generate(stub, start_frame(prompt, max_tokens=20))
            routed, usage = outcome.routed[0], outcome.finished.usage
            if turn == 0:
                placed[name] = routed.engine_id
            else:
                assert routed.engine_id == placed[name], f"{name} turn {turn} left its engine"
                # The router's prediction is the engine's actual hit: most of the conversation so far.
                assert routed.predicted_cached_tokens == usage.cached_prompt_tokens
                assert usage.cached_prompt_tokens >= len(prompt) - 4 * BLOCK
            history += [tok.decode(outcome.token_ids), f"And then {turn}?"]
    assert len(set(placed.values())) == 2, "new conversations spread over both engines"


async def test_load_dominates_when_the_engine_holding_the_prefix_is_saturated(
    stub, tok, router, engine_stubs
):
    prompt = chat(tok, "You answer questions about the weather. " * 8, "Will it rain?")
    home = (await generate(stub, start_frame(prompt, max_tokens=4))).engine_id
    again = (await generate(stub, start_frame(prompt, max_tokens=4))).routed[0]
    assert again.engine_id == home and again.predicted_cached_tokens > 0
    # Saturate `home` with work the router did not send it (as another router replica would).
    heavy = [
        direct_request(
            engine_stubs[home], f"heavy-{i}", chat(tok, f"Load {i}. " * 150, "Go."), max_tokens=4000
        )
        for i in range(4)
    ]
    try:
        await wait_until(lambda: _running(stub, home, at_least=4), what=f"{home} reports the heavy load")
        moved = (await generate(stub, start_frame(prompt, max_tokens=4))).routed[0]
        assert moved.engine_id != home, "a saturated engine must lose despite holding the prefix"
        assert moved.predicted_cached_tokens == 0
    finally:
        for request in heavy:
            request.drop()
    await wait_until(lambda: engine_idle(engine_stubs[home]), what="the heavy load to go away")


async def test_a_burst_on_a_hot_prefix_spreads_once_the_holders_load_outweighs_the_hit(stub, tok):
    # From healthy, idle engines, as the router sees them: an earlier test's requests still in its view
    # (a busy box delays load reports) could make the other engine look full, and keep the burst home.
    await wait_until(lambda: _router_sees_idle(stub), what="the router to see healthy, idle engines")
    system = "You summarise long documents for busy readers. " * 30
    home = (await generate(stub, start_frame(chat(tok, system, "Warm up."), max_tokens=2))).engine_id
    # Each request counts on its engine the moment it is placed, so a burst does not all pile onto
    # the engine holding the prefix before its load shows up.
    burst = await asyncio.gather(
        *(generate(stub, start_frame(chat(tok, system, f"Document {i}."), max_tokens=30)) for i in range(24))
    )
    after = await list_engines(stub)
    engines = [outcome.engine_id for outcome in burst]
    seen = {e.engine_id: (e.healthy, e.load.running_requests, e.inflight_requests) for e in after.values()}
    assert home in engines and len(set(engines)) == 2, (engines, "the router's view after it:", seen)


def direct_request(stub, request_id, prompt, max_tokens) -> engine_client.Stream:
    """A request straight to an engine, bypassing the router (drop it to end it)."""
    sampling = engine_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    start = engine_pb2.GenerateStart(request_id=request_id, prompt_token_ids=prompt, sampling=sampling)
    return engine_client.Stream.start(stub, start)


async def _router_sees_idle(stub) -> bool:
    engines = await list_engines(stub)
    return all(
        e.healthy
        and e.inflight_requests == 0
        and e.load.running_requests == 0
        and e.load.waiting_requests == 0
        for e in engines.values()
    )


async def _running(stub, engine_id: str, at_least: int) -> bool:
    engines = await list_engines(stub)
    return engines[engine_id].load.running_requests >= at_least


async def test_cancel_frame_ends_the_stream_and_frees_the_engines_blocks(stub, tok, engine_stubs):
    stream = Stream.start(stub, start_frame(chat(tok, "Count slowly.", "Go."), max_tokens=4000))
    engine_id = (await stream.until("routed")).routed.engine_id
    await stream.until("tokens")
    stream.send_cancel()
    outcome = await stream.rest()
    assert outcome.finished.finish_reason == engine_pb2.FINISH_REASON_CANCELLED
    assert 0 < outcome.finished.usage.completion_tokens == len(outcome.token_ids) < 4000
    await wait_until(
        lambda: engine_idle(engine_stubs[engine_id]), what="the cancelled request's blocks freed"
    )


async def test_unknown_model_is_not_found_and_a_foreign_tokenizer_is_refused(stub, tok):
    prompt = chat(tok, "x", "y")
    with pytest.raises(ServiceError) as err:
        await generate(stub, start_frame(prompt, model="llama-405b"))
    assert err.value.code == grpc.StatusCode.NOT_FOUND
    assert "SmolLM2-135M-Instruct" in err.value.message
    with pytest.raises(ServiceError) as err:
        await generate(stub, start_frame(prompt, tokenizer_fingerprint="not-our-tokenizer"))
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    named = await generate(stub, start_frame(prompt, max_tokens=2, model=tok.model_name))
    assert len(named.token_ids) == 2


@pytest.mark.parametrize(
    ("start", "message"),
    [
        (router_pb2.GenerateStart(prompt_token_ids=[1, 2]), "request_id"),
        (router_pb2.GenerateStart(request_id="r"), "prompt_token_ids"),
        (router_pb2.GenerateStart(request_id="r", prompt_token_ids=[1]), "max_tokens"),
        (
            router_pb2.GenerateStart(
                request_id="r",
                prompt_token_ids=[1],
                sampling=engine_pb2.SamplingParams(max_tokens=2),
                resumed_output_token_ids=[5, 6, 7],
            ),
            "resumed_output_token_ids must not outnumber",
        ),
    ],
)
async def test_malformed_starts_are_invalid_arguments(stub, start, message):
    with pytest.raises(ServiceError) as err:
        await generate(stub, start)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.message


async def test_engine_refusals_are_relayed_without_failover(stub, tok):
    prompt = chat(tok, "x", "y")
    with pytest.raises(ServiceError) as err:
        await generate(stub, start_frame(prompt, max_tokens=100_000))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "context window" in err.value.message


async def test_a_live_request_id_cannot_be_reused(stub, tok):
    first = Stream.start(stub, start_frame(chat(tok, "x", "y"), max_tokens=4000, request_id="same-id"))
    await first.until("tokens")
    with pytest.raises(ServiceError) as err:
        await generate(stub, start_frame(chat(tok, "x", "y"), request_id="same-id"))
    assert err.value.code == grpc.StatusCode.ALREADY_EXISTS
    first.send_cancel()
    await first.rest()


async def test_list_engines_shows_model_health_load_and_index(stub, tok, router):
    await generate(stub, start_frame(chat(tok, "Index me. " * 20, "ok"), max_tokens=2))
    engines = await list_engines(stub)
    assert sorted(engines) == sorted(e.name for e in router.engines)
    for engine in router.engines:
        status = engines[engine.name]
        assert status.address == engine.address and status.healthy
        assert (status.model, status.backend) == (tok.model_name, "null")
        assert status.load.serving and status.load.kv_blocks_total > 0
    assert sum(status.indexed_blocks for status in engines.values()) > 0
    reply = await stub.ListEngines(router_pb2.ListEnginesRequest(model="other"), timeout=TIMEOUT_S)
    assert list(reply.engines) == []


async def test_metrics_count_decisions_and_predicted_and_actual_prefix_hits(stub, tok, router):
    prompt = chat(tok, "Metrics. " * 40, "Count me.")
    for _ in range(2):
        await generate(stub, start_frame(prompt, max_tokens=2))
    url = f"http://127.0.0.1:{router.metrics_port}/metrics"
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read().decode())
    samples = {
        line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line and line[0] != "#"
    }
    assert samples['chatmesh_router_decisions_total{policy="kv_aware"}'] >= 2
    assert samples["chatmesh_router_cached_tokens_total"] > 0
    assert samples["chatmesh_router_predicted_cached_tokens_total"] > 0
    assert samples["chatmesh_router_time_to_first_token_seconds_count"] >= 2
    for engine in router.engines:
        assert samples[f'chatmesh_router_engine_healthy{{engine="{engine.name}"}}'] == 1
