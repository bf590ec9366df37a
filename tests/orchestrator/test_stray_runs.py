"""A replica's own stored runs that it does not relay (a start that failed after its run row landed,
an adoption whose give-back or interrupt write was lost) are continued by its reaper once they are older
than the start lease: the question is answered, the retries that joined the run get the answer, and the
chat stops generating.

The replica that leaves such a run is in this process (``tests/fixtures/in_process.py``) so that a
store call can land and then fail; Cassandra, the router, the engines and the replica a keyed retry
goes to (the shared mesh's orchestrator) are real processes.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

import pytest

from chatmesh.chat.v1 import chat_pb2
from memory_store.errors import Unavailable
from memory_store.store import MemoryStore
from orchestrator.metrics import METRICS
from orchestrator.runs.send import SendRun
from tests.fixtures.answers import ANSWER, QUESTION, assert_answer_complete_and_stored, undisturbed_answer
from tests.fixtures.in_process import At, InProcessReplica, in_process_replica, within
from tests.fixtures.orchestrator import ChatClient, Mesh, answer_text, collect

pytestmark = pytest.mark.usefixtures("router_required")

# A short start lease (placement 3 s + 3 x 2 s of store deadline: 9 s), and a reaper pass twice a second.
QUICK = {
    "placement_timeout_s": 3.0,
    "store_deadline_s": 2.0,
    "heartbeat_interval_s": 0.5,
    "reap_interval_s": 0.5,
    "orphan_after_s": 60.0,
}


async def test_a_run_stored_by_a_start_that_failed_is_answered_and_its_keyed_retry_gets_the_answer(
    mesh: Mesh, connect: Callable[..., ChatClient], memory_store: MemoryStore
) -> None:
    client = connect(mesh.orchestrator.address)
    reference = await undisturbed_answer(client)
    async with in_process_replica(memory_store, mesh.router_address, mesh.replica_group, **QUICK) as replica:
        chat = await client.create_chat()
        key = f"stray-{uuid.uuid4().hex}"
        request = chat_pb2.SendMessageRequest(
            chat_id=chat.chat_id, content=QUESTION, options=ANSWER, idempotency_key=key
        )
        # The question and its run land; the answer to create_run_with_question is lost: the send fails.
        replica.store.fail("create_run_with_question", landed=True)
        with pytest.raises(Unavailable):
            await replica.runs.starts.start(
                SendRun(replica.parts.ctx, replica.identity(client.user), request)
            )
        replica.store.clear("create_run_with_question")
        run = (await client.call("GetChat", chat_pb2.GetChatRequest(chat_id=chat.chat_id))).chat.active_run_id
        assert run, "the failed send left no run: nothing to test"

        # Its keyed retry, on another replica, joins the stored run, and gets the whole answer.
        retried = await within(
            collect(client.send(chat.chat_id, QUESTION, options=ANSWER, idempotency_key=key)),
            60,
            "the keyed retry was not answered",
        )
        assert retried[0].started.run_id == run
        await assert_answer_complete_and_stored(client, chat.chat_id, run, retried, reference)


async def answered_by_the_mesh(
    client: ChatClient,
    chat_id: str,
    run_id: str,
    reference: str | None = None,
    relayed_by: InProcessReplica | None = None,
) -> None:
    """The run is answered whole (by whichever replica goes on with it), its answer is ``reference``
    (None: a run whose prompt is no chat's, with no answer to compare), and its chat stops generating.
    ``relayed_by``: the replica that goes on with it, whose run's end (the ``done`` a stream through
    another replica reads from Cassandra) lands before the answer's writes: they are read once its
    relay has ended."""
    streamed = await within(collect(client.stream_run(run_id)), 60, "the run was not answered")
    if relayed_by is not None:
        await relay_ended(relayed_by, run_id)
    reference = answer_text(streamed) if reference is None else reference
    await assert_answer_complete_and_stored(client, chat_id, run_id, streamed, reference)


async def relay_ended(replica: InProcessReplica, run_id: str) -> None:
    for _ in range(600):
        relayed = any(relay.live.info.run_id == run_id for relay in replica.runs.held.relays())
        if not relayed and not replica.runs.deps.late_ends.holds(run_id):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the relay of run {run_id} did not end within 30s")


async def test_a_run_whose_adoption_could_not_be_given_back_is_continued_by_its_adopter(
    mesh: Mesh, connect: Callable[..., ChatClient], memory_store: MemoryStore
) -> None:
    """An adoption whose read of the run's output fails gives the run back to its silent owner, for a
    later pass to adopt again; when that write fails too, the run is the adopter's, and nothing of it
    is in hand there."""
    client = connect(mesh.orchestrator.address)
    async with in_process_replica(memory_store, mesh.router_address, mesh.replica_group, **QUICK) as replica:
        chat = await client.create_chat()
        orphan = await replica.orphan(memory_store, client.user, chat.chat_id, QUESTION, ANSWER)
        reading = replica.store.hold("read_run_output")
        adoption = asyncio.create_task(replica.runs.adoptions.adopt(orphan, replica.replica_id))
        await within(reading.reached.wait(), 10, "the adoption did not read the run's output")
        # Adopted: the read fails, and so does the write that gives the run back.
        replica.store.fail("read_run_output")
        replica.store.fail("adopt_run")
        reading.release()
        with pytest.raises(Unavailable):
            await adoption
        replica.store.clear("read_run_output")
        replica.store.clear("adopt_run")
        assert (await memory_store.get_run(client.user, orphan.run_id)).owner_id == replica.replica_id

        await answered_by_the_mesh(client, chat.chat_id, orphan.run_id, relayed_by=replica)
        continued = METRICS.registry.get_sample_value(
            "chatmesh_orchestrator_stray_runs_total", {"outcome": "continued"}
        )
        assert continued and continued >= 1


async def test_a_run_whose_start_the_shutdown_cut_short_after_its_row_landed_is_answered_elsewhere(
    mesh: Mesh, connect: Callable[..., ChatClient], memory_store: MemoryStore
) -> None:
    client = connect(mesh.orchestrator.address)
    reference = await undisturbed_answer(client)
    # The replica's group adopts what it leaves (whichever of its replicas claims it first).
    adopted_before = await mesh.counted("chatmesh_orchestrator_orphaned_runs", outcome="adopted")
    # The shutdown cuts the start short (its grace, then the cancel timeout and the store deadline: 3.5 s)
    # before the run's creation gives up on its write (create_run_s, 3 x the store deadline: 6 s).
    quick = {**QUICK, "cancel_timeout_s": 1.0}
    async with in_process_replica(memory_store, mesh.router_address, mesh.replica_group, **quick) as replica:
        chat = await client.create_chat()
        # The question and its run land; Cassandra's answer is slow, past the end of the shutdown.
        creating = replica.store.hold("create_run_with_question", At.LANDED)
        request = chat_pb2.SendMessageRequest(chat_id=chat.chat_id, content=QUESTION, options=ANSWER)
        sending = asyncio.create_task(
            replica.runs.starts.start(SendRun(replica.parts.ctx, replica.identity(client.user), request))
        )
        await within(creating.reached.wait(), 10, "the send did not store its run")
        assert await within(replica.runs.drain.shutdown(0.5), 30, "the drain did not end") == 0
        with pytest.raises(asyncio.CancelledError):
            await sending
        await replica.stop()
    run_id = (await client.call("GetChat", chat_pb2.GetChatRequest(chat_id=chat.chat_id))).chat.active_run_id
    assert run_id
    # Its heartbeat dated for the others, the replica's run is adopted at their next pass.
    await mesh.until_counted("chatmesh_orchestrator_orphaned_runs", adopted_before + 1, 30, outcome="adopted")
    await answered_by_the_mesh(client, chat.chat_id, run_id, reference)
