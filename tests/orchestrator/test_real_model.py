"""The real model (SmolLM2 on the cpu backend) behind the orchestrator: a sane answer comes back, is
stored as streamed, and the engine titles the chat. The only orchestrator test where the text matters."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from chatmesh.chat.v1 import chat_pb2
from tests.fixtures.orchestrator import ChatClient, Mesh, MeshFactory, answer_text, collect


@pytest.fixture(scope="module")
def real_mesh(start_mesh: MeshFactory) -> Mesh:
    return start_mesh(1, "cpu")


@pytest.fixture
def real_client(real_mesh: Mesh, connect: Callable[..., ChatClient]) -> ChatClient:
    return connect(real_mesh.orchestrator.address)


async def test_the_real_model_answers_a_question_and_titles_the_chat(real_client: ChatClient) -> None:
    chat = await real_client.create_chat()
    run = await collect(
        real_client.send(
            chat.chat_id,
            "What is the capital of France? Answer in one sentence.",
            options=chat_pb2.GenerationOptions(max_tokens=40, temperature=0.0),
        )
    )
    text = answer_text(run)
    assert "Paris" in text, text
    assert run[-1].done.finish_reason in (chat_pb2.FINISH_REASON_STOP, chat_pb2.FINISH_REASON_LENGTH)
    page = await real_client.call("ListMessages", chat_pb2.ListMessagesRequest(chat_id=chat.chat_id))
    assert page.messages[0].content == text

    deadline = time.monotonic() + 120
    while not (
        title := (await real_client.call("GetChat", chat_pb2.GetChatRequest(chat_id=chat.chat_id))).chat.title
    ):
        assert time.monotonic() < deadline, "the engine gave the chat no title"
        await asyncio.sleep(0.5)
    assert 0 < len(title) <= 80 and "\n" not in title
