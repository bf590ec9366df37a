"""How a run is read by its id: followed from a sequence number to its end, or read as it stands.

Streams attach to the HeldRun while this replica holds it (and for ``finished_ttl_s`` after it ends);
otherwise they are served from Cassandra (``replay.py``), which works on every replica, for finished
runs and for runs another replica is generating. A deleted chat takes its runs with it: by run id they
are NOT_FOUND, as a run that never existed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from chatmesh.chat.v1 import chat_pb2
from chatmesh.errors import not_found
from memory_store.errors import NotFound
from memory_store.models import Run
from memory_store.store import MemoryStore
from orchestrator import convert
from orchestrator.config import RunConfig
from orchestrator.runs import replay
from orchestrator.runs.held_run import HeldRun
from orchestrator.runs.held_runs import HeldRuns


class Reads:
    def __init__(self, held: HeldRuns, store: MemoryStore, config: RunConfig) -> None:
        self.held = held
        self.store = store
        self.config = config

    async def stream(
        self, user_id: str, run_id: str, after_seq: int, merge_deltas: bool = False
    ) -> AsyncIterator[chat_pb2.RunEvent]:
        """Events with seq > after_seq, then live ones until the run ends (from memory or Cassandra;
        with ``merge_deltas``, the deltas waiting at each read as one)."""
        held = self.held.local(user_id, run_id)
        if held is not None:
            await self.check_chat_kept(user_id, held.info.chat_id, run_id)
            async for event in held.follow(after_seq, merge_deltas):
                yield event
            return
        run = await self.stored(user_id, run_id)
        await self.check_chat_kept(user_id, run.chat_id, run_id)
        poll_s = self.config.follow_poll_ms / 1000
        async for event in replay.follow_stored(self.store, user_id, run, after_seq, poll_s, merge_deltas):
            yield event

    async def get(self, user_id: str, run_id: str) -> chat_pb2.Run:
        held = self.held.local(user_id, run_id)
        if held is not None:
            await self.check_chat_kept(user_id, held.info.chat_id, run_id)
            return held_proto(held)
        run = await self.stored(user_id, run_id)
        await self.check_chat_kept(user_id, run.chat_id, run_id)
        return convert.run(run)

    async def stored(self, user_id: str, run_id: str) -> Run:
        try:
            return await self.store.get_run(user_id, run_id)
        except NotFound:
            raise not_found("run", run_id) from None

    async def check_chat_kept(self, user_id: str, chat_id: str, run_id: str) -> None:
        """A deleted chat takes its runs with it: by run id its answers are NOT_FOUND, exactly as a run
        that never existed (stateless completions have no chat)."""
        if not chat_id:
            return
        try:
            await self.store.get_chat(user_id, chat_id)
        except NotFound:
            raise not_found("run", run_id) from None


def held_proto(held: HeldRun) -> chat_pb2.Run:
    """A run held here, as GetRun and CancelRun answer it."""
    return chat_pb2.Run(
        run_id=held.info.run_id,
        chat_id=held.info.chat_id,
        status=held.status,
        last_seq=held.last_seq,
        assistant_message_id=held.info.assistant_message_id,
        create_time=convert.timestamp(held.created_at),
    )
