"""EngineService.GenerateMany, many requests on one stream, over a real gRPC socket against real
``python -m engine --backend null`` processes: each request gets what it would get alone on a stream, a
step's tokens for all of them share a message, refusals end one request and not the stream, and the
stream's end frees whatever it still holds."""

import asyncio
import re
import signal
import urllib.request

import grpc
import pytest

from chatmesh.engine.v1 import engine_pb2
from chatmesh.errors import ServiceError, from_status
from tests.engine.service_client import (
    TIMEOUT_S,
    Outcome,
    Stream,
    capital_question,
    engine_stub,
    start_frame,
    wait_until,
)
from tests.engine.test_service_engine import idle
from tests.many_client import Many, draining


@pytest.fixture(scope="module")
def prompt():
    from chatmesh.tokenizer import load_tokenizer

    return capital_question(load_tokenizer())


@pytest.fixture
async def stub(null_engine):
    async with engine_stub(null_engine.address) as stub:
        yield stub


def start(request_id: str, prompt: list[int], max_tokens: int = 16, **fields) -> engine_pb2.RequestFrame:
    return engine_pb2.RequestFrame(
        request_id=request_id, start=start_frame(request_id, prompt, max_tokens=max_tokens, **fields)
    )


def cancel(request_id: str) -> engine_pb2.RequestFrame:
    return engine_pb2.RequestFrame(request_id=request_id, cancel=engine_pb2.GenerateCancel())


def open_many(stub, *frames: engine_pb2.RequestFrame) -> Many:
    return Many.open(stub, engine_pb2.GenerateManyRequest, Outcome, *frames, timeout_s=TIMEOUT_S)


async def test_requests_on_one_stream_each_get_the_answer_given_alone_and_a_step_serves_them_in_one_message(
    stub, prompt
):
    ids = [f"many-{i}" for i in range(8)]
    many = open_many(stub, *(start(request_id, prompt, max_tokens=24) for request_id in ids))
    await many.until_ended(*ids)
    alone = await Stream.start(stub, start_frame("alone", prompt, max_tokens=24)).rest()
    for request_id in ids:
        outcome = many.outcomes[request_id]
        assert outcome.first_index == 0 and outcome.token_ids == alone.token_ids
        assert outcome.text == alone.text and outcome.finished.usage.completion_tokens == 24
    # 8 requests x 24 tokens would be 208 messages with a message per frame (accepted, tokens, finished).
    assert max(len({f.request_id for f in m.frames}) for m in many.messages) == len(ids)
    assert len(many.messages) < 24 + 8
    many.half_close()
    assert await many.call.read() is grpc.aio.EOF  # half-closed with nothing left: the stream ends OK
    assert await many.call.code() == grpc.StatusCode.OK


async def test_a_refused_request_fails_alone_with_its_status_and_the_others_go_on(stub, prompt):
    many = open_many(
        stub,
        start("good", prompt, max_tokens=10),
        start("too-long", prompt, max_tokens=10**6),
        start("foreign", prompt, tokenizer_fingerprint="another-tokenizer"),
        engine_pb2.RequestFrame(request_id="mismatch", start=start_frame("other", prompt)),
    )
    await many.until(lambda: many.ended("good") and len(many.failed) == 3)
    assert many.outcomes["good"].finished.finish_reason == engine_pb2.FINISH_REASON_LENGTH
    too_long = from_status(many.failed["too-long"].status)
    assert too_long.code == grpc.StatusCode.INVALID_ARGUMENT and "context window" in too_long.message
    assert from_status(many.failed["foreign"].status).code == grpc.StatusCode.FAILED_PRECONDITION
    assert from_status(many.failed["mismatch"].status).code == grpc.StatusCode.INVALID_ARGUMENT
    # A second start for a request running on the stream is misuse: that request ends, INVALID_ARGUMENT.
    many.send(start("twice", prompt, max_tokens=4000))
    await many.until(lambda: "twice" in many.outcomes)
    many.send(start("twice", prompt, max_tokens=40))
    await many.until(lambda: "twice" in many.failed)
    assert from_status(many.failed["twice"].status).code == grpc.StatusCode.INVALID_ARGUMENT
    await wait_until(lambda: idle(stub), what="the misused request's blocks freed")
    many.half_close()


async def test_a_request_id_running_on_another_stream_is_refused_already_exists(stub, prompt):
    first = open_many(stub, start("taken", prompt, max_tokens=4000))
    await first.until(lambda: "taken" in first.outcomes)
    second = open_many(stub, start("taken", prompt, max_tokens=10))
    await second.until(lambda: "taken" in second.failed)
    assert from_status(second.failed["taken"].status).code == grpc.StatusCode.ALREADY_EXISTS
    first.send(cancel("taken"))
    await first.until_ended("taken")
    first.half_close()
    second.half_close()


async def test_a_cancel_frame_ends_its_request_only_and_frees_its_blocks(stub, prompt):
    many = open_many(stub, start("stays", prompt, max_tokens=120), start("goes", prompt, max_tokens=4000))
    await many.until(lambda: len(many.outcomes.get("goes", Outcome()).token_ids) >= 2)
    many.send(cancel("goes"), cancel("never-started"))
    await many.until_ended("goes")
    goes = many.outcomes["goes"]
    assert goes.finished.finish_reason == engine_pb2.FINISH_REASON_CANCELLED
    assert goes.finished.usage.completion_tokens == len(goes.token_ids) < 4000
    await many.until_ended("stays")
    assert len(many.outcomes["stays"].token_ids) == 120
    await wait_until(lambda: idle(stub), what="the cancelled request's blocks freed")
    many.half_close()


