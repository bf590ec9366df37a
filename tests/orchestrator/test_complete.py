"""Complete (the OpenAI-compatible path), ListModels and GetUsage through real processes."""

from __future__ import annotations

import asyncio
import time

import pytest

from chatmesh.chat.v1 import chat_pb2
from chatmesh.tokenizer import ChatMessage, load_tokenizer
from orchestrator.config import DEFAULT_SYSTEM_PROMPT
from tests.fixtures.orchestrator import ChatClient, Mesh, answer_text, collect, kinds

pytestmark = pytest.mark.usefixtures("router_required")


def prompt_message(role: int, content: str) -> chat_pb2.PromptMessage:
    return chat_pb2.PromptMessage(role=role, content=content)


async def test_complete_streams_an_answer_stores_nothing_and_counts_its_tokens(client: ChatClient) -> None:
    before = await client.call("GetUsage", chat_pb2.GetUsageRequest())
    request = chat_pb2.CompleteRequest(
        messages=[
            prompt_message(chat_pb2.ROLE_USER, "Hi"),
            prompt_message(chat_pb2.ROLE_ASSISTANT, "Hello!"),
            prompt_message(chat_pb2.ROLE_USER, "How are you?"),
        ],
        options=chat_pb2.GenerationOptions(max_tokens=10),
    )
    run = await collect(client.stream("Complete", request))
    assert kinds(run) == ["started"] + ["delta"] * (len(run) - 3) + ["usage", "done"]
    started = run[0].started
    assert started.run_id and not started.chat_id and not started.assistant_message_id
    assert run[-1].done.assistant_message_id == ""
    assert answer_text(run)
    # No system message given: the default one is used, and the whole conversation is the prompt.
    expected = load_tokenizer().encode_chat(
        [
            ChatMessage("system", DEFAULT_SYSTEM_PROMPT),
            ChatMessage("user", "Hi"),
            ChatMessage("assistant", "Hello!"),
            ChatMessage("user", "How are you?"),
        ]
    )
    usage = run[-2].usage
    assert usage.prompt_tokens == len(expected) and usage.completion_tokens == 10

    chats = await client.call("ListChats", chat_pb2.ListChatsRequest())
    assert list(chats.chats) == []
    after = await client.call("GetUsage", chat_pb2.GetUsageRequest())
    assert after.used_tokens - before.used_tokens == usage.prompt_tokens + usage.completion_tokens


@pytest.mark.usefixtures("engines_idle")
async def test_a_complete_whose_caller_leaves_is_cancelled_and_charged_what_it_generated(
    client: ChatClient, mesh: Mesh
) -> None:
    # A free user has two run slots; two abandoned answers of 10 s each must not hold them.
    free = client.as_user(client.user, tier="free")
    request = chat_pb2.CompleteRequest(
        messages=[prompt_message(chat_pb2.ROLE_USER, "A long answer, please")],
        options=chat_pb2.GenerationOptions(max_tokens=2000),
    )
    for _ in range(2):
        call = free.stream("Complete", request)
        async for response in call:
            if response.event.HasField("delta"):
                break
        call.cancel()
    # The engine work stops at once, and the caller is charged what was generated, not the estimate.
    deadline = time.monotonic() + 5
    while (used := (await free.call("GetUsage", chat_pb2.GetUsageRequest())).used_tokens) >= 1000:
        assert time.monotonic() < deadline, f"still charged {used} tokens"
        await asyncio.sleep(0.1)
    assert mesh.engine_requests() == 0
    # Both slots are free: a third answer is generated, not refused.
    request.options.max_tokens = 4
    run = await collect(free.stream("Complete", request))
    assert run[-1].HasField("done")


async def test_a_callers_system_message_replaces_the_default(client: ChatClient) -> None:
    request = chat_pb2.CompleteRequest(
        messages=[
            prompt_message(chat_pb2.ROLE_SYSTEM, "Be brief."),
            prompt_message(chat_pb2.ROLE_USER, "Hi"),
        ],
        options=chat_pb2.GenerationOptions(max_tokens=2),
    )
    run = await collect(client.stream("Complete", request))
    expected = load_tokenizer().encode_chat([ChatMessage("system", "Be brief."), ChatMessage("user", "Hi")])
    assert run[-2].usage.prompt_tokens == len(expected)


async def test_list_models_shows_the_served_model_with_its_engines_and_window(
    client: ChatClient, mesh: Mesh
) -> None:
    reply = await client.call("ListModels", chat_pb2.ListModelsRequest())
    [model] = reply.models
    assert model.model_id == load_tokenizer().model_name
    assert model.engines == len(mesh.engines)
    assert model.context_length == 8192
