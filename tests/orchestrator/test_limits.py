"""Every request limit answers with a clear status and the details clients act on: the field at fault
(google.rpc.BadRequest), a size limit (ErrorInfo PAYLOAD_TOO_LARGE), a retry delay (RetryInfo)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from chatmesh.chat.v1 import chat_pb2
from chatmesh.errors import PAYLOAD_TOO_LARGE, STATUS_DETAILS_KEY, retry_after_s
from tests.fixtures.orchestrator import ChatClient, Mesh, OrchestratorProcess, collect, events


def details(error: grpc.aio.AioRpcError) -> dict[str, object]:
    """The error's details by type name (BadRequest, ErrorInfo, RetryInfo)."""
    found: dict[str, object] = {}
    for key, value in error.trailing_metadata() or ():
        if key == STATUS_DETAILS_KEY:
            for detail in status_pb2.Status.FromString(value).details:
                for kind in (
                    error_details_pb2.BadRequest,
                    error_details_pb2.ErrorInfo,
                    error_details_pb2.RetryInfo,
                ):
                    if detail.Is(kind.DESCRIPTOR):
                        message = kind()
                        detail.Unpack(message)
                        found[kind.__name__] = message
    return found


def bad_field(error: grpc.aio.AioRpcError) -> str:
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    return details(error)["BadRequest"].field_violations[0].field


