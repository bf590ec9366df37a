"""CompletionLinkService: many Complete calls (and stored chats' streams, and unary calls) on one
CompleteMany stream, through real processes (the orchestrator, a router, null engines, Cassandra), each
request keeping its call's contract."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from chatmesh.chat.v1 import chat_pb2, completion_link_pb2, completion_link_pb2_grpc
from chatmesh.errors import DRAINING, ServiceError
from chatmesh.linked_calls import linked_start, reply_response
from meshkit.links import Link, LinkBroken, LinkMessages, RequestFeed
from meshkit.telemetry import TRACE_FILE_ENV
from tests.fixtures.identity import bearer
from tests.fixtures.orchestrator import ChatClient, Mesh, collect, new_user, read_until
from tests.orchestrator.test_tracing import wait_for_trace

pytestmark = pytest.mark.usefixtures("router_required")

COMPLETION_LINK = LinkMessages.of(completion_link_pb2)


@pytest.fixture
async def link(client: ChatClient) -> AsyncIterator[Link]:
    stub = completion_link_pb2_grpc.CompletionLinkServiceStub(client.channel)
    link = Link(stub.CompleteMany, COMPLETION_LINK, "the orchestrator")
    yield link
    link.close()


def complete_request(text: str, max_tokens: int, seed: int = 7) -> chat_pb2.CompleteRequest:
    return chat_pb2.CompleteRequest(
        messages=[chat_pb2.PromptMessage(role=chat_pb2.ROLE_USER, content=text)],
        options=chat_pb2.GenerationOptions(max_tokens=max_tokens, seed=seed),
    )


def open_request(
    link: Link,
    request: Any,
    user: str | None = None,
    timeout_ms: int = 0,
    trace_context: dict[str, str] | None = None,
    authorization: str | None = None,
) -> tuple[str, RequestFeed]:
    method = request.DESCRIPTOR.name.removesuffix("Request")  # the call it stands for
    authorization = authorization or dict(bearer(user or new_user()))["authorization"]
    frame = linked_start(method, authorization, request)
    frame.request_id = f"r-{time.monotonic_ns()}"
    return frame.request_id, link.open(frame, trace_context or {}, timeout_ms=timeout_ms)


async def read(feed: RequestFeed) -> tuple[list[chat_pb2.RunEvent], ServiceError | None]:
    """A request's events, and how it failed (None: it ended with `finished`)."""
    events: list[chat_pb2.RunEvent] = []
    try:
        while batch := await feed.take():
            for frame in batch:
                if frame.WhichOneof("kind") == "event":
                    events.append(frame.event)
                else:
                    assert frame.WhichOneof("kind") == "finished"
    except ServiceError as error:
        return events, error
    return events, None


async def answer(link: Link, request: Any, user: str) -> tuple[Any, ServiceError | None]:
    """A unary call on the link: its response (one `reply`, then `finished`), or how it failed."""
    method = request.DESCRIPTOR.name.removesuffix("Request")
    _, feed = open_request(link, request, user=user)
    frames = []
    try:
        while batch := await feed.take():
            frames += batch
    except ServiceError as error:
        assert frames == []
        return None, error
    assert [frame.WhichOneof("kind") for frame in frames] == ["reply", "finished"]
    return reply_response(method, frames[0].reply), None


def text(events: list[chat_pb2.RunEvent]) -> str:
    return "".join(event.delta.text for event in events if event.HasField("delta"))


async def test_answers_on_one_link_are_each_the_answer_its_complete_call_gets(
    client: ChatClient, link: Link
) -> None:
    requests = [complete_request(f"question {n}", max_tokens=12, seed=n) for n in range(4)]
    feeds = [open_request(link, request)[1] for request in requests]
    answers = await asyncio.gather(*(read(feed) for feed in feeds))
    for request, (events, error) in zip(requests, answers, strict=True):
        assert error is None
        kinds = [event.WhichOneof("kind") for event in events]
        assert kinds[0] == "started" and kinds[-2:] == ["usage", "done"]
        assert [event.seq for event in events] == list(range(1, len(events) + 1))
        # Sampling is a function of (seed, position): the same request as a call says the same.
        called = await collect(client.stream("Complete", request))
        assert text(events) == text(called)
        usage, called_usage = events[-2].usage, called[-2].usage
        assert (usage.prompt_tokens, usage.completion_tokens) == (
            called_usage.prompt_tokens,
            called_usage.completion_tokens,
        )


