"""Chats and messages through a real orchestrator process on a real Cassandra node: CRUD, paging,
ownership (another user's chat is NOT_FOUND, never PERMISSION_DENIED) and identity."""

from __future__ import annotations

import grpc
import pytest

from chatmesh.chat.v1 import chat_pb2, chat_pb2_grpc
from chatmesh.errors import parse
from memory_store.ids import new_id
from memory_store.models import Message, Role
from memory_store.store import MemoryStore
from tests.fixtures.orchestrator import ChatClient, Mesh, collect, new_user, read_until


async def test_a_chat_is_created_read_renamed_and_deleted(client: ChatClient) -> None:
    chat = await client.create_chat("Trip plans")
    assert chat.title == "Trip plans" and chat.chat_id and chat.create_time.seconds > 0

    got = (await client.call("GetChat", chat_pb2.GetChatRequest(chat_id=chat.chat_id))).chat
    assert got == chat

    renamed = (
        await client.call("RenameChat", chat_pb2.RenameChatRequest(chat_id=chat.chat_id, title="Lisbon"))
    ).chat
    assert renamed.title == "Lisbon"
    assert renamed.update_time.ToDatetime() >= chat.update_time.ToDatetime()

    await client.call("DeleteChat", chat_pb2.DeleteChatRequest(chat_id=chat.chat_id))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await client.call("GetChat", chat_pb2.GetChatRequest(chat_id=chat.chat_id))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    listed = await client.call("ListChats", chat_pb2.ListChatsRequest())
    assert chat.chat_id not in [c.chat_id for c in listed.chats]


async def test_chats_are_listed_by_recent_activity_page_by_page(client: ChatClient) -> None:
    created = [await client.create_chat(f"chat {i}") for i in range(5)]
    # Renaming the oldest is activity: it moves to the top.
    await client.call("RenameChat", chat_pb2.RenameChatRequest(chat_id=created[0].chat_id, title="moved"))
    expected = [created[0].chat_id] + [c.chat_id for c in reversed(created[1:])]

    seen, token = [], ""
    while True:
        page = await client.call("ListChats", chat_pb2.ListChatsRequest(page_size=2, page_token=token))
        assert len(page.chats) <= 2
        seen += [c.chat_id for c in page.chats]
        token = page.next_page_token
        if not token:
            break
    assert seen == expected


async def test_messages_are_listed_newest_first_page_by_page(
    client: ChatClient, memory_store: MemoryStore
) -> None:
    chat = await client.create_chat("history")
    parent = None
    written = []
    for i in range(7):
        message = Message(
            str(new_id()), chat.chat_id, Role.USER if i % 2 == 0 else Role.ASSISTANT, f"m{i}", parent
        )
        await memory_store.append_message(client.user, message)
        written.append(message.message_id)
        parent = message.message_id

    seen, token = [], ""
    while True:
        page = await client.call(
            "ListMessages", chat_pb2.ListMessagesRequest(chat_id=chat.chat_id, page_size=3, page_token=token)
        )
        seen += [(m.message_id, m.content, m.role) for m in page.messages]
        token = page.next_page_token
        if not token:
            break
    assert [s[0] for s in seen] == list(reversed(written))
    assert seen[0][1:] == ("m6", chat_pb2.ROLE_USER)
    assert seen[1][2] == chat_pb2.ROLE_ASSISTANT