async def refused(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        if isinstance(call, grpc.aio.UnaryStreamCall):
            await collect(call)
        else:
            await call
    return caught.value


@pytest.fixture(scope="module")
def small(mesh: Mesh) -> Iterator[OrchestratorProcess]:
    """A replica with a small context window and one run at a time per pro user."""
    with mesh.replica(context_window=256, concurrent_runs_pro=1) as replica:
        yield replica


@pytest.fixture
def small_client(small: OrchestratorProcess, connect: Callable[..., ChatClient]) -> ChatClient:
    return connect(small.address)


async def test_a_message_over_32_kib_is_too_large_and_nothing_is_stored(client: ChatClient) -> None:
    chat = await client.create_chat()
    error = await refused(client.send(chat.chat_id, "x" * (32 * 1024 + 1)))
    assert bad_field(error) == "content"
    assert details(error)["ErrorInfo"].reason == PAYLOAD_TOO_LARGE
    page = await client.call("ListMessages", chat_pb2.ListMessagesRequest(chat_id=chat.chat_id))
    assert list(page.messages) == []


@pytest.mark.parametrize(
    ("request_fields", "field"),
    [
        ({"content": "   "}, "content"),
        ({"options": chat_pb2.GenerationOptions(max_tokens=100_000)}, "options.max_tokens"),
        ({"options": chat_pb2.GenerationOptions(temperature=3.0)}, "options.temperature"),
        ({"options": chat_pb2.GenerationOptions(stop=["a", "b", "c", "d", "e"])}, "options.stop"),
        ({"options": chat_pb2.GenerationOptions(presence_penalty=-3.0)}, "options.presence_penalty"),
        ({"options": chat_pb2.GenerationOptions(logprobs=True, top_logprobs=21)}, "options.top_logprobs"),
        ({"idempotency_key": "k" * 129}, "idempotency_key"),
        ({"parent_message_id": "x", "branch_from_root": True}, "parent_message_id"),
    ],
)
async def test_each_bad_send_field_is_named(client: ChatClient, request_fields: dict, field: str) -> None:
    chat = await client.create_chat()
    fields = {"content": "hello", **request_fields}
    error = await refused(client.send(chat.chat_id, **fields))
    assert bad_field(error) == field


async def test_a_field_this_server_does_not_know_is_refused_not_ignored(client: ChatClient) -> None:
    # Field 99 as a varint: what a field added by newer protos looks like to this server.
    newer = b"\x98\x06\x01"
    chat = await client.create_chat()
    send = chat_pb2.SendMessageRequest(chat_id=chat.chat_id, content="hello")
    send.options.MergeFromString(newer)
    error = await refused(client.stream("SendMessage", send))
    assert bad_field(error) == "options" and "field number 99" in error.details()
    page = await client.call("ListMessages", chat_pb2.ListMessagesRequest(chat_id=chat.chat_id))
    assert list(page.messages) == []
    listing = chat_pb2.ListChatsRequest.FromString(chat_pb2.ListChatsRequest().SerializeToString() + newer)
    assert bad_field(await refused(client.call("ListChats", listing))) == "request"


async def test_page_sizes_and_titles_are_bounded(client: ChatClient) -> None:
    chat = await client.create_chat()
    for call, field in [
        (client.call("ListChats", chat_pb2.ListChatsRequest(page_size=101)), "page_size"),
        (
            client.call("ListMessages", chat_pb2.ListMessagesRequest(chat_id=chat.chat_id, page_size=201)),
            "page_size",
        ),
        (client.call("CreateChat", chat_pb2.CreateChatRequest(title="t" * 201)), "title"),
        (client.call("RenameChat", chat_pb2.RenameChatRequest(chat_id=chat.chat_id, title="")), "title"),
    ]:
        assert bad_field(await refused(call)) == field
    error = await refused(client.call("ListChats", chat_pb2.ListChatsRequest(page_token="forged")))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_prompt_beyond_the_context_window_is_refused(small_client: ChatClient) -> None:
    chat = await small_client.create_chat()
    error = await refused(
        small_client.send(chat.chat_id, "word " * 300, options=chat_pb2.GenerationOptions(max_tokens=16))
    )
    assert bad_field(error) == "content"
    assert "256-token context window" in error.details()
    error = await refused(
        small_client.send(chat.chat_id, "hi", options=chat_pb2.GenerationOptions(max_tokens=300))
    )
    assert bad_field(error) == "options.max_tokens"


async def test_concurrent_runs_per_user_are_bounded_with_a_retry_delay(small_client: ChatClient) -> None:
    chat = await small_client.create_chat()
    first = small_client.send(chat.chat_id, "one", options=chat_pb2.GenerationOptions(max_tokens=200))
    started = await anext(events(first))
    error = await refused(
        small_client.send(chat.chat_id, "two", options=chat_pb2.GenerationOptions(max_tokens=4))
    )
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert retry_after_s(error) and retry_after_s(error) > 0
    # Another user is not affected.
    other = small_client.as_user(f"{small_client.user}-other")
    assert (
        await collect(
            other.send(
                (await other.create_chat()).chat_id, "hi", options=chat_pb2.GenerationOptions(max_tokens=2)
            )
        )
    )[-1].HasField("done")
    await small_client.call("CancelRun", chat_pb2.CancelRunRequest(run_id=started.started.run_id))
    await collect(first)
    # Once the first run ended, the user may start another.
    assert (
        await collect(
            small_client.send(chat.chat_id, "three", options=chat_pb2.GenerationOptions(max_tokens=2))
        )
    )[-1].HasField("done")


async def test_complete_refuses_bad_conversations_naming_the_message(client: ChatClient) -> None:
    for messages, field in [
        ([], "messages"),
        ([chat_pb2.PromptMessage(role=chat_pb2.ROLE_UNSPECIFIED, content="hi")], "messages[0].role"),
        ([chat_pb2.PromptMessage(role=chat_pb2.ROLE_USER, content="")], "messages[0].content"),
        ([chat_pb2.PromptMessage(role=chat_pb2.ROLE_SYSTEM, content="only a system prompt")], "messages"),
        ([chat_pb2.PromptMessage(role=chat_pb2.ROLE_USER, content="hi")] * 1001, "messages"),
    ]:
        error = await refused(client.stream("Complete", chat_pb2.CompleteRequest(messages=messages)))
        assert bad_field(error) == field