async def test_a_request_is_refused_as_its_call_would_be_and_the_others_on_the_link_go_on(
    link: Link,
) -> None:
    _, running = open_request(link, complete_request("a fine question", max_tokens=30))
    _, no_token = open_request(link, complete_request("who am I?", 5), authorization="Bearer not-a-jwt")
    _, empty = open_request(link, chat_pb2.CompleteRequest(options=chat_pb2.GenerationOptions(max_tokens=5)))
    _, too_long = open_request(link, complete_request("x", max_tokens=10**7))
    events, error = await read(no_token)
    assert events == [] and error is not None and error.code == grpc.StatusCode.UNAUTHENTICATED
    events, error = await read(empty)
    # The status details travel too: the field at fault, as a call's trailer carries it.
    assert error is not None and error.code == grpc.StatusCode.INVALID_ARGUMENT and error.field == "messages"
    events, error = await read(too_long)
    assert error is not None and error.code == grpc.StatusCode.INVALID_ARGUMENT and events == []
    events, error = await read(running)
    assert error is None and events[-1].HasField("done")


@pytest.mark.usefixtures("engines_idle")
async def test_a_cancel_stops_the_answer_frees_the_engine_and_charges_what_was_generated(
    client: ChatClient, mesh: Mesh, link: Link
) -> None:
    request_id, feed = open_request(link, complete_request("a long answer", 2000), user=client.user)
    while not any(frame.event.HasField("delta") for frame in await feed.take()):
        pass
    link.release(request_id)  # the caller left: its `cancel` goes out
    deadline = time.monotonic() + 5
    while mesh.engine_requests() or (
        (await client.call("GetUsage", chat_pb2.GetUsageRequest())).used_tokens >= 1000
    ):
        assert time.monotonic() < deadline, "the answer went on after its caller left"
        await asyncio.sleep(0.1)


@pytest.mark.usefixtures("engines_idle")
async def test_a_request_past_its_deadline_ends_deadline_exceeded_and_frees_the_engine(
    mesh: Mesh, link: Link
) -> None:
    _, feed = open_request(link, complete_request("a long answer", 2000), timeout_ms=500)
    events, error = await read(feed)
    assert error is not None and error.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert events[0].HasField("started")
    await asyncio.sleep(0.5)
    assert mesh.engine_requests() == 0


@pytest.mark.usefixtures("engines_idle")
async def test_when_the_link_ends_every_answer_on_it_is_cancelled(mesh: Mesh, link: Link) -> None:
    feeds = [open_request(link, complete_request(f"long answer {n}", 2000))[1] for n in range(3)]
    for feed in feeds:
        assert (await feed.take())[0].event.HasField("started")
    link.close()  # the edge went away
    for feed in feeds:
        _, error = await read(feed)
        assert isinstance(error, LinkBroken)
    deadline = time.monotonic() + 5
    while mesh.engine_requests():
        assert time.monotonic() < deadline, "answers went on after their link ended"
        await asyncio.sleep(0.1)


async def test_each_request_is_traced_as_the_complete_it_stands_for_and_the_stream_is_not(link: Link) -> None:
    trace_id, caller_span_id = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    traceparent = {"traceparent": f"00-{trace_id}-{caller_span_id}-01"}
    _, feed = open_request(link, complete_request("trace me", 4), trace_context=traceparent)
    assert (await read(feed))[1] is None
    spans = wait_for_trace(trace_id, {"orchestrator", "router", "engine"})
    [complete] = [s for s in spans if s["service"] == "orchestrator" and s["kind"] == "SERVER"]
    assert complete["name"] == COMPLETION_LINK.span_name and complete["parent_span_id"] == caller_span_id
    routed = [s for s in spans if s["service"] == "router" and s["kind"] == "SERVER"]
    assert routed and all(s["trace_id"] == trace_id for s in routed)
    # The long-lived stream has no span of its own (one would last as long as the edge): only its
    # requests do. Such a span would be written as the stream ends.
    link.close()
    await asyncio.sleep(1.0)
    spans = await asyncio.to_thread(Path(os.environ[TRACE_FILE_ENV]).read_text, encoding="utf-8")
    assert "CompletionLinkService/CompleteMany" not in spans


