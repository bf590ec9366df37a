"""The edge's client of the chat service (``edge/chat_client/``: ``ChatClient``, ``LinkedRun``) against
ScriptedChatService over real gRPC: what ``RunStream`` reads of a Complete, or of a stored chat's stream,
on a completion link, what a unary call on a link answers, and what a refused call gives the caller."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from chatmesh.chat.v1 import chat_pb2
from chatmesh.errors import DRAINING
from chatmesh.identity import Identity
from edge.chat_client.caller import Caller
from edge.chat_client.client import ChatClient
from edge.chat_client.linked_run import EDGE_KEY_PREFIX, START_ATTEMPTS
from edge.drain import Drain
from edge.errors import BUSY_MESSAGE, UNREACHABLE_MESSAGE, ApiError
from tests.fixtures.identity import bearer
from tests.front_door.scripted_chat_service import LINKED, ScriptedChatServer, scripted_text


@pytest.fixture(scope="module")
def scripted() -> AsyncIterator[ScriptedChatServer]:
    server = ScriptedChatServer().start()
    yield server
    server.stop()


def chat_client(
    scripted: ScriptedChatServer, start_timeout_s: float = 30.0, unary_timeout_s: float = 10.0
) -> ChatClient:
    return ChatClient(
        f"127.0.0.1:{scripted.port}",
        links=2,
        unary_timeout_s=unary_timeout_s,
        stream_timeout_s=60.0,
        start_timeout_s=start_timeout_s,
        drain=Drain(),
    )


@pytest.fixture
async def orchestrator(scripted: ScriptedChatServer) -> AsyncIterator[ChatClient]:
    """The edge's client, refusing an answer whose run does not start within a second."""
    client = chat_client(scripted, start_timeout_s=1.0)
    await client.start()
    yield client
    await client.close()


@pytest.fixture
async def client(scripted: ScriptedChatServer) -> AsyncIterator[ChatClient]:
    """The edge's client with its default start timeout."""
    client = chat_client(scripted)
    await client.start()
    yield client
    await client.close()


def caller(user: str = "links-user") -> Caller:
    return Caller(identity=Identity(user, "pro"), authorization=dict(bearer(user))["authorization"])


def request(text: str, merge_deltas: bool = True) -> chat_pb2.CompleteRequest:
    return chat_pb2.CompleteRequest(
        messages=[chat_pb2.PromptMessage(role=chat_pb2.ROLE_USER, content=text)], merge_deltas=merge_deltas
    )


async def test_deltas_that_arrived_together_are_read_as_one_numbered_as_the_last(
    orchestrator: ChatClient,
) -> None:
    stream = orchestrator.stream("Complete", request("!tokens 6 1"), caller())
    first = await stream.opening()
    assert first.HasField("started")
    await asyncio.sleep(0.5)  # the whole answer arrives while nobody reads
    rest = [event async for event in stream.rest()]
    assert [event.WhichOneof("kind") for event in rest] == ["delta", "usage", "done"]
    assert rest[0].delta.text == scripted_text(6) and rest[0].delta.token_count == 6
    assert rest[0].seq == 7 and rest[1].seq == 8  # started is 1, the six deltas 2-7


async def test_without_merge_deltas_every_delta_is_its_own_event(orchestrator: ChatClient) -> None:
    stream = orchestrator.stream("Complete", request("!tokens 6 1", merge_deltas=False), caller())
    await stream.opening()
    await asyncio.sleep(0.5)
    rest = [event async for event in stream.rest()]
    assert [event.seq for event in rest if event.HasField("delta")] == [2, 3, 4, 5, 6, 7]


async def test_many_answers_on_two_links_each_get_their_own_events(orchestrator: ChatClient) -> None:
    async def answer(n: int) -> str:
        stream = orchestrator.stream("Complete", request(f"!tokens {n} 5"), caller(f"user-{n}"))
        first = await stream.opening()
        return "".join([event.delta.text async for event in stream.events(first) if event.HasField("delta")])

    texts = await asyncio.gather(*(answer(n) for n in range(1, 9)))
    assert texts == [scripted_text(n) for n in range(1, 9)]


async def test_an_answer_whose_run_does_not_start_in_time_is_refused_as_too_busy(
    scripted: ScriptedChatServer, orchestrator: ChatClient
) -> None:
    # An overloaded replica takes its time to start the run (as gRPC sheds a call it took too late).
    calls = len(scripted.service.calls_to("Complete"))
    with scripted.service.delay("Complete", 3.0):
        stream = orchestrator.stream("Complete", request("!tokens 3 1"), caller())
        started = asyncio.get_running_loop().time()
        with pytest.raises(ApiError) as refused:
            await stream.opening()
        waited = asyncio.get_running_loop().time() - started
        assert 0.9 < waited < 2.0
    assert refused.value.status == 503 and refused.value.message == BUSY_MESSAGE
    assert refused.value.retry_after_s == 1.0
    # It was not sent again: a shed answer is the client's to retry.
    assert len(scripted.service.calls_to("Complete")) == calls + 1


