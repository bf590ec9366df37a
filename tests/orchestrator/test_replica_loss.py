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
import time
from collections.abc import Callable
from datetime import timedelta

import grpc
import pytest

from chatmesh.chat.v1 import chat_pb2
from chatmesh.finish import FinishReason, Usage
from memory_store.base import now
from memory_store.errors import Unavailable
from memory_store.models import RunDelta, RunOutcome, RunStatus
from memory_store.store import MemoryStore
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
from tests.memory_store.builders import checkpoint, start_run

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


async def test_an_adopted_runs_logprobs_cover_every_token_and_those_it_had_streamed_stay_as_they_were(
    mesh: Mesh, connect: Callable[..., ChatClient], memory_store: MemoryStore
) -> None:
    victim, survivor, on_victim, on_survivor = replicas(mesh, connect, FAST_REAPING)
    options = chat_pb2.GenerationOptions()
    options.CopyFrom(ANSWER)
    options.logprobs, options.top_logprobs = True, 3
    try:
        chat = await on_victim.create_chat()
        seen = await read_until(on_victim.send(chat.chat_id, QUESTION, options=options), 40)
        await asyncio.sleep(0.3)  # a checkpoint or two behind what the client saw
        run_id = seen[0].started.run_id
        mesh.launcher.signal(victim.name, signal.SIGKILL)
        lose(mesh, victim)

        streamed = seen + await asyncio.wait_for(collect(on_survivor.stream_run(run_id, 40)), 60)
        assert [e.seq for e in streamed] == list(range(1, len(streamed) + 1)), "a gap or a duplicate"
        assert streamed[-1].HasField("done"), streamed[-1]
        deltas = [e for e in streamed if e.HasField("delta")]
        assert all(len(e.delta.logprobs) == e.delta.token_count for e in deltas)
        assert sum(len(e.delta.logprobs) for e in deltas) == options.max_tokens
        assert all(len(lp.top) == 3 for e in deltas for lp in e.delta.logprobs)

        # Stored: every token's logprobs; those checkpointed before the kill exactly as the victim
        # streamed them, the rest as the survivor computed and streamed them.
        stored = await memory_store.read_run_output(on_survivor.user, run_id)
        assert [d.seq for d in stored] == [e.seq for e in deltas]
        as_streamed = {e.seq: list(e.delta.logprobs) for e in deltas}
        for delta in stored:
            kept = chat_pb2.Delta.FromString(delta.logprobs).logprobs
            assert len(kept) == delta.token_count and list(kept) == as_streamed[delta.seq], delta.seq
        # A stream replayed from the start gives them all again.
        assert await collect(on_survivor.stream_run(run_id, 0)) == streamed
    finally:
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


async def test_a_run_a_lost_replica_ended_without_storing_its_answer_is_settled_by_another(
    mesh: Mesh, connect: Callable[..., ChatClient], memory_store: MemoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a replica leaves when it dies after its finish won but before the request with its answer
    landed (Cassandra failed that one): a run ended, in its index, with no answer in the chat. Another
    replica's reaper stores the answer from the run's stored output."""
    group = f"settle-{time.monotonic_ns()}"  # this test's replicas only
    reaper = mesh.start_orchestrator(replica_group=group, **FAST_REAPING)
    try:
        client = connect(reaper.address)
        chat = await client.create_chat()
        lost = f"replica-lost-{client.user}"
        await memory_store.heartbeat_replica(lost, group=group)
        run, asked = await start_run(
            memory_store, client.user, chat.chat_id, "q", owner=lost, prompt_tokens=9
        )
        output = [RunDelta(2, "Stored ", 1), RunDelta(3, "at last", 2)]
        await checkpoint(memory_store, run, output[:1])

        async def timed_out(*args: object, **kwargs: object) -> None:
            raise Unavailable("Cassandra did not answer in time")

        with monkeypatch.context() as patched:
            patched.setattr(memory_store._db, "write", timed_out)
            with pytest.raises(Unavailable):
                ended = RunOutcome(
                    RunStatus.COMPLETED, 4, FinishReason.STOP, tail=(output[1],), usage=Usage(9, 0, 3)
                )
                await memory_store.finish_run(run, ended, output)
        await memory_store.heartbeat_replica(lost, at=now() - timedelta(seconds=60), group=group)

        deadline = time.monotonic() + 20
        request = chat_pb2.ListMessagesRequest(chat_id=chat.chat_id)
        while len((page := await client.call("ListMessages", request)).messages) < 2:
            assert time.monotonic() < deadline, "the reaper did not settle the run"
            await asyncio.sleep(0.2)
        answer, question = page.messages
        assert question.message_id == asked.message_id
        assert (answer.message_id, answer.content, answer.parent_id) == (
            run.assistant_message_id,
            "Stored at last",
            asked.message_id,
        )
        assert (answer.finish_reason, answer.run_id) == (chat_pb2.FINISH_REASON_STOP, run.run_id)
        reaped = "chatmesh_orchestrator_orphaned_runs"
        assert await reaper.counted(reaped, outcome="settled") == 1
        assert await reaper.counted(reaped) == 1  # nothing adopted or interrupted
    finally:
        mesh.stop_orchestrator(reaper)