async def test_a_cancel_in_the_message_of_its_start_ends_the_request_and_the_stream_can_end(
    client: ChatClient,
) -> None:
    # The edge's client left in the loop turn its request was sent: start and cancel in one message.
    start = completion_link_pb2.CompleteStart(
        request_id="gone-at-once",
        authorization=dict(bearer(new_user()))["authorization"],
        request=complete_request("never mind", 50),
    )
    message = completion_link_pb2.CompleteManyRequest(
        frames=[
            completion_link_pb2.CompleteRequestFrame(request_id=start.request_id, start=start),
            completion_link_pb2.CompleteRequestFrame(
                request_id=start.request_id, cancel=completion_link_pb2.CompleteCancel()
            ),
        ]
    )
    stub = completion_link_pb2_grpc.CompletionLinkServiceStub(client.channel)
    call = stub.CompleteMany(timeout=10)
    await call.write(message)
    await call.done_writing()  # half-closed: the stream ends once no request is left on it
    frames = [frame async for response in call for frame in response.frames]
    assert [frame.WhichOneof("kind") for frame in frames] == ["failed"]
    assert await call.code() == grpc.StatusCode.OK


async def test_a_stored_chats_send_on_a_link_outlives_the_link_and_streamrun_on_another_resumes_it(
    client: ChatClient, link: Link
) -> None:
    chat = await client.create_chat()
    options = chat_pb2.GenerationOptions(max_tokens=80, seed=3)
    send = chat_pb2.SendMessageRequest(chat_id=chat.chat_id, content="a stored question", options=options)
    _, feed = open_request(link, send, user=client.user)
    seen: list[chat_pb2.RunEvent] = []
    while not any(event.HasField("delta") for event in seen):
        seen += [frame.event for frame in await feed.take()]
    link.close()  # the edge went away: a stored chat's run goes on (a Complete's would be cancelled)
    stub = completion_link_pb2_grpc.CompletionLinkServiceStub(client.channel)
    relinked = Link(stub.CompleteMany, COMPLETION_LINK, "the orchestrator")
    try:
        attach = chat_pb2.StreamRunRequest(run_id=seen[0].started.run_id, after_seq=seen[-1].seq)
        rest, error = await read(open_request(relinked, attach, user=client.user)[1])
    finally:
        relinked.close()
    assert error is None and rest[-1].HasField("done")
    assert [event.seq for event in seen + rest] == list(range(1, len(seen) + len(rest) + 1))
    assert rest[-2].usage.completion_tokens == 80
    # Stored once, as streamed: the question and its whole answer.
    listed = await client.call("ListMessages", chat_pb2.ListMessagesRequest(chat_id=chat.chat_id))
    assert [message.content for message in listed.messages] == [text(seen + rest), "a stored question"]


async def test_a_stored_chats_send_on_a_link_is_refused_as_its_call_would_be(
    client: ChatClient, link: Link
) -> None:
    # Another user's chat is not found, as for the call: the token its start carries is who asks.
    others = chat_pb2.SendMessageRequest(chat_id=(await client.create_chat()).chat_id, content="mine now?")
    events, error = await read(open_request(link, others, user=new_user())[1])
    assert events == [] and error is not None and error.code == grpc.StatusCode.NOT_FOUND
    not_a_run = chat_pb2.StreamRunRequest(run_id="../etc")
    events, error = await read(open_request(link, not_a_run, user=client.user)[1])
    assert events == [] and error is not None and error.code == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.usefixtures("engines_idle")
