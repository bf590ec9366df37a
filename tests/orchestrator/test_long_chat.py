"""A 60-turn chat on a replica with a 512-token window: every prompt fits the window minus max_tokens,
the engine keeps a rolling summary of the older turns in Cassandra, and later prompts use it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from chatmesh.chat.v1 import chat_pb2
from memory_store.store import MemoryStore
from tests.fixtures.orchestrator import ChatClient, Mesh, collect

WINDOW = 512
MAX_TOKENS = 24
TURNS = 60


async def test_a_sixty_turn_chat_stays_inside_the_window_with_a_summary(
    mesh: Mesh, memory_store: MemoryStore, connect: Callable[..., ChatClient]
) -> None:
    with mesh.replica(context_window=WINDOW, summary_max_tokens=64, titles=False) as replica:
        client = connect(replica.address)
        chat = await client.create_chat("long")
        options = chat_pb2.GenerationOptions(max_tokens=MAX_TOKENS)
        prompts, branch = [], []
        for turn in range(TURNS):
            run = await collect(
                client.send(
                    chat.chat_id, f"Turn {turn}: tell me one more thing about the sea.", options=options
                )
            )
            assert run[-1].HasField("done"), run[-1]
            prompts.append(run[-2].usage.prompt_tokens)
            branch += [run[0].started.user_message_id, run[-1].done.assistant_message_id]
        # Sixty exchanges of ~45 tokens are five times the window, yet every prompt fit it.
        assert max(prompts) <= WINDOW - MAX_TOKENS
        assert prompts[-1] > prompts[0]

        summary = (await memory_store.get_branch(client.user, chat.chat_id, None, with_summary=True)).summary
        deadline = time.monotonic() + 30
        while summary is None or summary.through_message_id not in branch[-40:]:
            assert time.monotonic() < deadline, f"no recent summary: {summary}"
            await asyncio.sleep(0.2)
            summary = (
                await memory_store.get_branch(client.user, chat.chat_id, None, with_summary=True)
            ).summary
        assert summary.text and summary.token_count > 0

        # Most prompts after the first summary were built on it (a few may have gone out while a
        # refresh was still being generated: those dropped the oldest turns instead).
        with_summary = await replica.counted("chatmesh_orchestrator_prompts", history="summary")
        assert with_summary >= TURNS // 2
        summaries = await replica.counted(
            "chatmesh_orchestrator_background_jobs", kind="summary", outcome="done"
        )
        assert summaries >= 2