async def test_another_users_chat_is_not_found_for_every_chat_call(client: ChatClient) -> None:
    chat = await client.create_chat("mine")
    intruder = client.as_user(new_user())
    calls = [
        ("GetChat", chat_pb2.GetChatRequest(chat_id=chat.chat_id)),
        ("RenameChat", chat_pb2.RenameChatRequest(chat_id=chat.chat_id, title="theirs")),
        ("DeleteChat", chat_pb2.DeleteChatRequest(chat_id=chat.chat_id)),
        ("ListMessages", chat_pb2.ListMessagesRequest(chat_id=chat.chat_id)),
    ]
    for method, request in calls:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await intruder.call(method, request)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND, method
    for method, request in [
        ("SendMessage", chat_pb2.SendMessageRequest(chat_id=chat.chat_id, content="hi")),
        (
            "RegenerateMessage",
            chat_pb2.RegenerateMessageRequest(chat_id=chat.chat_id, message_id=str(new_id())),
        ),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await intruder.stream(method, request).read()
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND, method
    listed = await intruder.call("ListChats", chat_pb2.ListChatsRequest())
    assert chat.chat_id not in [c.chat_id for c in listed.chats]
    # And the owner still has it, untouched.
    assert (await client.call("GetChat", chat_pb2.GetChatRequest(chat_id=chat.chat_id))).chat.title == "mine"


async def test_a_call_without_identity_metadata_is_unauthenticated(mesh: Mesh) -> None:
    async with grpc.aio.insecure_channel(mesh.orchestrator.address) as channel:
        stub = chat_pb2_grpc.ChatServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.ListChats(chat_pb2.ListChatsRequest(), timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.SendMessage(chat_pb2.SendMessageRequest(chat_id="x", content="hi"), timeout=10).read()
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def search(
    client: ChatClient, query: str, page_size: int = 0, token: str = ""
) -> chat_pb2.SearchChatsResponse:
    request = chat_pb2.SearchChatsRequest(query=query, page_size=page_size, page_token=token)
    return await client.call("SearchChats", request)


async def test_search_finds_the_callers_titles_and_messages_never_another_users_or_deleted_ones(
    client: ChatClient, mesh: Mesh, connect
) -> None:
    trip = await client.create_chat("Lisbon trip")
    other = await client.create_chat("Groceries")
    await client.call(
        "RenameChat", chat_pb2.RenameChatRequest(chat_id=other.chat_id, title="Lisbon groceries")
    )
    hits = (await search(client, "LISBON")).hits
    assert [(h.chat_id, h.chat_title, h.message_id) for h in hits] == [
        (other.chat_id, "Lisbon groceries", ""),
        (trip.chat_id, "Lisbon trip", ""),
    ]
    first = await search(client, "lisbon", page_size=1)
    assert [h.chat_id for h in first.hits] == [other.chat_id] and first.next_page_token
    second = await search(client, "lisbon", page_size=1, token=first.next_page_token)
    assert [h.chat_id for h in second.hits] == [trip.chat_id] and not second.next_page_token

    stranger = connect(mesh.orchestrator.address)
    assert (await search(stranger, "lisbon")).hits == []
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await search(stranger, "lisbon", page_size=1, token=first.next_page_token)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    await client.call("DeleteChat", chat_pb2.DeleteChatRequest(chat_id=other.chat_id))
    assert [h.chat_id for h in (await search(client, "lisbon")).hits] == [trip.chat_id]
    for bad in ("", "?!", "a b c d e f"):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await search(client, bad)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad


@pytest.mark.usefixtures("router_required")
async def test_messages_appended_without_an_answer_follow_the_newest_and_wait_for_a_running_answer(
    client: ChatClient,
) -> None:
    chat = await client.create_chat()
    items = [
        chat_pb2.PromptMessage(role=chat_pb2.ROLE_USER, content="Remember 42."),
        chat_pb2.PromptMessage(role=chat_pb2.ROLE_ASSISTANT, content="Noted."),
    ]
    append = chat_pb2.AppendMessagesRequest(chat_id=chat.chat_id, messages=items)
    first, second = (await client.call("AppendMessages", append)).messages
    assert (first.content, first.parent_id, second.parent_id) == ("Remember 42.", "", first.message_id)
    assert second.role == chat_pb2.ROLE_ASSISTANT and second.model and first.token_count > 0
    for bad, field in (
        ([chat_pb2.PromptMessage(role=chat_pb2.ROLE_SYSTEM, content="Be terse.")], "messages[0].role"),
        ([], "messages"),
        ([chat_pb2.PromptMessage(role=chat_pb2.ROLE_USER, content="  ")], "messages[0].content"),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.call(
                "AppendMessages", chat_pb2.AppendMessagesRequest(chat_id=chat.chat_id, messages=bad)
            )
        assert (
            refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and parse(refused.value).field == field
        )

    # While an answer generates, nothing is added to or taken from the tree it continues.
    call = client.send(
        chat.chat_id, "Tell me a long story.", options=chat_pb2.GenerationOptions(max_tokens=300)
    )
    await read_until(call, 2)
    delete = chat_pb2.DeleteMessageRequest(chat_id=chat.chat_id, message_id=first.message_id)
    for method, request in (("AppendMessages", append), ("DeleteMessage", delete)):
        with pytest.raises(grpc.aio.AioRpcError) as busy:
            await client.call(method, request)
        assert busy.value.code() == grpc.StatusCode.FAILED_PRECONDITION, method
    await collect(call)
    branch = (await client.call("GetBranch", chat_pb2.GetBranchRequest(chat_id=chat.chat_id))).messages
    assert [m.content for m in branch[1:]] == ["Tell me a long story.", "Noted.", "Remember 42."]
