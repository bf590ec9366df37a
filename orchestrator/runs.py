"""Runs on this replica: starting them, attaching streams, reading their state, cancelling them.

    start: run slot ─► budget reservation ─► router places the request ─► persist (user message, run)
           ─► LiveRun with `started` ─► Generation task (owned here, not by any client)

A refusal at any step undoes the steps before it (the reservation is returned, the router stream
cancelled) and nothing is persisted, so a refused send leaves no trace and can be retried with the
same idempotency key. Streams attach to the LiveRun while this replica holds it (and for
``finished_ttl_s`` after it ends); otherwise they are served from Cassandra (``replay.py``), which
works on every replica, for finished runs and for runs another replica is generating.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from chatmesh.chat.v1 import chat_pb2
from chatmesh.errors import not_found, unavailable
from chatmesh.identity import Identity
from chatmesh.limits import Generation as GenerationOptions
from memory_store.errors import MemoryStoreError, NotFound
from memory_store.models import FinishReason, Run, RunOutcome, RunStatus, Usage
from memory_store.store import MemoryStore
from orchestrator import convert, replay
from orchestrator.admission import Budgets, RunSlots
from orchestrator.config import RunConfig
from orchestrator.generation import Generation, RunDeps, RunEnd, Stop
from orchestrator.live_run import LiveRun, RunInfo
from orchestrator.prompt import Prompt
from orchestrator.router_client import GenerateStream, RouterClient, start_frame

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunRequest:
    identity: Identity
    info: RunInfo
    prompt: Prompt
    options: GenerationOptions
    # When the request arrived (time.monotonic), for time to first token.
    arrived_at: float
    # Stores what the run needs (user message, run row) once the router has placed the request;
    # returns the stored run, or None for runs that are not stored (Complete).
    persist: Callable[[], Awaitable[Run | None]]
    # Called when the run has ended and its end is stored (titles, summaries, budget of Complete).
    on_end: Callable[[RunEnd], Awaitable[None]]


class Runs:
    def __init__(
        self,
        store: MemoryStore,
        router: RouterClient,
        deps: RunDeps,
        budgets: Budgets,
        slots: RunSlots,
        tokenizer_fingerprint: str,
    ) -> None:
        self.store = store
        self.router = router
        self.deps = deps
        self.config: RunConfig = deps.config
        self.budgets = budgets
        self.slots = slots
        self.fingerprint = tokenizer_fingerprint
        self.draining = False
        self._live: dict[str, LiveRun] = {}
        self._generations: dict[str, Generation] = {}

    # -- starting -------------------------------------------------------------------------------

    async def start(self, request: RunRequest) -> LiveRun:
        if self.draining:
            raise unavailable("this replica is shutting down; retry (another replica will answer)", 0.5)
        identity, info = request.identity, request.info
        self.slots.acquire(identity)
        try:
            stream = await self._admit(request)
            try:
                stored_run = await request.persist()
            except BaseException:
                stream.abort()
                with contextlib.suppress(MemoryStoreError, TimeoutError):
                    await self.budgets.release(identity.user_id, info.run_id)
                raise
        except BaseException:
            self.slots.release(identity.user_id)
            raise
        live = LiveRun(info, self.config.max_subscribers_per_run)
        live.append(
            started=chat_pb2.RunStarted(
                run_id=info.run_id,
                chat_id=info.chat_id,
                user_message_id=info.user_message_id,
                assistant_message_id=info.assistant_message_id,
                model=info.model,
            )
        )

        async def ended(end: RunEnd) -> None:
            self.slots.release(identity.user_id)
            self._generations.pop(info.run_id, None)
            await request.on_end(end)

        generation = Generation(
            self.deps, live, stream, len(request.prompt.token_ids), stored_run, request.arrived_at, ended
        )
        self._live[info.run_id] = live
        self._generations[info.run_id] = generation
        generation.start()
        return live

    async def _admit(self, request: RunRequest) -> GenerateStream:
        """Reserves the budget and has the router place the request, both at once (a refusal of either
        undoes the other): returns the placed stream."""
        identity, info = request.identity, request.info
        estimate = Usage(
            prompt_tokens=len(request.prompt.token_ids), completion_tokens=request.options.max_tokens
        )
        stream = self.router.generate(self.config.max_run_s)
        start = start_frame(
            info.run_id,
            request.prompt.token_ids,
            request.options,
            identity.tier,
            info.chat_id or identity.user_id,
            self.fingerprint,
        )
        reserve = asyncio.ensure_future(self.budgets.reserve(identity, info.run_id, estimate))
        place = asyncio.ensure_future(stream.open(start, self.config.placement_timeout_s))
        try:
            await asyncio.gather(reserve, place)
        except BaseException:
            stream.abort()  # ends the placement (or the placed request) at once
            # The budget's verdict is the more useful one to report, so wait for both.
            await asyncio.wait([reserve, place])
            if reserve.done() and not reserve.cancelled() and reserve.exception() is None:
                with contextlib.suppress(MemoryStoreError, TimeoutError):
                    await self.budgets.release(identity.user_id, info.run_id)
            for step in (reserve, place):
                if step.done() and not step.cancelled() and step.exception() is not None:
                    raise step.exception() from None
            raise
        return stream

    def is_live(self, run_id: str) -> bool:
        return run_id in self._live

    # -- reading --------------------------------------------------------------------------------

    def _local(self, user_id: str, run_id: str) -> LiveRun | None:
        live = self._live.get(run_id)
        if live is None or live.info.user_id != user_id:
            return None
        return live

    async def stream(self, user_id: str, run_id: str, after_seq: int) -> AsyncIterator[chat_pb2.RunEvent]:
        """Events with seq > after_seq, then live ones until the run ends (from memory or Cassandra)."""
        live = self._local(user_id, run_id)
        if live is not None:
            async for event in live.follow(after_seq):
                yield event
            return
        run = await self._stored(user_id, run_id)
        poll_s = self.config.follow_poll_ms / 1000
        async for event in replay.follow_stored(self.store, user_id, run, after_seq, poll_s):
            yield event

    async def get(self, user_id: str, run_id: str) -> chat_pb2.Run:
        live = self._local(user_id, run_id)
        if live is not None:
            return _live_proto(live)
        return convert.run(await self._stored(user_id, run_id))

    async def _stored(self, user_id: str, run_id: str) -> Run:
        try:
            return await self.store.get_run(user_id, run_id)
        except NotFound:
            raise not_found("run", run_id) from None

    # -- cancelling -----------------------------------------------------------------------------

    async def cancel(self, user_id: str, run_id: str) -> chat_pb2.Run:
        """Stops the run at once; a finished run is left as it is."""
        live = self._local(user_id, run_id)
        if live is not None:
            generation = self._generations.get(run_id)
            if generation is not None:
                await generation.stop(Stop.CANCELLED)
                await generation.wait(self.config.cancel_timeout_s + self.config.store_deadline_s)
            return _live_proto(live)
        run = await self._stored(user_id, run_id)
        if run.status.terminal:
            return convert.run(run)
        # Another replica generates it. Its next checkpoint holds what it streamed until now; then
        # ending the run here wins the run's one conditional finish, and the owner sees the end
        # within a couple of seconds and stops its engine work.
        run = await self._next_checkpoint(run)
        if run.status.terminal:
            return convert.run(run)
        ended = await self.store.finish_run(
            run,
            RunOutcome(
                status=RunStatus.CANCELLED, last_seq=run.last_seq, finish_reason=FinishReason.CANCELLED
            ),
        )
        return convert.run(ended.run)

    async def _next_checkpoint(self, run: Run) -> Run:
        """The run once its owner checkpointed again (or ended), or as it is if no checkpoint comes
        within a few checkpoint intervals (nothing new was generated)."""
        interval_s = self.config.checkpoint_interval_ms / 1000
        deadline = time.monotonic() + max(1.0, 3 * interval_s)
        while time.monotonic() < deadline:
            await asyncio.sleep(interval_s / 2)
            latest = await self.store.get_run(run.user_id, run.run_id)
            if latest.last_seq > run.last_seq or latest.status.terminal:
                return latest
        return run

    async def cancel_chat(self, user_id: str, chat_id: str) -> None:
        """Stops this replica's runs of a chat (it was deleted)."""
        for live in list(self._live.values()):
            if live.info.user_id == user_id and live.info.chat_id == chat_id and not live.finished:
                await self.cancel(user_id, live.info.run_id)

    # -- upkeep ---------------------------------------------------------------------------------

    def sweep(self) -> None:
        """Forgets finished runs older than ``finished_ttl_s`` (Cassandra serves them from then on)."""
        horizon = time.monotonic() - self.config.finished_ttl_s
        for run_id, live in list(self._live.items()):
            if live.finished_at is not None and live.finished_at < horizon and not live.subscribers:
                del self._live[run_id]

    async def shutdown(self, grace_s: float) -> None:
        """Lets runs finish for ``grace_s``, then stops the rest as interrupted (their output so far is
        stored, so a client resuming elsewhere gets it and the end of the run)."""
        self.draining = True
        generations = list(self._generations.values())
        if not generations:
            return
        log.info("waiting up to %.0fs for %d runs to finish", grace_s, len(generations))
        await asyncio.gather(*(g.wait(grace_s) for g in generations))
        left = [g for g in generations if not g.live.finished]
        if left:
            log.warning("interrupting %d runs still generating", len(left))
            for generation in left:
                await generation.stop(Stop.INTERRUPTED)
            await asyncio.gather(
                *(g.wait(self.config.cancel_timeout_s + self.config.store_deadline_s) for g in left)
            )


def _live_proto(live: LiveRun) -> chat_pb2.Run:
    return chat_pb2.Run(
        run_id=live.info.run_id,
        chat_id=live.info.chat_id,
        status=live.status,
        last_seq=live.last_seq,
        assistant_message_id=live.info.assistant_message_id,
        create_time=convert.timestamp(live.created_at),
    )
