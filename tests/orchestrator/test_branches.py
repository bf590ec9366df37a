"""The message tree: regenerations and edits are sibling branches, and a prompt follows only the branch
being continued. Titles come from the engine after the first exchange."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from chatmesh.chat.v1 import chat_pb2
from chatmesh.tokenizer import ChatMessage, load_tokenizer
from orchestrator.config import DEFAULT_SYSTEM_PROMPT
from tests.fixtures.orchestrator import ChatClient, answer_text, chat_title, collect

pytestmark = pytest.mark.usefixtures("router_required")


def opts(max_tokens: int = 6) -> chat_pb2.GenerationOptions:
    return chat_pb2.GenerationOptions(max_tokens=max_tokens)


def prompt_tokens(*turns: tuple[str, str]) -> int:
    messages = [ChatMessage("system", DEFAULT_SYSTEM_PROMPT), *(ChatMessage(r, c) for r, c in turns)]
    return len(load_tokenizer().encode_chat(messages))


async def test_regenerating_an_answer_makes_a_sibling_from_the_same_prompt(client: ChatClient) -> None:
    chat = await client.create_chat("regen")
    first = await collect(client.send(chat.chat_id, "Pick a number", options=opts()))
    question_id = first[0].started.user_message_id
    again = await collect(
        client.stream(
            "RegenerateMessage",
            chat_pb2.RegenerateMessageRequest(
                chat_id=chat.chat_id, message_id=first[-1].done.assistant_message_id, options=opts()
            ),
        )
    )
    assert again[0].started.user_message_id == ""
    assert again[-2].usage.prompt_tokens == first[-2].usage.prompt_tokens
    page = await client.call("ListMessages", chat_pb2.ListMessagesRequest(chat_id=chat.chat_id))
    answers = [m for m in page.messages if m.role == chat_pb2.ROLE_ASSISTANT]
    assert {m.message_id for m in answers} == {
        first[-1].done.assistant_message_id,
        again[-1].done.assistant_message_id,
    }
    assert {m.parent_id for m in answers} == {question_id}

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await collect(
            client.stream(
                "RegenerateMessage",
                chat_pb2.RegenerateMessageRequest(chat_id=chat.chat_id, message_id=question_id),
            )
        )
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_an_edit_is_a_sibling_branch_and_its_prompt_leaves_the_other_branch_out(
    client: ChatClient,
) -> None:
    chat = await client.create_chat("edits")
    q1 = await collect(client.send(chat.chat_id, "First question", options=opts()))
    await collect(client.send(chat.chat_id, "Second question", options=opts()))
    a1_id = q1[-1].done.assistant_message_id

    edited = await collect(
        client.send(chat.chat_id, "Second, edited", parent_message_id=a1_id, options=opts())
    )
    assert edited[-2].usage.prompt_tokens == prompt_tokens(
        ("user", "First question"), ("assistant", answer_text(q1)), ("user", "Second, edited")
    )
    # Editing the chat's first message: a new root branch, with nothing before it.
    root = await collect(client.send(chat.chat_id, "First, edited", branch_from_root=True, options=opts()))
    assert root[-2].usage.prompt_tokens == prompt_tokens(("user", "First, edited"))

    page = await client.call("ListMessages", chat_pb2.ListMessagesRequest(chat_id=chat.chat_id))
    by_id = {m.message_id: m for m in page.messages}
    assert by_id[edited[0].started.user_message_id].parent_id == a1_id
    assert by_id[root[0].started.user_message_id].parent_id == ""
    # A send without a parent continues the newest message: the root branch's answer.
    follow = await collect(client.send(chat.chat_id, "And then?", options=opts()))
    page = await client.call("ListMessages", chat_pb2.ListMessagesRequest(chat_id=chat.chat_id))
    by_id = {m.message_id: m for m in page.messages}
    assert by_id[follow[0].started.user_message_id].parent_id == root[-1].done.assistant_message_id
    assert follow[-2].usage.prompt_tokens == prompt_tokens(
        ("user", "First, edited"), ("assistant", answer_text(root)), ("user", "And then?")
    )


async def test_the_engine_titles_a_chat_after_its_first_exchange(client: ChatClient) -> None:
    chat = await client.create_chat()
    assert chat.title == ""
    await collect(client.send(chat.chat_id, "Plan a weekend in Lisbon", options=opts()))
    title = await chat_title(client, chat.chat_id)
    # The null engine's text, cleaned into a title: one line, no trailing punctuation.
    assert 0 < len(title) <= 80 and "\n" not in title and not title.endswith(".")


async def test_a_title_the_user_chose_is_kept(client: ChatClient) -> None:
    chat = await client.create_chat("Mine")
    await collect(client.send(chat.chat_id, "Hello", options=opts()))
    await asyncio.sleep(1.0)  # time for a (wrongly) scheduled title job to land
    assert (await client.call("GetChat", chat_pb2.GetChatRequest(chat_id=chat.chat_id))).chat.title == "Mine"
