"""RouterService.GenerateMany, many requests on one stream, against a real router over real null engines:
each request gets what it gets alone on a stream (routed, contiguous tokens, one finished), refusals and
deadlines end one request and not the stream, a half-close is not a cancel, a cancel frees its engine
work, and the stream's end frees all of it."""

from __future__ import annotations

import asyncio
import signal

import grpc
import pytest

from chatmesh.engine.v1 import engine_pb2
from chatmesh.errors import from_status
from chatmesh.router.v1 import router_pb2, router_pb2_grpc
from tests.engine.service_client import wait_until
from tests.many_client import Many, draining
from tests.router.router_client import TIMEOUT_S, Outcome, generate, start_frame
from tests.router.test_service import chat, engine_idle


def start(request_id: str, prompt: list[int], max_tokens: int = 16, timeout_ms: int = 0, **fields):
    return router_pb2.RequestFrame(
        request_id=request_id,
        start=start_frame(prompt, max_tokens=max_tokens, request_id=request_id, **fields),
        timeout_ms=timeout_ms,
    )


def cancel(request_id: str) -> router_pb2.RequestFrame:
    return router_pb2.RequestFrame(request_id=request_id, cancel=router_pb2.GenerateCancel())


def open_many(stub, *frames: router_pb2.RequestFrame) -> Many:
    return Many.open(stub, router_pb2.GenerateManyRequest, Outcome, *frames, timeout_s=TIMEOUT_S)


async def test_requests_on_one_stream_each_get_what_they_get_alone_and_share_messages(stub, tok):
    prompts = {f"many-{i}": chat(tok, f"You answer question {i}.", "Go.") for i in range(8)}
    many = open_many(
        stub, *(start(request_id, prompt, max_tokens=30) for request_id, prompt in prompts.items())
    )
    await many.until_ended(*prompts)
    for request_id, prompt in prompts.items():
        outcome = many.outcomes[request_id]
        alone = await generate(stub, start_frame(prompt, max_tokens=30))
        assert outcome.token_ids == alone.token_ids and outcome.text == alone.text
        assert len(outcome.routed) == 1 and outcome.finished.usage.completion_tokens == 30
    # A message per frame would take 8 x (routed + 30 tokens + finished) messages.
    assert max(len({f.request_id for f in m.frames}) for m in many.messages) > 1
    assert len(many.messages) < 8 * 32 / 2
    many.half_close()
    assert await many.call.read() is grpc.aio.EOF
    assert await many.call.code() == grpc.StatusCode.OK


async def test_a_refused_request_fails_alone_with_its_status_and_the_others_go_on(stub, tok):
    prompt = chat(tok, "x", "y")
    many = open_many(
        stub,
        start("fine", prompt, max_tokens=20),
        start("no-prompt", [], max_tokens=20),
        start("no-such-model", prompt, model="llama-405b"),
        start("foreign", prompt, tokenizer_fingerprint="not-our-tokenizer"),
    )
    await many.until(lambda: many.ended("fine") and len(many.failed) == 3)
    assert len(many.outcomes["fine"].token_ids) == 20
    codes = {request_id: from_status(failed.status).code for request_id, failed in many.failed.items()}
    assert codes == {
        "no-prompt": grpc.StatusCode.INVALID_ARGUMENT,
        "no-such-model": grpc.StatusCode.NOT_FOUND,
        "foreign": grpc.StatusCode.FAILED_PRECONDITION,
    }
    # The refusal's words are the router's.
    assert "prompt_token_ids" in from_status(many.failed["no-prompt"].status).message
    many.half_close()


