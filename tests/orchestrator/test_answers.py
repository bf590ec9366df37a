"""Answers end to end: orchestrator, router and null engines as processes, chats in a real Cassandra.

The null engines emit a fixed text paced at a known rate, so streams are deterministic and last as long
as ``max_tokens`` says; prompts are real (the model's tokenizer and chat template).
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from chatmesh.chat.v1 import chat_pb2
from chatmesh.tokenizer import ChatMessage, load_tokenizer
from orchestrator.config import DEFAULT_SYSTEM_PROMPT
from tests.fixtures.orchestrator import ChatClient, answer_text, collect, kinds

pytestmark = pytest.mark.usefixtures("router_required")


def options(max_tokens: int = 8, **fields: object) -> chat_pb2.GenerationOptions:
    return chat_pb2.GenerationOptions(max_tokens=max_tokens, **fields)


async def messages(client: ChatClient, chat_id: str) -> list[chat_pb2.Message]:
    """Every message of the chat, oldest first."""
    page = await client.call("ListMessages", chat_pb2.ListMessagesRequest(chat_id=chat_id, page_size=200))
    return list(reversed(page.messages))


async def test_a_send_streams_numbered_events_and_stores_the_exchange(client: ChatClient) -> None:
    chat = await client.create_chat()
    run = await collect(client.send(chat.chat_id, "Hello there", options=options(12)))

    assert kinds(run) == ["started"] + ["delta"] * (len(run) - 3) + ["usage", "done"]
    assert [e.seq for e in run] == list(range(1, len(run) + 1))
    started, usage, done = run[0].started, run[-2].usage, run[-1].done
    assert started.chat_id == chat.chat_id and started.user_message_id and started.assistant_message_id
    assert usage.completion_tokens == 12
    assert sum(e.delta.token_count for e in run if e.HasField("delta")) == 12
    assert done.finish_reason == chat_pb2.FINISH_REASON_LENGTH
    assert done.assistant_message_id == started.assistant_message_id

    stored = await messages(client, chat.chat_id)
    assert [(m.role, m.message_id) for m in stored] == [
        (chat_pb2.ROLE_USER, started.user_message_id),
        (chat_pb2.ROLE_ASSISTANT, started.assistant_message_id),
    ]
    question, answer = stored
    assert question.content == "Hello there" and question.parent_id == ""
    assert answer.content == answer_text(run) and answer.parent_id == question.message_id
    assert answer.finish_reason == chat_pb2.FINISH_REASON_LENGTH
    assert answer.usage.completion_tokens == 12 and answer.run_id == started.run_id


async def test_the_second_turns_prompt_is_the_first_exchange_plus_the_new_message(client: ChatClient) -> None:
    tokenizer = load_tokenizer()
    chat = await client.create_chat("two turns")
    first = await collect(client.send(chat.chat_id, "My name is Ada.", options=options(6)))
    second = await collect(client.send(chat.chat_id, "What is my name?", options=options(6)))

    expected = tokenizer.encode_chat(
        [
            ChatMessage("system", DEFAULT_SYSTEM_PROMPT),
            ChatMessage("user", "My name is Ada."),
            ChatMessage("assistant", answer_text(first)),
            ChatMessage("user", "What is my name?"),
        ]
    )
    assert second[-2].usage.prompt_tokens == len(expected)
    stored = await messages(client, chat.chat_id)
    assert stored[2].parent_id == stored[1].message_id  # the new question follows the first answer


async def test_an_empty_model_name_means_the_default_model(client: ChatClient) -> None:
    chat = await client.create_chat()
    run = await collect(client.send(chat.chat_id, "hi", options=options(2, model="")))
    assert run[0].started.model == load_tokenizer().model_name
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await collect(client.send(chat.chat_id, "hi", options=options(2, model="no-such-model")))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


async def test_text_held_back_for_a_stop_string_and_flushed_at_max_tokens_still_ends_the_run(
    client: ChatClient,
) -> None:
    # The null engines' text depends only on the prompt's length: the same question, the same 7 tokens.
    plain = await collect(
        client.send((await client.create_chat()).chat_id, "Hello there", options=options(7))
    )
    words = [e.delta.text for e in plain if e.HasField("delta")]
    assert len(words) == 7 and len(words[-1]) > 1 and not any(w.endswith(words[-1][-1]) for w in words[:-1])
    # A stop string the 7th token's last character begins: the engine holds it back until max_tokens
    # ends the answer, then flushes it, one delta more than there are tokens.
    stop = words[-1][-1] + "\u2042"
    chat = await client.create_chat()
    call = client.send(chat.chat_id, "Hello there", options=options(7, stop=[stop]))
    run = await asyncio.wait_for(collect(call), 10)

    assert kinds(run) == ["started"] + ["delta"] * 8 + ["usage", "done"]
    assert [e.delta.text for e in run[1:-2]] == [*words[:-1], words[-1][:-1], words[-1][-1]]
    assert run[-1].done.finish_reason == chat_pb2.FINISH_REASON_LENGTH
    # A stream that follows the run from its start gets the same end.
    followed = await asyncio.wait_for(collect(client.stream_run(run[0].started.run_id)), 10)
    assert followed == run
