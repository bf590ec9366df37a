"""The real model (SmolLM2 on the cpu backend) behind the orchestrator: a sane answer comes back, is
stored as streamed, and the engine titles the chat; a sampled answer whose replica dies is continued
token for token, a constrained one with its constraint. The orchestrator tests where the text matters."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Callable

import jsonschema
import pytest

from chatmesh.chat.v1 import chat_pb2
from tests.fixtures.orchestrator import (
    ChatClient,
    Mesh,
    MeshFactory,
    answer_text,
    chat_title,
    collect,
    read_until,
)

SENDS_TO_FIND_A_LONG_ANSWER = 5


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

    title = await chat_title(real_client, chat.chat_id, within_s=120)
    assert 0 < len(title) <= 80 and "\n" not in title


async def test_a_sampled_answer_adopted_after_its_replica_died_goes_on_token_for_token(
    real_mesh: Mesh, connect: Callable[..., ChatClient]
) -> None:
    # Checkpoints lag the stream (every second), so the client sees output the adopter must regenerate:
    # with temperature > 0 and no seed of the caller's, only the run's own seed makes it the same text.
    fast_reaping = {"heartbeat_interval_s": 0.5, "orphan_after_s": 2.0, "reap_interval_s": 0.5}
    victim = real_mesh.start_orchestrator(checkpoint_events=1000, checkpoint_interval_ms=1000, **fast_reaping)
    survivor = real_mesh.start_orchestrator(**fast_reaping)
    on_victim = connect(victim.address)
    on_survivor = connect(survivor.address, on_victim.user)
    try:
        # The run's seed is its own, so a sampled answer may end within 40 tokens (CI saw one of 16):
        # the replica is lost only under an answer still going, and a few sends find one.
        options = chat_pb2.GenerationOptions(max_tokens=160, temperature=0.9)
        for _ in range(SENDS_TO_FIND_A_LONG_ANSWER):
            chat = await on_victim.create_chat()
            seen = await read_until(
                on_victim.send(
                    chat.chat_id,
                    "Write a long story about a dragon who learns to bake bread.",
                    options=options,
                ),
                40,
            )
            if not seen[-1].HasField("done"):
                break
        assert not seen[-1].HasField("done"), "every answer ended before the replica could be lost"
        real_mesh.launcher.signal(victim.name, signal.SIGKILL)
        real_mesh.launcher.forget(victim.name)
        real_mesh.orchestrators.remove(victim)

        rest = await asyncio.wait_for(
            collect(on_survivor.stream_run(seen[0].started.run_id, seen[-1].seq)), 120
        )
        streamed = seen + rest
        assert [e.seq for e in streamed] == list(range(1, len(streamed) + 1))
        assert streamed[-1].HasField("done"), streamed[-1]
        page = await on_survivor.call("ListMessages", chat_pb2.ListMessagesRequest(chat_id=chat.chat_id))
        [answer] = [m for m in page.messages if m.role == chat_pb2.ROLE_ASSISTANT]
        # What the lost replica streamed after its last checkpoint was regenerated exactly.
        assert answer.content == answer_text(streamed)
    finally:
        real_mesh.stop_orchestrator(survivor)


async def test_a_constrained_answer_adopted_after_its_replica_died_keeps_its_constraint(
    real_mesh: Mesh, connect: Callable[..., ChatClient]
) -> None:
    """The constraint travels in the run's stored generation: the adopter's engine re-applies it, so the
    tokens it regenerates after the last checkpoint are the lost replica's (a continuation without the
    mask would differ) and the whole answer validates."""
    schema = {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 60},
            "story": {"type": "string", "minLength": 300, "maxLength": 600},
        },
        "required": ["title", "story"],
        "additionalProperties": False,
    }
    fast_reaping = {"heartbeat_interval_s": 0.5, "orphan_after_s": 2.0, "reap_interval_s": 0.5}
    victim = real_mesh.start_orchestrator(checkpoint_events=1000, checkpoint_interval_ms=1000, **fast_reaping)
    survivor = real_mesh.start_orchestrator(**fast_reaping)
    on_victim = connect(victim.address)
    on_survivor = connect(survivor.address, on_victim.user)
    try:
        options = chat_pb2.GenerationOptions(
            max_tokens=400,
            temperature=0.9,
            structured=chat_pb2.StructuredOutput(json_schema=json.dumps(schema)),
        )
        chat = await on_victim.create_chat()
        # At least 300 characters of story: the answer is still going after 40 events; at most 600, so
        # it ends within max_tokens.
        seen = await read_until(
            on_victim.send(chat.chat_id, "Write a story about a dragon.", options=options), 40
        )
        assert not seen[-1].HasField("done")
        real_mesh.launcher.signal(victim.name, signal.SIGKILL)
        real_mesh.launcher.forget(victim.name)
        real_mesh.orchestrators.remove(victim)

        rest = await asyncio.wait_for(
            collect(on_survivor.stream_run(seen[0].started.run_id, seen[-1].seq)), 180
        )
        streamed = seen + rest
        assert [e.seq for e in streamed] == list(range(1, len(streamed) + 1))
        assert streamed[-1].done.finish_reason == chat_pb2.FINISH_REASON_STOP, streamed[-1]
        page = await on_survivor.call("ListMessages", chat_pb2.ListMessagesRequest(chat_id=chat.chat_id))
        [answer] = [m for m in page.messages if m.role == chat_pb2.ROLE_ASSISTANT]
        assert answer.content == answer_text(streamed)
        jsonschema.validate(json.loads(answer.content), schema)
    finally:
        real_mesh.stop_orchestrator(survivor)