async def test_a_read_refused_unavailable_by_the_one_address_known_is_the_clients_to_read(
    scripted: ScriptedChatServer, orchestrator: ChatClient
) -> None:
    # One replica: there is no other to try, so the client gets the refusal as the service said it, with
    # its retry delay.
    calls = len(scripted.service.calls_to("GetUsage"))
    failing = scripted.service.failing(
        "GetUsage", grpc.StatusCode.UNAVAILABLE, "scripted: busy", retry_after_s=3
    )
    with failing, pytest.raises(ApiError) as refused:
        await orchestrator.unary("GetUsage", chat_pb2.GetUsageRequest(), caller())
    assert refused.value.status == 503 and "busy" in refused.value.message
    assert refused.value.retry_after_s == 3
    assert len(scripted.service.calls_to("GetUsage")) == calls + 1


async def test_a_unary_call_whose_link_breaks_is_a_503_to_retry_without_the_transports_text(
    scripted: ScriptedChatServer, orchestrator: ChatClient
) -> None:
    # Its link's stream breaks under it (the replica's connection reset): the transport's failure, whose
    # text is not for users. A CreateChat is not tried again (it does not repeat harmlessly).
    transport_text = "Socket closed by 10.0.0.7:50050"
    calls = len(scripted.service.calls_to("CreateChat"))
    broken = scripted.service.failing(
        "CreateChat", grpc.StatusCode.UNAVAILABLE, transport_text, transport=True
    )
    with broken, pytest.raises(ApiError) as refused:
        await orchestrator.unary("CreateChat", chat_pb2.CreateChatRequest(), caller())
    assert refused.value.status == 503 and refused.value.message == UNREACHABLE_MESSAGE
    assert refused.value.retry_after_s == 1.0
    assert len(scripted.service.calls_to("CreateChat")) == calls + 1


async def test_a_unary_call_goes_on_a_link_as_the_call_and_its_deadline_holds(
    scripted: ScriptedChatServer,
) -> None:
    quick = chat_client(scripted, unary_timeout_s=0.5)
    await quick.start()
    try:
        who = await new_chat(quick, "linked-unary-user")
        reply = await quick.unary("GetChat", chat_pb2.GetChatRequest(chat_id=who.chat_id), who)
        assert reply.chat.chat_id == who.chat_id
        call = scripted.service.calls_to("GetChat")[-1]
        # On a link, with the caller's token, and answered with that call's response.
        assert call.metadata[LINKED[0]] == LINKED[1]
        assert call.metadata["authorization"] == who.authorization
        # Refused as the call is: its status, with the details the service gave.
        refusing = scripted.service.failing(
            "GetRun", grpc.StatusCode.RESOURCE_EXHAUSTED, "scripted: busy", retry_after_s=3
        )
        with refusing, pytest.raises(ApiError) as refused:
            await quick.unary("GetRun", chat_pb2.GetRunRequest(run_id="r-1"), who)
        assert refused.value.status == 429 and refused.value.retry_after_s == 3
        # Past its deadline it is a 504 (its `cancel` went out), and the link carries the next call.
        started = asyncio.get_running_loop().time()
        with scripted.service.delay("GetChat", 2.0), pytest.raises(ApiError) as late:
            await quick.unary("GetChat", chat_pb2.GetChatRequest(chat_id=who.chat_id), who)
        assert late.value.status == 504
        assert asyncio.get_running_loop().time() - started < 1.5
        assert (await quick.unary("GetChat", chat_pb2.GetChatRequest(chat_id=who.chat_id), who)).chat
    finally:
        await quick.close()


async def new_chat(orchestrator: ChatClient, user: str) -> Caller:
    """A new chat of ``user``'s, and the caller for it."""
    reply = await orchestrator.unary("CreateChat", chat_pb2.CreateChatRequest(), caller(user))
    return caller(user).for_chat(reply.chat.chat_id)


def linked(call_metadata: dict[str, str]) -> bool:
    return call_metadata.get(LINKED[0]) == LINKED[1]


