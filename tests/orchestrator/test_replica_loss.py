"""Losing an orchestrator replica mid-answer: another replica adopts the run and continues it exactly.

Real processes throughout: Cassandra, the router, null engines (deterministic text paced at
MESH_TOKENS_PER_S) and several orchestrator replicas. A replica is killed (-9), paused (SIGSTOP) or
terminated (SIGTERM, its drain) while a client streams an answer from it; the client resumes from its
last sequence number on another replica and must get the rest of the answer with no gap and no
duplicate, and the stored answer must be the streamed one, byte for byte, and the same answer an
undisturbed run gives.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

import grpc

from chatmesh.chat.v1 import chat_pb2
from tests.fixtures.answers import (
    ANSWER,
    QUESTION,
    assert_answer_complete_and_stored,
    undisturbed_answer,
)
from tests.fixtures.orchestrator import (
    ChatClient,
    Mesh,
    OrchestratorProcess,
    answer_text,
    collect,
    events,
    read_until,
)

FAST_REAPING = {"heartbeat_interval_s": 0.5, "orphan_after_s": 2.0, "reap_interval_s": 0.5}


def replicas(
    mesh: Mesh, connect: Callable[..., ChatClient], reaping: dict[str, float], **victim_flags: object
) -> tuple[OrchestratorProcess, OrchestratorProcess, ChatClient, ChatClient]:
    """A replica to lose and one to survive it, and one user's client of each."""
    victim = mesh.start_orchestrator(**reaping, **victim_flags)
    survivor = mesh.start_orchestrator(**reaping)
    on_victim = connect(victim.address)
    return victim, survivor, on_victim, connect(survivor.address, on_victim.user)


async def read_until_told_to_resume(call: grpc.aio.UnaryStreamCall) -> list[chat_pb2.RunEvent]:
    """The rest of a stream from a replica that leaves its run to another: it ends (if it does not
    finish first) with UNAVAILABLE, the client's cue to resume where the run goes on."""
    seen = []
    try:
        async for event in events(call):
            seen.append(event)
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
    return seen


def lose(mesh: Mesh, victim: OrchestratorProcess) -> None:
    mesh.launcher.forget(victim.name)
    mesh.orchestrators.remove(victim)


async def test_a_run_whose_replica_is_killed_is_adopted_and_continued_exactly(
    mesh: Mesh, connect: Callable[..., ChatClient]
) -> None:
    victim, survivor, on_victim, on_survivor = replicas(mesh, connect, FAST_REAPING)
    try:
        chat = await on_victim.create_chat()
        seen = await read_until(on_victim.send(chat.chat_id, QUESTION, options=ANSWER), 40)
        await asyncio.sleep(0.3)  # a checkpoint or two behind what the client saw
        run_id = seen[0].started.run_id
        mesh.launcher.signal(victim.name, signal.SIGKILL)
        lose(mesh, victim)

        # The client saw up to seq 40, more than was checkpointed: it resumes on the survivor.
        rest = await asyncio.wait_for(collect(on_survivor.stream_run(run_id, 40)), 60)
        await assert_answer_complete_and_stored(
            on_survivor, chat.chat_id, run_id, seen + rest, await undisturbed_answer(on_survivor)
        )
        # The budget holds what the run generated, once: prompt + 800, not the reservation twice.
        usage = await on_survivor.call("GetUsage", chat_pb2.GetUsageRequest())
        assert ANSWER.max_tokens * 2 < usage.used_tokens < ANSWER.max_tokens * 2 + 200, usage
    finally:
        # Its fast reaping would take the shared mesh's slower heartbeats for deaths.
        mesh.stop_orchestrator(survivor)


async def test_a_draining_replica_hands_its_runs_over_at_once(
    mesh: Mesh, connect: Callable[..., ChatClient]
) -> None:
    # Replicas lost silently are adopted only after a minute: a quick end here is the hand-over.
    slow_reaping = {"heartbeat_interval_s": 0.5, "orphan_after_s": 60.0, "reap_interval_s": 0.5}
    victim, survivor, on_victim, on_survivor = replicas(mesh, connect, slow_reaping, drain_grace_s=1.5)
    try:
        chat = await on_victim.create_chat()
        call = on_victim.send(chat.chat_id, QUESTION, options=ANSWER)
        seen = await read_until(call, 20)
        mesh.launcher.signal(victim.name, signal.SIGTERM)
        # The stream from the draining replica goes on, then ends with UNAVAILABLE: resume elsewhere.
        seen += await read_until_told_to_resume(call)
        assert not seen[-1].HasField("done") and not seen[-1].HasField("error")
        rest = await asyncio.wait_for(
            collect(on_survivor.stream_run(seen[0].started.run_id, seen[-1].seq)), 30
        )
        await assert_answer_complete_and_stored(
            on_survivor,
            chat.chat_id,
            seen[0].started.run_id,
            seen + rest,
            await undisturbed_answer(on_survivor),
        )
    finally:
        mesh.stop_orchestrator(victim)
        mesh.stop_orchestrator(survivor)


async def test_a_paused_replica_whose_run_was_adopted_leaves_it_to_the_adopter(
    mesh: Mesh, connect: Callable[..., ChatClient]
) -> None:
    victim, survivor, on_victim, on_survivor = replicas(mesh, connect, FAST_REAPING)
    try:
        chat = await on_victim.create_chat()
        call = on_victim.send(chat.chat_id, QUESTION, options=ANSWER)
        seen = await read_until(call, 30)
        run_id = seen[0].started.run_id
        mesh.launcher.signal(victim.name, signal.SIGSTOP)
        await asyncio.sleep(4.0)  # taken for dead and adopted
        mesh.launcher.signal(victim.name, signal.SIGCONT)
        # The woken replica finds the run is the survivor's: its client is told to resume elsewhere.
        seen += await read_until_told_to_resume(call)
        if not seen[-1].HasField("done"):
            seen += await asyncio.wait_for(collect(on_survivor.stream_run(run_id, seen[-1].seq)), 60)
        await assert_answer_complete_and_stored(
            on_survivor, chat.chat_id, run_id, seen, await undisturbed_answer(on_survivor)
        )
        # A fresh replay from the start, on either replica, is the same answer.
        for client in (on_survivor, on_victim):
            assert answer_text(await collect(client.stream_run(run_id))) == answer_text(seen)
    finally:
        mesh.stop_orchestrator(victim)
        mesh.stop_orchestrator(survivor)
