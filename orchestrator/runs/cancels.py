"""How a run is cancelled by its id (CancelRun), on this replica or on the one generating it, and how a
deleted chat's runs here are stopped."""

from __future__ import annotations

import asyncio
import time

from chatmesh.chat.v1 import chat_pb2
from chatmesh.finish import FinishReason
from memory_store.errors import OwnerChanged
from memory_store.models import Run, RunOutcome, RunStatus
from memory_store.store import MemoryStore
from orchestrator import convert
from orchestrator.config import RunConfig
from orchestrator.runs.held_runs import HeldRuns
from orchestrator.runs.reads import Reads, held_proto
from orchestrator.runs.remote_ends import signal_owner
from orchestrator.runs.run_state import Stop


class Cancels:
    def __init__(self, held: HeldRuns, reads: Reads, store: MemoryStore, config: RunConfig) -> None:
        self.held = held
        self.reads = reads
        self.store = store
        self.config = config

    async def cancel(self, user_id: str, run_id: str, answer_within_s: float) -> chat_pb2.Run:
        """Stops the run at once; a finished run is left as it is. A deleted chat's run is NOT_FOUND.

        Answers with the run's end once it is stored; a run of this replica whose end takes longer
        than half of ``answer_within_s`` (the caller's deadline, less the way back) is answered
        CANCELLING instead: it emits nothing more, and its end is stored after the answer. Another
        replica's run is ended in Cassandra after its owner's next checkpoint, waited for half that
        time at most."""
        held = self.held.local(user_id, run_id)
        if held is not None:
            # Half the caller's time at most, so that the answer (CANCELLING, if the end is not stored
            # by then) still reaches it through loops that run seconds late past saturation.
            loop = asyncio.get_running_loop()
            answer_by = loop.time() + answer_within_s / 2
            # Stopped before anything is read: it is the caller's own run (``local``), and its engine
            # work is freed at once however late Cassandra answers (under load, or not at all). A run
            # whose chat was deleted meanwhile is stopped all the same, and NOT_FOUND.
            held.stop(Stop.CANCELLED)
            try:
                async with asyncio.timeout_at(answer_by):
                    await self.reads.check_chat_kept(user_id, held.info.chat_id, run_id)
            except TimeoutError:
                # Cassandra did not tell in time whether the chat is still there: the run, stopped, is
                # answered as it stands rather than not at all.
                return held_proto(held)
            if held.relay is not None:
                longest_s = self.config.cancel_timeout_s + self.config.store_deadline_s
                await held.relay.wait(min(answer_by - loop.time(), longest_s))
            return held_proto(held)
        run = await self.reads.stored(user_id, run_id)
        await self.reads.check_chat_kept(user_id, run.chat_id, run_id)
        if run.status.terminal:
            return convert.run(run)
        # Another replica generates it. Its next checkpoint holds what it streamed until now; then
        # ending the run here wins the run's one conditional finish, and the owner, signalled, sees the
        # end within a couple of seconds and stops its engine work (remote_ends.py).
        run = await self._next_checkpoint(run, answer_within_s / 2)
        if run.status.terminal:
            return convert.run(run)
        try:
            ended = await self.store.finish_run(
                run,
                RunOutcome(
                    status=RunStatus.CANCELLED, last_seq=run.last_seq, finish_reason=FinishReason.CANCELLED
                ),
            )
        except OwnerChanged:
            # Adopted meanwhile (its owner was found dead, by this replica's reaper or another's): its
            # new owner generates it now, so the cancel goes again, and stops it there (the caller
            # read 409 for it, when a cancel came as its owner died).
            return await self.cancel(user_id, run_id, answer_within_s / 2)
        if ended.applied:
            await signal_owner(self.store, run, self.config.store_deadline_s)
        return convert.run(ended.run)

    async def _next_checkpoint(self, run: Run, longest_s: float) -> Run:
        """The run once its owner checkpointed again (or ended), or as it is if no checkpoint comes
        within a few checkpoint intervals (nothing new was generated) or ``longest_s`` (the rest of the
        call's time is the cancel's own)."""
        interval_s = self.config.checkpoint_interval_ms / 1000
        deadline = time.monotonic() + min(longest_s, max(1.0, 3 * interval_s))
        while time.monotonic() < deadline:
            await asyncio.sleep(interval_s / 2)
            latest = await self.store.get_run(run.user_id, run.run_id)
            if latest.last_seq > run.last_seq or latest.status.terminal:
                return latest
        return run

    def cancel_chat(self, user_id: str, chat_id: str) -> None:
        """Stops this replica's runs of a chat (it was deleted: nobody waits for their ends)."""
        for held in self.held.of_chat(user_id, chat_id):
            held.stop(Stop.CANCELLED)