async def test_a_stored_chats_send_on_a_link_leaves_its_run_going_when_read_no_more_and_resumes_on_a_link(
    scripted: ScriptedChatServer, client: ChatClient
) -> None:
    who = await new_chat(client, "stored-links-user")
    send = chat_pb2.SendMessageRequest(chat_id=who.chat_id, content="!tokens 10 30", merge_deltas=False)
    stream = client.stream("SendMessage", send, who)
    first = await stream.opening()
    seen = [first]
    async for event in stream.rest():
        seen.append(event)
        if len(seen) == 3:
            break
    stream.detach()  # the reader left: a stored chat's run goes on
    assert linked(scripted.service.calls_to("SendMessage")[-1].metadata)
    await asyncio.sleep(0.5)  # its last tokens come meanwhile
    attach = chat_pb2.StreamRunRequest(run_id=first.started.run_id, after_seq=seen[-1].seq)
    resumed = client.stream("StreamRun", attach, who)
    opening = await resumed.opening()
    rest = [event async for event in resumed.events(opening)]
    assert linked(scripted.service.calls_to("StreamRun")[-1].metadata)
    assert [event.seq for event in rest] == list(range(seen[-1].seq + 1, seen[-1].seq + 1 + len(rest)))
    text = "".join(event.delta.text for event in [*seen, *rest] if event.HasField("delta"))
    assert text == scripted_text(10) and rest[-1].HasField("done")


async def test_a_stored_send_whose_link_breaks_before_its_first_event_goes_again_under_one_key(
    scripted: ScriptedChatServer, client: ChatClient
) -> None:
    who = await new_chat(client, "stored-broken-user")
    broken = {"transport": True, "times": START_ATTEMPTS - 1}  # on a link: its stream breaks
    # Its stream broke: a run it started goes on there, and the same idempotency key joins it, so the
    # send goes again on a new stream under its key: the client's, or (without one) one the edge made.
    for key in ("k-1", ""):
        calls = len(scripted.service.calls_to("SendMessage"))
        send = chat_pb2.SendMessageRequest(chat_id=who.chat_id, content="!tokens 2 1", idempotency_key=key)
        with scripted.service.failing("SendMessage", grpc.StatusCode.UNAVAILABLE, "Socket closed", **broken):
            stream = client.stream("SendMessage", send, who)
            first = await stream.opening()
            assert first.HasField("started")
            assert [event.WhichOneof("kind") async for event in stream.events(first)][-1] == "done"
        attempts = scripted.service.calls_to("SendMessage")[calls:]
        assert len(attempts) == START_ATTEMPTS
        keys = {attempt.request.idempotency_key for attempt in attempts}  # type: ignore[attr-defined]
        (sent,) = keys
        assert sent == key if key else sent.startswith(EDGE_KEY_PREFIX)
    # Each send without a key is a send of its own: a key of its own.
    calls = len(scripted.service.calls_to("SendMessage"))
    for _ in range(2):
        bare = chat_pb2.SendMessageRequest(chat_id=who.chat_id, content="!tokens 2 1")
        stream = client.stream("SendMessage", bare, who)
        first = await stream.opening()
        assert [event.WhichOneof("kind") async for event in stream.events(first)][-1] == "done"
    sent = scripted.service.calls_to("SendMessage")[calls:]
    made = [call.request.idempotency_key for call in sent]  # type: ignore[attr-defined]
    assert len(set(made)) == 2 and all(key.startswith(EDGE_KEY_PREFIX) for key in made)


async def test_a_stored_send_refused_busy_is_the_clients_to_retry_and_one_refused_draining_goes_again(
    scripted: ScriptedChatServer, client: ChatClient
) -> None:
    # A refusal (busy) is the orchestrator's answer: the client reads it, with its retry delay (the chat
    # page counts it down), even with an idempotency key.
    who = await new_chat(client, "stored-refused-user")
    calls = len(scripted.service.calls_to("SendMessage"))
    keyed = chat_pb2.SendMessageRequest(chat_id=who.chat_id, content="!tokens 2 1", idempotency_key="k-2")
    refusing = scripted.service.failing("SendMessage", grpc.StatusCode.UNAVAILABLE, "busy", retry_after_s=2)
    with refusing, pytest.raises(ApiError) as refused:
        await client.stream("SendMessage", keyed, who).opening()
    assert (
        refused.value.status == 503 and refused.value.message == "busy" and refused.value.retry_after_s == 2
    )
    assert len(scripted.service.calls_to("SendMessage")) == calls + 1
    # A replica that drains refuses before anything of the send is stored (``DRAINING``): it goes to
    # another replica at once, with or without a key.
    bare = chat_pb2.SendMessageRequest(chat_id=who.chat_id, content="!tokens 2 1")
    draining = {"error_reason": DRAINING, "times": START_ATTEMPTS - 1}
    with scripted.service.failing("SendMessage", grpc.StatusCode.UNAVAILABLE, "shutting down", **draining):
        stream = client.stream("SendMessage", bare, who)
        first = await stream.opening()
        assert [event.WhichOneof("kind") async for event in stream.events(first)][-1] == "done"
    assert len(scripted.service.calls_to("SendMessage")) == calls + 1 + START_ATTEMPTS