async def test_a_half_close_is_not_a_cancel(stub, prompt):
    many = open_many(stub, start("after-half-close", prompt, max_tokens=50))
    many.half_close()
    await many.until_ended("after-half-close")
    assert len(many.outcomes["after-half-close"].token_ids) == 50
    assert await many.call.read() is grpc.aio.EOF


async def test_cancelling_the_stream_cancels_every_request_on_it(stub, prompt):
    ids = [f"dropped-{i}" for i in range(4)]
    many = open_many(stub, *(start(request_id, prompt, max_tokens=4000) for request_id in ids))
    await many.until(lambda: all(request_id in many.outcomes for request_id in ids))
    many.call.cancel()
    await wait_until(lambda: idle(stub), what="every dropped request's blocks freed")


async def test_a_draining_engine_refuses_new_starts_finishes_the_rest_and_ends_the_stream(
    start_engines, prompt
):
    [engine] = start_engines(1, "null", null_tokens_per_s=100)
    launcher = start_engines.launcher
    async with engine_stub(engine.address) as stub:
        many = open_many(stub, start("running", prompt, max_tokens=300))  # 3 s: it outlasts the notice
        await many.until(lambda: len(many.outcomes.get("running", Outcome()).token_ids) >= 1)
        launcher.signal(engine.name, signal.SIGTERM)
        async with grpc.aio.insecure_channel(engine.address) as channel:
            await draining(channel)
        many.send(start("late", prompt, max_tokens=5))
        await many.until_ended("running", "late")
        assert len(many.outcomes["running"].token_ids) == 300
        assert from_status(many.failed["late"].status).code == grpc.StatusCode.UNAVAILABLE
        # Nothing is left on the stream: the draining engine ends it, although the client never half-closed.
        assert await many.call.read() is grpc.aio.EOF
        assert await many.call.code() == grpc.StatusCode.OK
    assert await asyncio.to_thread(launcher.running[engine.name].process.wait, 30) == 0
    launcher.forget(engine.name)


def constrained(
    request_id: str, prompt: list[int], structured: engine_pb2.StructuredOutput
) -> engine_pb2.GenerateStart:
    frame = start_frame(request_id, prompt, max_tokens=40)
    frame.sampling.structured.CopyFrom(structured)
    return frame


def constrained_frame(
    request_id: str, prompt: list[int], structured: engine_pb2.StructuredOutput
) -> engine_pb2.RequestFrame:
    return engine_pb2.RequestFrame(request_id=request_id, start=constrained(request_id, prompt, structured))


async def test_constrained_requests_share_a_stream_with_free_ones_and_one_that_does_not_compile_fails_alone(
    stub, prompt, null_engine
):
    """A constraint compiles in the service's compile threads (the first of each distinct one; later
    ones come from the cache) while the stream goes on; one that does not compile is refused,
    INVALID_ARGUMENT naming the problem, before the engine takes it; a request cancelled while its
    constraint compiles ends cancelled."""
    choice = engine_pb2.StructuredOutput(choice=engine_pb2.Choices(choices=["Paris", "Lyon"]))
    pattern = engine_pb2.StructuredOutput(regex="(yes|no)! [a-z]{3,5}")
    fresh = engine_pb2.StructuredOutput(regex=f"[a-c]{{{len(prompt)}}}")  # distinct from any cached one
    many = open_many(
        stub,
        constrained_frame("choice", prompt, choice),
        constrained_frame("regex", prompt, pattern),
        constrained_frame("broken", prompt, engine_pb2.StructuredOutput(regex="[a-")),
        start("free", prompt, max_tokens=10),
        constrained_frame("gone", prompt, fresh),
        cancel("gone"),
    )
    await many.until(
        lambda: all(many.ended(r) for r in ("choice", "regex", "free", "gone")) and "broken" in many.failed
    )
    assert many.outcomes["choice"].text in ("Paris", "Lyon")
    assert many.outcomes["choice"].finished.finish_reason == engine_pb2.FINISH_REASON_STOP
    assert re.fullmatch(r"(yes|no)! [a-z]{3,5}", many.outcomes["regex"].text)
    assert many.outcomes["free"].finished.finish_reason == engine_pb2.FINISH_REASON_LENGTH
    assert many.outcomes["gone"].finished.finish_reason == engine_pb2.FINISH_REASON_CANCELLED
    broken = from_status(many.failed["broken"].status)
    assert broken.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.structured" in broken.message and "unclosed character class" in broken.message
    assert "broken" not in many.outcomes, "refused before anything ran: not even accepted"
    await wait_until(lambda: idle(stub), what="every request's blocks freed")
    many.half_close()
    # A request alone on its stream takes the same constraints.
    alone = await Stream.start(stub, constrained("alone", prompt, choice)).rest()
    assert alone.text == many.outcomes["choice"].text
    with pytest.raises(ServiceError) as refused:
        await Stream.start(
            stub, constrained("bad", prompt, engine_pb2.StructuredOutput(json_schema="{"))
        ).rest()
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and "not JSON" in refused.value.message
    url = f"http://127.0.0.1:{null_engine.metrics_port}/metrics"
    body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read().decode())
    for series in (
        'grammar_compile_seconds_count{outcome="compiled"}',
        'grammar_compile_seconds_count{outcome="refused"}',
    ):
        assert float(_sample(body, f"chatmesh_engine_{series}")) >= 1, series
    assert float(_sample(body, "chatmesh_engine_grammar_cache_hits_total")) >= 1, "the second choice request"


def _sample(exposition: str, series: str) -> str:
    return next(line.split()[-1] for line in exposition.splitlines() if line.startswith(series + " "))
