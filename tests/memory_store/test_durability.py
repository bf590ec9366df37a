"""Acknowledged writes survive kill -9 of the Cassandra process (commitlog_sync: batch)."""

import asyncio

from chatmesh.finish import FinishReason, Usage
from memory_store.errors import MemoryStoreError
from memory_store.models import RunDelta, RunOutcome, RunStatus
from memory_store.store import MemoryStore
from tests.fixtures.cassandra import wait_until_usable
from tests.memory_store.builders import checkpoint, message, new_user, start_run
from tests.memory_store.test_messages import read_all_pages


async def test_acknowledged_writes_survive_kill_9(cassandra_node, memory_store):
    user = new_user()
    chat = await memory_store.create_chat(user, "crash")
    run, asked = await start_run(memory_store, user, chat.chat_id, "will this survive?")
    await checkpoint(memory_store, run, [RunDelta(2, "Yes", 1)])
    finished = await memory_store.finish_run(
        run,
        RunOutcome(
            RunStatus.COMPLETED, 3, FinishReason.STOP, (RunDelta(3, ", it will.", 3),), Usage(9, 0, 4)
        ),
    )
    acknowledged = [asked.message_id, finished.message.message_id]
    enough = asyncio.Event()

    async def writer(n: int) -> None:
        # Appends until the node dies; a message counts only once append_message returned.
        i = 0
        while True:
            written = message(chat.chat_id, f"writer {n} message {i}")
            try:
                await memory_store.append_message(user, written)
            except MemoryStoreError:
                return
            acknowledged.append(written.message_id)
            i += 1
            if len(acknowledged) >= 150:
                enough.set()

    writers = [asyncio.create_task(writer(n)) for n in range(8)]
    await enough.wait()
    cassandra_node.kill()  # SIGKILL while the writers are still writing
    await asyncio.wait_for(asyncio.gather(*writers), timeout=60)
    await asyncio.to_thread(cassandra_node.restart)
    await wait_until_usable(memory_store)

    fresh = await MemoryStore.connect(cassandra_node.store_config)
    try:
        stored = await read_all_pages(fresh, user, chat.chat_id, 200)
        assert set(acknowledged) <= set(stored), (
            f"{len(set(acknowledged) - set(stored))} acknowledged rows lost"
        )
        assert len(stored) == len(set(stored))
        assert (
            await fresh.get_message(user, chat.chat_id, finished.message.message_id)
        ).content == "Yes, it will."
        assert (await fresh.get_run(user, run.run_id)).status is RunStatus.COMPLETED
        assert (await fresh.get_usage(user)).usage == Usage(9, 0, 4)
        assert [c.chat_id for c in (await fresh.list_chats(user)).items] == [chat.chat_id]
    finally:
        await fresh.close()
