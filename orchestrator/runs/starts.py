"""How a run starts here: the steps every kind of run takes from its request until it is live.

Each kind of run (``send.py``, ``regenerate.py``, ``complete.py``) is one object whose ``execute`` reads
top to bottom; these are the steps it calls, in this order:

    start    the run becomes a task of this replica; the caller waits until it is live (or refused)
    admit    a run slot, then the budget reserved while the router places the request (both at once);
             the run's model is then the one the router placed it with (a cheaper one if degraded)
    ...      the kind persists what it stores (user message, run row)
    generate `started` (the caller is released), then the relay until the end, stored once

A refusal at any step before ``generate`` undoes the steps before it (the reservation is returned, the
router stream cancelled, the slot freed) and nothing is persisted, so a refused send leaves no trace and
can be retried with the same idempotency key.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from opentelemetry import trace

from chatmesh.chat.v1 import chat_pb2
from chatmesh.errors import DRAINING, ServiceError, unavailable
from chatmesh.finish import Usage
from chatmesh.identity import Identity
from chatmesh.limits import Generation
from chatmesh.router.v1 import router_pb2
from memory_store.errors import MemoryStoreError
from memory_store.ids import new_id
from memory_store.models import Run
from orchestrator.policy.admission import Budgets, RunSlots
from orchestrator.prompting.prompt import Prompt
from orchestrator.router_client import GenerateStream, RouterClient, start_frame
from orchestrator.runs.answer_run import AnswerRun, key_reused
from orchestrator.runs.held_run import RunInfo
from orchestrator.runs.held_runs import HeldRuns
from orchestrator.runs.reads import Reads
from orchestrator.runs.relay import Relay, RelayDeps, RunEnd
from orchestrator.runs.run_state import Stop

log = logging.getLogger(__name__)
# What a replica that drains answers new work with (another replica will take it).
SHUTTING_DOWN = "this replica is shutting down; retry (another replica will answer)"
tracer = trace.get_tracer("orchestrator")


@dataclass(frozen=True)
class Admission:
    """A run admitted to generate: its slot, its budget reservation and the router's placed stream."""

    identity: Identity
    info: RunInfo
    prompt: Prompt
    stream: GenerateStream
    # The request the router placed (its seed included): what continues the run if its router dies,
    # and what a stored run keeps for a replica that adopts it.
    start: router_pb2.GenerateStart
    # The id the run's usage is charged under, made as its budget was reserved (memory_store/usage.py):
    # the run is charged in the window it starts in, however old its run id (a key claimed long ago).
    charge_id: str


