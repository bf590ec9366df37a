"""A replica's drain hands over every run it holds, including those that go live while it drains.

The draining replica runs in this process (``tests/fixtures/in_process.py``, wired as the server wires
it) so that a run can be held on its way to going live (its placement, its adoption's write) while the
drain starts, and released once the drain has looked at what is live. Cassandra, the router, the
engines and the replica that takes the runs over (the shared mesh's orchestrator, of the same group)
are real processes. A replica killed or terminated as a process: test_replica_loss.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from chatmesh.chat.v1 import chat_pb2
from memory_store.store import MemoryStore
from orchestrator.runs.send import SendRun
from tests.fixtures.answers import ANSWER, QUESTION, assert_answer_complete_and_stored, undisturbed_answer
from tests.fixtures.in_process import InProcessReplica, in_process_replica, within
from tests.fixtures.orchestrator import ChatClient, Mesh, collect

pytestmark = pytest.mark.usefixtures("router_required")

# The drain's grace: 1 s, both runs go live within it and are still generating when it ends (then
# handed over with the others); none, they go live after it (then handed over as they go live).
GRACES_S = {"within_the_grace": 1.0, "after_the_grace": 0.0}
# The shared orchestrator adopts a run handed over at its next reaper pass (every 5 s).
TAKEN_OVER_WITHIN_S = 30.0
ORPHANED = "chatmesh_orchestrator_orphaned_runs"


async def drain_started(drainer: InProcessReplica, grace_s: float) -> asyncio.Task[int]:
    """The drain, started and past its look at the runs live: they are all it takes for those the
    replica holds (its first step, before it awaits anything)."""
    draining = asyncio.create_task(drainer.runs.drain.shutdown(grace_s))
    await asyncio.sleep(0)  # the task's first step runs before this one's next
    assert drainer.runs.held.draining
    return draining


@pytest.mark.parametrize("grace_s", GRACES_S.values(), ids=GRACES_S.keys())
async def test_runs_that_go_live_during_a_drain_are_handed_over_and_answered_elsewhere(
    mesh: Mesh, connect: Callable[..., ChatClient], memory_store: MemoryStore, grace_s: float
) -> None:
    # The drainer's group: its replicas adopt what the drainer hands over (whichever claims it first).
    client = connect(mesh.orchestrator.address)
    group = mesh.replica_group
    adopted_before = await mesh.counted(ORPHANED, outcome="adopted")
    reference = await undisturbed_answer(client)
    async with in_process_replica(
        memory_store, mesh.router_address, group, orphan_after_s=60.0, store_deadline_s=3.0
    ) as drainer:
        # A send past the draining check, held in its placement.
        chat = await client.create_chat()
        placing = drainer.router.hold("place")
        request = chat_pb2.SendMessageRequest(chat_id=chat.chat_id, content=QUESTION, options=ANSWER)
        sending = asyncio.create_task(
            drainer.runs.starts.start(SendRun(drainer.parts.ctx, drainer.identity(client.user), request))
        )
        await within(placing.reached.wait(), 10, "the send did not reach its placement")
        # An adoption under way (its reaper found a silent replica's run), held at its write.
        adopted_chat = (await client.create_chat()).chat_id
        orphan = await drainer.orphan(memory_store, client.user, adopted_chat, QUESTION, ANSWER)
        adopting = drainer.store.hold("adopt_run")
        adoption = asyncio.create_task(drainer.runs.adoptions.adopt(orphan, drainer.replica_id))
        await within(adopting.reached.wait(), 10, "the adoption did not reach its write")

        draining = await drain_started(drainer, grace_s)
        placing.release()
        adopting.release()
        run_id = await within(sending, 10, "the send did not go live")
        assert await within(adoption, 10, "the adoption did not end")
        handed_over = await within(draining, 30, "the drain did not end")
        await drainer.stop()

    assert handed_over == 2
    # Both are adopted at once by the group's replicas (their next reaper pass), and
    # answered there, whole; the chats are no longer generating. (Streams are opened once it holds
    # them: a stream it replays from Cassandra may get `done` from the stored end a moment before its
    # own GetRun, from the run it holds, says so.)
    await mesh.until_counted(ORPHANED, adopted_before + 2, TAKEN_OVER_WITHIN_S, outcome="adopted")
    sent = await within(collect(client.stream_run(run_id)), TAKEN_OVER_WITHIN_S, "the send was not answered")
    await assert_answer_complete_and_stored(client, chat.chat_id, run_id, sent, reference)
    continued = await within(
        collect(client.stream_run(orphan.run_id)), TAKEN_OVER_WITHIN_S, "the adopted run was not answered"
    )
    assert continued[-1].HasField("done"), continued[-1]
    got = (await client.call("GetChat", chat_pb2.GetChatRequest(chat_id=adopted_chat))).chat
    assert got.active_run_id == ""
    assert await mesh.counted(ORPHANED, outcome="adopted") == adopted_before + 2
