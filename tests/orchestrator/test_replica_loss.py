"""Losing an orchestrator replica mid-answer (kill -9): another replica marks the run interrupted,
keeps the checkpointed output as the stored answer, and streams attached to it end cleanly."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

from chatmesh.chat.v1 import chat_pb2
from tests.fixtures.orchestrator import ChatClient, Mesh, answer_text, collect, events

FAST_REAPING = {"heartbeat_interval_s": 0.5, "orphan_after_s": 2.0, "reap_interval_s": 0.5}


async def test_a_run_whose_replica_is_killed_is_interrupted_with_its_checkpointed_output(
    mesh: Mesh, connect: Callable[..., ChatClient]
) -> None:
    victim = mesh.start_orchestrator(**FAST_REAPING)
    survivor = mesh.start_orchestrator(**FAST_REAPING)
    on_victim = connect(victim.address)
    on_survivor = connect(survivor.address, on_victim.user)
    try:
        chat = await on_victim.create_chat()
        call = on_victim.send(
            chat.chat_id, "A long answer, please", options=chat_pb2.GenerationOptions(max_tokens=3000)
        )
        seen = []
        async for event in events(call):
            seen.append(event)
            if event.seq >= 40:
                break
        await asyncio.sleep(0.5)  # a checkpoint interval or two
        run_id = seen[0].started.run_id
        mesh.launcher.signal(victim.name, signal.SIGKILL)
        mesh.launcher.forget(victim.name)
        mesh.orchestrators.remove(victim)

        # A client that saw up to seq 40 re-attaches on the survivor.
        rest = await asyncio.wait_for(collect(on_survivor.stream_run(run_id, 40)), 30)
        assert rest[-1].error.code == "ABORTED" and "regenerate" in rest[-1].error.message.lower()
        assert [e.seq for e in rest] == list(range(41, 41 + len(rest)))
        assert all(e.HasField("delta") for e in rest[:-1])

        run = (await on_survivor.call("GetRun", chat_pb2.GetRunRequest(run_id=run_id))).run
        assert run.status == chat_pb2.RUN_STATUS_INTERRUPTED
        page = await on_survivor.call("ListMessages", chat_pb2.ListMessagesRequest(chat_id=chat.chat_id))
        answer = page.messages[0]
        assert answer.role == chat_pb2.ROLE_ASSISTANT and answer.finish_reason == chat_pb2.FINISH_REASON_ERROR
        # The stored answer is everything checkpointed: what the client saw plus what it got on resuming.
        assert answer.content == answer_text(seen + rest)
        got = (await on_survivor.call("GetChat", chat_pb2.GetChatRequest(chat_id=chat.chat_id))).chat
        assert got.active_run_id == ""
        # The budget's reservation (prompt + 3000) is reconciled to the prompt and the output kept.
        usage = await on_survivor.call("GetUsage", chat_pb2.GetUsageRequest())
        assert 0 < usage.used_tokens - answer.token_count < 100, (usage.used_tokens, answer.token_count)
        # And a fresh replay from the start is the stored answer with the same end.
        replay = await collect(on_survivor.stream_run(run_id))
        assert answer_text(replay) == answer.content and replay[-1].error.code == "ABORTED"
    finally:
        # Its fast reaping would take the shared mesh's slower heartbeats for deaths.
        mesh.stop_orchestrator(survivor)