class Starts:
    def __init__(
        self,
        held: HeldRuns,
        reads: Reads,
        router: RouterClient,
        deps: RelayDeps,
        budgets: Budgets,
        slots: RunSlots,
    ) -> None:
        self.held = held
        self.reads = reads
        self.router = router
        self.deps = deps
        self.config = deps.config
        self.budgets = budgets
        self.slots = slots
        # Runs on their way to going live, by (user, idempotency key): a duplicate (the same request)
        # waits for the same one.
        self._starting: dict[tuple[str, str], AnswerRun] = {}

    async def start(self, run: AnswerRun) -> str:
        """Runs ``run`` as a task of this replica and returns its run id once it is live (or joined an
        earlier run of its idempotency key); a refusal before that is raised here. A duplicate of a run
        still starting (same user, key and request) waits for that one instead of starting its own; a
        different request with its key is ALREADY_EXISTS, as the key's claim would answer it.

        A stored run outlives a caller who goes away; a run nothing could ever attach to (Complete,
        whose client never learnt its run id) is abandoned with a caller who leaves before it is live
        (and, through ``answer``, after).
        """
        key = (run.identity.user_id, run.idempotency_key) if run.idempotency_key else None
        earlier = self._starting.get(key) if key else None
        task = None
        if earlier is not None:
            if earlier.fingerprint != run.fingerprint:
                raise key_reused()  # as its claim would say: the key is another request's
            started = earlier.started
        else:
            started = run.started
            task = self.held.task(self._execute(run), f"{run.kind}-run")
            if key is not None:
                self._starting[key] = run
                started.add_done_callback(lambda _: self._starting.pop(key, None))
        try:
            return await asyncio.shield(started)
        except asyncio.CancelledError:
            if task is not None and not run.outlives_caller and not started.done():
                task.cancel()
            raise

    async def answer(self, run: AnswerRun, merge_deltas: bool = False) -> AsyncIterator[chat_pb2.RunEvent]:
        """Starts ``run`` and follows its events to the end (``merge_deltas``: ``HeldRun.follow``). A run
        that does not outlive its caller (Complete: nobody else could ever follow it) is cancelled when
        the caller leaves, so its engine work, its run slot and the rest of its budget are freed at once."""
        run_id = await self.start(run)
        # A run this request started is followed at once: its chat was read on the way (one it joined
        # is followed as any stream is).
        events = (
            run.live.follow(0, merge_deltas)
            if run.live is not None
            else self.reads.stream(run.identity.user_id, run_id, 0, merge_deltas)
        )
        try:
            async for event in events:
                yield event
        finally:
            if run.live is not None and not run.outlives_caller:
                run.live.stop(Stop.CANCELLED)  # a no-op once the run has ended

    async def _execute(self, run: AnswerRun) -> None:
        try:
            await run.execute()
        except BaseException as exc:
            if run.started.done():
                if not isinstance(exc, Exception):
                    raise
                log.exception("the last step of a %s run failed", run.kind)
            elif isinstance(exc, asyncio.CancelledError):
                run.started.cancel()
            else:
                try:
                    await run.abandoned()  # first, so that the caller's retry finds nothing held
                finally:
                    run.started.set_exception(exc)

    @contextlib.asynccontextmanager
    async def admit(
        self, identity: Identity, info: RunInfo, prompt: Prompt, options: Generation
    ) -> AsyncIterator[Admission]:
        """A run slot, then the budget reserved while the router places the request (a refusal of
        either undoes the other). The block persists what the run stores; if it fails, everything is
        undone, and after it the admission belongs to ``generate``."""
        if self.held.draining:
            raise unavailable(SHUTTING_DOWN, 0.5, reason=DRAINING)  # before anything of it is stored
        # Until the block ends: then the run is live (``generate`` goes on without a pause), or it was
        # refused, though its row may have landed (the reaper continues it: ``Membership.reap_own``).
        with self.held.pending(info.run_id):
            async with self._admitted(identity, info, prompt, options) as admission:
                yield admission

    @contextlib.asynccontextmanager
    async def _admitted(
        self, identity: Identity, info: RunInfo, prompt: Prompt, options: Generation
    ) -> AsyncIterator[Admission]:
        with tracer.start_as_current_span("start run") as span:
            span.set_attribute("chatmesh.run_id", info.run_id)
            self.slots.acquire(identity, info.model)
            charge_id = str(new_id())
            try:
                start = start_frame(
                    info.run_id,
                    prompt.token_ids,
                    options,
                    identity.tier,
                    info.chat_id or identity.user_id,
                    prompt.fingerprint,
                    new_session=info.stored and prompt.opens_session,
                )
                stream = await self._place(identity, charge_id, start, options)
                placed = _as_placed(info, stream.routed)
                # A continuation (another router, another replica) stays on the weights it started on.
                start.model = placed.model
                admission = Admission(identity, placed, prompt, stream, start, charge_id)
                try:
                    yield admission
                except BaseException:
                    stream.abort()
                    with contextlib.suppress(MemoryStoreError, TimeoutError):
                        await self.budgets.release(identity.user_id, charge_id)
                    raise
            except BaseException:
                self.slots.release(identity.user_id)
                raise

    async def _place(
        self, identity: Identity, charge_id: str, start: router_pb2.GenerateStart, options: Generation
    ) -> GenerateStream:
        """Reserves the budget (under ``charge_id``) and has the router place the request, both at once
        (a refusal of either undoes the other): returns the placed stream."""
        estimate = Usage(prompt_tokens=len(start.prompt_token_ids), completion_tokens=options.max_tokens)
        reserve = asyncio.ensure_future(self.budgets.reserve(identity, charge_id, estimate, options.model))
        place = asyncio.ensure_future(
            self.router.place(start, self.config.max_run_s, self.config.placement_timeout_s)
        )
        try:
            await asyncio.gather(reserve, place)
        except BaseException:
            # End the placement (or the placed request) at once.
            if place.done() and not place.cancelled() and place.exception() is None:
                place.result().abort()
            else:
                place.cancel()
            # The budget's verdict is the more useful one to report, so wait for both.
            await asyncio.wait([reserve, place])
            # Only a refusal of the budget's own is sure to have written nothing: a reservation that
            # failed, or was cancelled (the caller left, the replica shuts down), may have its write
            # on its way, and the release, sent after it, is the later write.
            refused = not reserve.cancelled() and isinstance(reserve.exception(), ServiceError)
            if not refused:
                with contextlib.suppress(MemoryStoreError, TimeoutError):
                    await asyncio.shield(self.budgets.release(identity.user_id, charge_id))
            for step in (reserve, place):
                failure = step.exception() if step.done() and not step.cancelled() else None
                if failure is not None:
                    raise failure from None
            raise
        return place.result()

    async def generate(self, run: AnswerRun, admission: Admission, stored_run: Run | None) -> RunEnd:
        """The run goes live with its `started` event (whoever waits in ``start`` is released), then the
        relay streams the answer until it ends and stores the end once. Returns how it ended."""
        info = admission.info
        tools = self.deps.tool_loop(admission.start, info.user_id, info.tier) if stored_run else None
        live = self.held.open(info)
        relay = Relay(self.deps, live, admission.stream, admission.start, stored_run, run.arrived_at, tools)
        run.live = live
        run.started.set_result(info.run_id)
        try:
            return await self.held.relay(relay)
        finally:
            self.slots.release(info.user_id)


def _as_placed(info: RunInfo, routed: router_pb2.GenerateRouted | None) -> RunInfo:
    """The run as the router placed it: its model is the pool's (a cheaper one when degraded)."""
    if routed is None or not routed.model:
        return info
    return dataclasses.replace(info, model=routed.model, degraded=routed.degraded)