async def test_unary_calls_on_a_link_answer_as_the_calls_do_and_its_cancel_frees_the_engine_at_once(
    client: ChatClient, mesh: Mesh, link: Link
) -> None:
    created, error = await answer(link, chat_pb2.CreateChatRequest(title="linked"), client.user)
    assert error is None
    chat_id = created.chat.chat_id
    # Stored as the call stores it, for the caller its start's token proves.
    assert (await client.call("GetChat", chat_pb2.GetChatRequest(chat_id=chat_id))).chat == created.chat
    got, error = await answer(link, chat_pb2.GetChatRequest(chat_id=chat_id), client.user)
    assert error is None and got.chat == created.chat
    # Refused as the calls are: another user's chat is not found, a malformed id is invalid.
    _, error = await answer(link, chat_pb2.GetChatRequest(chat_id=chat_id), new_user())
    assert error is not None and error.code == grpc.StatusCode.NOT_FOUND
    _, error = await answer(link, chat_pb2.GetRunRequest(run_id="../etc"), client.user)
    assert error is not None and error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid id" in error.message

    # CancelRun on the link stops a running answer at once, and its end is stored.
    options = chat_pb2.GenerationOptions(max_tokens=3000)
    send = client.send(chat_id, "Tell me a long story.", options=options)
    head = await read_until(send, 6)
    run_id = head[0].started.run_id
    cancelled, error = await answer(link, chat_pb2.CancelRunRequest(run_id=run_id), client.user)
    assert error is None and cancelled.run.status == chat_pb2.RUN_STATUS_CANCELLED
    assert mesh.engine_requests() == 0
    run = head + await asyncio.wait_for(collect(send), 10)
    assert run[-1].done.finish_reason == chat_pb2.FINISH_REASON_CANCELLED
    got, error = await answer(link, chat_pb2.GetRunRequest(run_id=run_id), client.user)
    assert error is None and got.run.status == chat_pb2.RUN_STATUS_CANCELLED
    assert got.run.last_seq == run[-1].seq


async def until_draining(address: str, timeout_s: float = 10.0) -> None:
    """Waits until the server at ``address`` no longer says SERVING (it began to drain)."""
    deadline = time.monotonic() + timeout_s
    async with grpc.aio.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status != health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                return  # it takes no new calls any more
            assert time.monotonic() < deadline, f"{address} did not begin to drain"
            await asyncio.sleep(0.05)


async def test_a_draining_replica_refuses_a_send_on_an_open_link_as_draining_and_stores_nothing(
    mesh: Mesh, connect: Callable[..., ChatClient]
) -> None:
    # The refusal the edge sends to another replica (edge/chat_client/linked_run.py, `_resendable`): a replica
    # drains while a Complete keeps its link open (its runs get --drain-grace-s less a second), and a
    # send that arrives on that link meanwhile is refused before anything of it is stored.
    with mesh.replica(drain_grace_s=6) as replica:
        client = connect(replica.address)
        chat = await client.create_chat()
        stub = completion_link_pb2_grpc.CompletionLinkServiceStub(client.channel)
        link = Link(stub.CompleteMany, COMPLETION_LINK, "the orchestrator")
        try:
            _, busy = open_request(link, complete_request("Keep this link open.", 2000), user=client.user)
            await busy.take()  # its first frame: it runs
            mesh.launcher.signal(replica.name, signal.SIGTERM)
            await until_draining(replica.address)
            send = chat_pb2.SendMessageRequest(chat_id=chat.chat_id, content="Too late?")
            events, error = await read(open_request(link, send, user=client.user)[1])
        finally:
            link.close()
    assert events == [] and error is not None
    assert (error.code, error.reason) == (grpc.StatusCode.UNAVAILABLE, DRAINING), error
    elsewhere = connect(mesh.orchestrator.address, client.user)
    listed = await elsewhere.call("ListMessages", chat_pb2.ListMessagesRequest(chat_id=chat.chat_id))
    assert list(listed.messages) == []