async def test_a_cancel_frame_ends_its_request_only_and_frees_its_engine_work(stub, tok, engine_stubs):
    many = open_many(
        stub,
        start("stays", chat(tok, "Stay.", "Go."), max_tokens=60),
        start("goes", chat(tok, "Talk forever.", "Go."), max_tokens=4000),
    )
    await many.until(lambda: len(many.outcomes.get("goes", Outcome()).token_ids) >= 2)
    many.send(cancel("goes"), cancel("never-started"))
    await many.until_ended("goes", "stays")
    goes = many.outcomes["goes"]
    assert goes.finished.finish_reason == engine_pb2.FINISH_REASON_CANCELLED
    assert len(goes.token_ids) < 4000 and len(many.outcomes["stays"].token_ids) == 60
    await wait_until(
        lambda: engine_idle(engine_stubs[goes.engine_id]), what="the cancelled request's blocks freed"
    )
    many.half_close()


async def test_a_half_close_is_not_a_cancel(stub, tok):
    many = open_many(stub, start("after-half-close", chat(tok, "Be brief.", "Hi."), max_tokens=40))
    await many.until(lambda: "after-half-close" in many.outcomes)  # routed
    many.half_close()
    await many.until_ended("after-half-close")
    outcome = many.outcomes["after-half-close"]
    assert outcome.finished.finish_reason == engine_pb2.FINISH_REASON_LENGTH
    assert len(outcome.token_ids) == 40
    assert await many.call.read() is grpc.aio.EOF


async def test_cancelling_the_stream_frees_the_engine_work_of_every_request_on_it(stub, tok, engine_stubs):
    ids = [f"dropped-{i}" for i in range(4)]
    many = open_many(stub, *(start(i, chat(tok, f"Talk forever {i}.", "Go."), max_tokens=4000) for i in ids))
    await many.until(lambda: all(len(many.outcomes.get(i, Outcome()).token_ids) > 0 for i in ids))
    many.call.cancel()
    for name, engine in engine_stubs.items():
        await wait_until(
            lambda engine=engine: engine_idle(engine), what=f"{name} freed of the dropped requests"
        )


async def test_a_request_past_its_deadline_ends_deadline_exceeded_and_frees_the_engine(
    stub, tok, engine_stubs
):
    many = open_many(
        stub,
        start("late", chat(tok, "Talk forever.", "Go."), max_tokens=4000, timeout_ms=500),
        start("in-time", chat(tok, "Be quick.", "Go."), max_tokens=20, timeout_ms=30_000),
    )
    await many.until_ended("late", "in-time")
    late = from_status(many.failed["late"].status)
    assert late.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert len(many.outcomes["late"].token_ids) < 4000  # it streamed (if at all) until its time was up
    assert len(many.outcomes["in-time"].token_ids) == 20
    engine_id = many.outcomes["late"].engine_id
    await wait_until(lambda: engine_idle(engine_stubs[engine_id]), what="the late request's blocks freed")
    many.half_close()


@pytest.fixture
def own_router(start_router, router):
    """A router of this module's own over the shared router's engines (the test signals it)."""
    return start_router(router.engines, drain_grace_s=10.0)


async def test_a_draining_router_finishes_what_it_runs_refuses_new_starts_and_ends_the_stream(
    own_router, start_router, tok
):
    async with grpc.aio.insecure_channel(own_router.address) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        many = open_many(stub, start("running", chat(tok, "Drain.", "Go."), max_tokens=400))  # 2 s
        await many.until(lambda: len(many.outcomes.get("running", Outcome()).token_ids) >= 1)
        start_router.launcher.signal(own_router.name, signal.SIGTERM)
        await draining(channel)  # its port still takes calls
        many.send(start("late", chat(tok, "Late.", "Go."), max_tokens=5))
        await many.until_ended("running", "late")
        assert len(many.outcomes["running"].token_ids) == 400
        assert from_status(many.failed["late"].status).code == grpc.StatusCode.UNAVAILABLE
        # Nothing is left on the stream: the draining router ends it, though the client never half-closed.
        assert await many.call.read() is grpc.aio.EOF
        assert await many.call.code() == grpc.StatusCode.OK
    assert await asyncio.to_thread(start_router.launcher.running[own_router.name].process.wait, 30) == 0
    start_router.launcher.forget(own_router.name)
