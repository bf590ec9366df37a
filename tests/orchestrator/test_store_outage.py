"""An answer whose end Cassandra cannot take: the session's Cassandra node is killed (kill -9) while a
real orchestrator streams an answer, and started again after the orchestrator gave up waiting for it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
import pytest

from chatmesh.chat.v1 import chat_pb2
from memory_store.models import RunStatus
from memory_store.store import MemoryStore
from tests.fixtures.cassandra import CassandraTestNode, wait_until_usable
from tests.fixtures.orchestrator import (
    ChatClient,
    MeshFactory,
    answer_text,
    collect,
    read_until,
    wait_until_serving,
)

pytestmark = pytest.mark.usefixtures("router_required")

WAITING = "chatmesh_orchestrator_late_run_ends_waiting"
DONE = "chatmesh_orchestrator_late_run_ends"


async def test_an_end_cassandra_could_not_take_is_stored_by_its_replica_once_it_is_back(
    start_mesh: MeshFactory,
    connect: Callable[..., ChatClient],
    cassandra_node: CassandraTestNode,
    memory_store: MemoryStore,
    client: ChatClient,  # a user of the shared mesh, whose orchestrator loses the node too
) -> None:
    # A mesh of its own, so a replica group of its own: no other replica takes its run for orphaned
    # while Cassandra is down (its heartbeats stop), and nobody but the run's owner can end it.
    mesh = start_mesh(1, "null", engine_flags={"null_tokens_per_s": 20}, finish_retry_s=2, reap_interval_s=1)
    owner = mesh.orchestrator
    shared, client = client, connect(owner.address)
    chat = await client.create_chat()
    call = client.send(chat.chat_id, "Tell me a story.", options=chat_pb2.GenerationOptions(max_tokens=40))
    head = await read_until(call, 3)
    run_id = head[0].started.run_id

    cassandra_node.kill()
    try:
        run = head + await asyncio.wait_for(collect(call), 60)
        # The streams are told after --finish-retry-s, not left waiting for Cassandra.
        error = run[-1].error
        assert error.code == grpc.StatusCode.UNAVAILABLE.name and "stored later" in error.message, run[-1]
        assert await owner.counted(WAITING, suffix="") == 1
    finally:
        await asyncio.to_thread(cassandra_node.restart)
    await wait_until_usable(memory_store)
    # The shared mesh's orchestrator lost the node too, and the tests after this one use it.
    await wait_until_serving(shared)

    # Its replica stores the end it told its streams (the run's status first, then what follows it):
    # the run ends, the chat gets the answer that was streamed, once, and names no run in progress.
    deadline = time.monotonic() + 90
    while await owner.counted(DONE, outcome="stored") == 0:
        assert time.monotonic() < deadline, "the run's end was never stored"
        await asyncio.sleep(0.5)
    stored = await memory_store.get_run(client.user, run_id)
    assert stored.status is RunStatus.FAILED and stored.last_seq == run[-1].seq
    assert stored.error_code == "UNAVAILABLE"
    page = await client.call("ListMessages", chat_pb2.ListMessagesRequest(chat_id=chat.chat_id))
    answers = [m for m in page.messages if m.role == chat_pb2.ROLE_ASSISTANT]
    assert [m.content for m in answers] == [answer_text(run)]
    assert answers[0].finish_reason == chat_pb2.FINISH_REASON_ERROR
    got = (await client.call("GetChat", chat_pb2.GetChatRequest(chat_id=chat.chat_id))).chat
    assert got.active_run_id == ""
    assert await owner.counted(WAITING, suffix="") == 0
    assert await owner.counted(DONE) == 1  # stored, nothing dropped or taken over
