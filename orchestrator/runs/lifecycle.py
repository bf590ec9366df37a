"""The runs of this replica: the steps every kind of run shares, and the runs in memory.

Each kind of run (``send.py``, ``regenerate.py``, ``complete.py``) is one object whose ``execute`` reads
top to bottom; these are the steps it calls, in this order:

    start    the run becomes a task of this replica; the caller waits until it is live (or refused)
    admit    a run slot, then the budget reserved while the router places the request (both at once);
             the run's model is then the one the router placed it with (a cheaper one if degraded)
    ...      the kind persists what it stores (user message, run row)
    generate `started` (the caller is released), then the relay until the end, stored once

A refusal at any step before ``generate`` undoes the steps before it (the reservation is returned, the
router stream cancelled, the slot freed) and nothing is persisted, so a refused send leaves no trace and
can be retried with the same idempotency key. Streams attach to the LiveRun while this replica holds it
(and for ``finished_ttl_s`` after it ends); otherwise they are served from Cassandra (``replay.py``),
which works on every replica, for finished runs and for runs another replica is generating.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import TypeVar

from google.protobuf.message import DecodeError
from opentelemetry import trace

from chatmesh.chat.v1 import chat_pb2
from chatmesh.errors import DRAINING, ServiceError, not_found, unavailable
from chatmesh.identity import Identity
from chatmesh.limits import Generation
from chatmesh.router.v1 import router_pb2
from chatmesh.tiers import tier_of_proto
from chatmesh.tool_format import ToolCall
from memory_store.errors import MemoryStoreError, NotFound, OwnerChanged
from memory_store.ids import new_id
from memory_store.models import FinishReason, Run, RunDelta, RunOutcome, RunStatus, Usage
from memory_store.store import MemoryStore
from meshkit.pacing import StreamPacer
from orchestrator import convert
from orchestrator.config import RunConfig
from orchestrator.metrics import METRICS
from orchestrator.policy.admission import Budgets, RunSlots
from orchestrator.prompting.prompt import Prompt
from orchestrator.router_client import GenerateStream, RouterClient, continued, start_frame
from orchestrator.runs import replay
from orchestrator.runs.answer_run import AnswerRun, key_reused
from orchestrator.runs.live_run import LiveRun, RunInfo
from orchestrator.runs.relay import Relay, RelayDeps, RunEnd, Stop
from orchestrator.runs.tool_steps import ToolLoop, result_of, result_record, step_event

log = logging.getLogger(__name__)
T = TypeVar("T")
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


class Runs:
    def __init__(
        self,
        store: MemoryStore,
        router: RouterClient,
        deps: RelayDeps,
        budgets: Budgets,
        slots: RunSlots,
    ) -> None:
        self.store = store
        self.router = router
        self.deps = deps
        self.config: RunConfig = deps.config
        self.budgets = budgets
        self.slots = slots
        self.draining = False
        # Set once a draining replica's grace is over: every run still live here is handed over.
        self._handing_over = False
        # Runs handed over to another replica at shutdown, for ``Replica.leave``.
        self.handed_over = 0
        self.pacer = StreamPacer(self.config.stream_interval_max_ms / 1000)
        METRICS.stream_interval.set_function(lambda: self.pacer.interval_s)
        self._live: dict[str, LiveRun] = {}
        self._relays: dict[str, Relay] = {}
        # Every run task, from `start` to its last step: the replica holds them, no client does.
        self._tasks: set[asyncio.Task[object]] = set()
        # Adopted runs asked to stop while they are being placed again: stopped once placed.
        self._stop_when_placed: dict[str, Stop] = {}
        # Runs on their way to going live, by (user, idempotency key): a duplicate (the same request)
        # waits for the same one.
        self._starting: dict[tuple[str, str], AnswerRun] = {}
        # The ids of runs admitted here and not yet live, and of adoptions under way (``holds``).
        self._pending: set[str] = set()

    # -- the steps of a run, in order ------------------------------------------------------------

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
            task = self._task(self._execute(run), f"{run.kind}-run")
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
        """Starts ``run`` and follows its events to the end (``merge_deltas``: ``LiveRun.follow``). A run
        that does not outlive its caller (Complete: nobody else could ever follow it) is cancelled when
        the caller leaves, so its engine work, its run slot and the rest of its budget are freed at once."""
        run_id = await self.start(run)
        # A run this request started is followed at once: its chat was read on the way (one it joined
        # is followed as any stream is).
        events = (
            run.live.follow(0, merge_deltas)
            if run.live is not None
            else self.stream(run.identity.user_id, run_id, 0, merge_deltas)
        )
        try:
            async for event in events:
                yield event
        finally:
            relay = self._relays.get(run_id)
            if relay is not None and not run.outlives_caller:
                relay.stop(Stop.CANCELLED)  # a no-op once the run has ended

    def _task(self, work: Coroutine[object, object, T], name: str) -> asyncio.Task[T]:
        """``work`` as a task of this replica (``shutdown`` waits for it, then cancels it)."""
        task = asyncio.create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

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
        if self.draining:
            raise unavailable(SHUTTING_DOWN, 0.5, reason=DRAINING)  # before anything of it is stored
        # Until the block ends: then the run is live (``generate`` goes on without a pause), or it was
        # refused, though its row may have landed (the reaper continues it: ``Replica.reap_own``).
        self._pending.add(info.run_id)
        try:
            async with self._admitted(identity, info, prompt, options) as admission:
                yield admission
        finally:
            self._pending.discard(info.run_id)

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
        live = LiveRun(info, self.config.max_subscribers_per_run, self.pacer)
        live.append(started=_started(info))
        tools = self.deps.tool_loop(admission.start, info.user_id, info.tier) if stored_run else None
        relay = Relay(self.deps, live, admission.stream, admission.start, stored_run, run.arrived_at, tools)
        run.live = live
        run.started.set_result(info.run_id)
        try:
            return await self._relay(relay)
        finally:
            self.slots.release(info.user_id)

    async def _relay(self, relay: Relay) -> RunEnd:
        """Relays a run held here to its end (or until another replica goes on with it)."""
        run_id = relay.live.info.run_id
        self._live[run_id] = relay.live
        self._relays[run_id] = relay
        if self._handing_over:  # it went live after the drain's grace: it goes on elsewhere at once
            self._leave_at_shutdown(relay)
        try:
            return await relay.run()
        finally:
            self._relays.pop(run_id, None)
            if relay.live.handed_over and relay.stop_reason is Stop.HANDED_OVER:
                self.handed_over += 1
            if relay.live.handed_over:
                # New streams of the run follow it where it goes on (through Cassandra from here).
                self._live.pop(run_id, None)

    async def adopt(self, orphan: Run, replica_id: str) -> bool:
        """Continues here a run whose replica was found dead (or handed it over at shutdown): the
        run's output up to its last checkpoint is kept, and the generation goes on from the token
        after it, through the router, with the run's own seed: the rest of the answer, its events and
        their sequence numbers are the ones the lost replica would have produced. Returns whether this
        replica adopted it (another replica may have been first); a run that cannot be continued
        (stored before runs kept their generation) is ended as interrupted instead.

        ``orphan`` may be this replica's own run, one it does not hold (``Replica.reap_own``): it is
        continued the same way."""
        if self.draining or self.holds(orphan.run_id):
            return False
        # A task of the replica's from the start, so that a drain waits for it (and it goes on if the
        # reaper's pass gives up waiting: a run made ours must go on here).
        self._pending.add(orphan.run_id)
        adoption = self._task(self._adopt(orphan, replica_id), "adoption")
        adoption.add_done_callback(lambda _: self._pending.discard(orphan.run_id))
        return await asyncio.shield(adoption)

    async def _adopt(self, orphan: Run, replica_id: str) -> bool:
        run = await self.store.adopt_run(orphan, replica_id)
        if run is None:
            return False
        if orphan.owner_id != replica_id:
            await self._signal_owner(orphan)  # in case it was only paused: it must stop generating
        try:
            output = await self.store.read_run_output(run.user_id, run.run_id)
        except Exception:
            # Given back to the silent replica, a later pass (here or elsewhere) adopts it again.
            with contextlib.suppress(MemoryStoreError, TimeoutError):
                await self.store.adopt_run(run, orphan.owner_id)
            raise
        try:
            start = _generation(run, output)
            tier = tier_of_proto(start.tier).name
            tools = self.deps.tool_loop(start, run.user_id, tier)
            if tools is None and any(delta.step for delta in output):
                raise ValueError("it took tool steps, and this replica runs no tools (--tools)")
            frame, turn_ids, pending = tools.replay(output) if tools else (start, _token_ids(output), None)
        except ValueError as exc:
            log.warning("run %s cannot be continued (%s); interrupting it", run.run_id, exc)
            await self.store.finish_run(run, _interrupted(run.last_seq))
            METRICS.orphans_reaped.labels("interrupted").inc()
            return False
        info = RunInfo(
            run_id=run.run_id,
            user_id=run.user_id,
            tier=tier,
            kind="send" if run.user_message_id else "regenerate",
            model=run.model,
            max_tokens=start.sampling.max_tokens,
            max_tool_steps=tools.toolbox.config.max_steps if tools else 0,
            chat_id=run.chat_id,
            user_message_id=run.user_message_id or "",
            assistant_message_id=run.assistant_message_id,
        )
        live = LiveRun(info, self.config.max_subscribers_per_run, self.pacer)
        live.append(started=_started(info))
        for delta in output:
            if delta.step:
                live.append(**step_event(delta.step))
            else:
                live.append_delta(delta.text, delta.token_count)
        self._live[info.run_id] = live
        if pending is not None and tools is not None:
            # Found started, never finished: the tool may have run; it is never run again.
            try:
                frame, turn_ids = await self._interrupted_step(run, live, tools, pending, frame, turn_ids)
            except ValueError as exc:
                log.warning("run %s cannot be continued (%s); interrupting it", run.run_id, exc)
                self._live.pop(run.run_id, None)
                await self.store.finish_run(run, _interrupted(live.last_seq))
                return False
        frame = continued(frame, turn_ids)
        self._task(self._continue_adopted(run, live, frame, tools), "adopted-run")
        log.warning(
            "run %s of replica %s adopted here at event %d (%d tokens)",
            run.run_id,
            orphan.owner_id,
            live.last_seq,
            len(frame.resumed_output_token_ids),
        )
        return True

    async def _interrupted_step(
        self,
        run: Run,
        live: LiveRun,
        tools: ToolLoop,
        call: ToolCall,
        frame: router_pb2.GenerateStart,
        turn_ids: list[int],
    ) -> tuple[router_pb2.GenerateStart, list[int]]:
        """Stores an "interrupted" result for a step an adopted run's lost replica started and never
        finished; returns the next turn's request and its (empty) output. If the result cannot be
        stored, the run is given back, for a later pass to adopt again."""
        record = result_record(tools.toolbox.interrupted(call))
        try:
            async with asyncio.timeout(self.config.store_deadline_s):
                stored = await self.store.store_step(run, RunDelta(live.last_seq + 1, "", 0, (), record))
        except BaseException:
            self._live.pop(run.run_id, None)
            with contextlib.suppress(MemoryStoreError, TimeoutError):
                await self.store.adopt_run(run, run.owner_id)  # no-op unless it is still ours
            raise
        # The lost replica's own result, if it was stored first (it was only paused).
        result = result_of(stored)
        if result is None or result.call_id != call.id:
            raise ValueError(f"the event after step {call.id} is no result of it")
        live.append(**step_event(stored))
        prompt = len(frame.prompt_token_ids)
        completion = tools.earlier.completion_tokens + len(turn_ids)
        following = tools.next_turn(turn_ids, Usage(prompt, 0, len(turn_ids)), result, completion)
        if following is None:
            raise ValueError("its answer has no tokens left after its last tool step")
        return following, []

    async def _continue_adopted(
        self, run: Run, live: LiveRun, frame: router_pb2.GenerateStart, tools: ToolLoop | None
    ) -> None:
        """Places an adopted run again and relays it to its end; one no router will place is ended as
        interrupted with its checkpointed output (it is this replica's: nobody else would end it)."""
        try:
            stream = await self.router.place(frame, self.config.max_run_s, self.config.placement_timeout_s)
        except asyncio.CancelledError:
            # The replica shut down before the run went on here: it stays as adopted, its output
            # checkpointed, for another replica to adopt in turn.
            self._stop_when_placed.pop(run.run_id, None)
            self._live.pop(run.run_id, None)
            self.handed_over += 1
            raise
        except Exception as exc:
            self._stop_when_placed.pop(run.run_id, None)
            self._live.pop(run.run_id, None)
            log.warning("run %s could not be placed again (%s); interrupting it", run.run_id, exc)
            with contextlib.suppress(MemoryStoreError, TimeoutError):
                await self.store.finish_run(run, _interrupted(live.last_seq))
            return
        relay = Relay(self.deps, live, stream, frame, run, time.monotonic(), tools)
        stop = self._stop_when_placed.pop(run.run_id, None)
        if stop is not None:
            relay.stop(stop)  # its end is stored as any stopped run's
        await self._relay(relay)

    def _stop(self, live: LiveRun, reason: Stop) -> None:
        """Stops a run held here; an adopted one being placed again stops as soon as it is placed."""
        relay = self._relays.get(live.info.run_id)
        if relay is not None:
            relay.stop(reason)
        elif not live.finished:
            self._stop_when_placed[live.info.run_id] = reason
            if reason is Stop.CANCELLED:
                live.cancelling()

    def relays(self) -> list[Relay]:
        """The runs this replica relays now."""
        return list(self._relays.values())

    def holds(self, run_id: str) -> bool:
        """Whether this replica has the run in hand: starting it, adopting it, generating it, holding
        it after its end, or storing its end later."""
        return run_id in self._pending or run_id in self._live or self.deps.late_ends.holds(run_id)

    def is_running(self, run_id: str) -> bool:
        """Whether the run is generating here (not ended, not handed over)."""
        live = self._live.get(run_id)
        return live is not None and not live.finished

    # -- reading --------------------------------------------------------------------------------

    def _local(self, user_id: str, run_id: str) -> LiveRun | None:
        live = self._live.get(run_id)
        if live is None or live.info.user_id != user_id:
            return None
        return live

    async def stream(
        self, user_id: str, run_id: str, after_seq: int, merge_deltas: bool = False
    ) -> AsyncIterator[chat_pb2.RunEvent]:
        """Events with seq > after_seq, then live ones until the run ends (from memory or Cassandra;
        with ``merge_deltas``, the deltas waiting at each read as one)."""
        live = self._local(user_id, run_id)
        if live is not None:
            await self._check_chat_kept(user_id, live.info.chat_id, run_id)
            async for event in live.follow(after_seq, merge_deltas):
                yield event
            return
        run = await self._stored(user_id, run_id)
        await self._check_chat_kept(user_id, run.chat_id, run_id)
        poll_s = self.config.follow_poll_ms / 1000
        async for event in replay.follow_stored(self.store, user_id, run, after_seq, poll_s, merge_deltas):
            yield event

    async def get(self, user_id: str, run_id: str) -> chat_pb2.Run:
        live = self._local(user_id, run_id)
        if live is not None:
            await self._check_chat_kept(user_id, live.info.chat_id, run_id)
            return _live_proto(live)
        run = await self._stored(user_id, run_id)
        await self._check_chat_kept(user_id, run.chat_id, run_id)
        return convert.run(run)

    async def _stored(self, user_id: str, run_id: str) -> Run:
        try:
            return await self.store.get_run(user_id, run_id)
        except NotFound:
            raise not_found("run", run_id) from None

    async def _check_chat_kept(self, user_id: str, chat_id: str, run_id: str) -> None:
        """A deleted chat takes its runs with it: by run id its answers are NOT_FOUND, exactly as a run
        that never existed (stateless completions have no chat)."""
        if not chat_id:
            return
        try:
            await self.store.get_chat(user_id, chat_id)
        except NotFound:
            raise not_found("run", run_id) from None

    # -- cancelling -----------------------------------------------------------------------------

    async def cancel(self, user_id: str, run_id: str, answer_within_s: float) -> chat_pb2.Run:
        """Stops the run at once; a finished run is left as it is. A deleted chat's run is NOT_FOUND.

        Answers with the run's end once it is stored; a run of this replica whose end takes longer
        than half of ``answer_within_s`` (the caller's deadline, less the way back) is answered
        CANCELLING instead: it emits nothing more, and its end is stored after the answer. Another
        replica's run is ended in Cassandra after its owner's next checkpoint, waited for half that
        time at most."""
        live = self._local(user_id, run_id)
        if live is not None:
            # Half the caller's time at most, so that the answer (CANCELLING, if the end is not stored
            # by then) still reaches it through loops that run seconds late past saturation.
            loop = asyncio.get_running_loop()
            answer_by = loop.time() + answer_within_s / 2
            relay = self._relays.get(run_id)
            # Stopped before anything is read: it is the caller's own run (``_local``), and its engine
            # work is freed at once however late Cassandra answers (under load, or not at all). A run
            # whose chat was deleted meanwhile is stopped all the same, and NOT_FOUND.
            self._stop(live, Stop.CANCELLED)
            try:
                async with asyncio.timeout_at(answer_by):
                    await self._check_chat_kept(user_id, live.info.chat_id, run_id)
            except TimeoutError:
                # Cassandra did not tell in time whether the chat is still there: the run, stopped, is
                # answered as it stands rather than not at all.
                return _live_proto(live)
            if relay is not None:
                longest_s = self.config.cancel_timeout_s + self.config.store_deadline_s
                await relay.wait(min(answer_by - loop.time(), longest_s))
            return _live_proto(live)
        run = await self._stored(user_id, run_id)
        await self._check_chat_kept(user_id, run.chat_id, run_id)
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
            await self._signal_owner(run)
        return convert.run(ended.run)

    async def _signal_owner(self, run: Run) -> None:
        """Tells ``run``'s owner that this replica ended or adopted it. A signal lost here costs the
        owner's engine work until its next sweep reads the run (a minute at most), nothing more: the
        run's stored state is what counts."""
        try:
            async with asyncio.timeout(self.config.store_deadline_s):
                await self.store.signal_owner(run)
        except (MemoryStoreError, TimeoutError) as exc:
            log.warning("could not signal replica %s about run %s: %s", run.owner_id, run.run_id, exc)

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
        for live in list(self._live.values()):
            if live.info.user_id == user_id and live.info.chat_id == chat_id:
                self._stop(live, Stop.CANCELLED)

    # -- upkeep ---------------------------------------------------------------------------------

    def sweep(self) -> None:
        """Forgets finished runs older than ``finished_ttl_s`` (Cassandra serves them from then on)."""
        horizon = time.monotonic() - self.config.finished_ttl_s
        for run_id, live in list(self._live.items()):
            if live.finished_at is not None and live.finished_at < horizon and not live.subscribers:
                del self._live[run_id]

    async def shutdown(self, grace_s: float) -> int:
        """Lets runs finish for ``grace_s``, then hands the rest over: their output so far is stored
        and another replica adopts them (once this one says it is gone: ``Replica.leave``), so clients
        resuming elsewhere get the whole answer. A Complete, which nobody could resume, is interrupted.

        Runs that go live while the replica drains (sends already past the draining check, adoptions
        under way) are runs like the others: they get what is left of the grace, and one that goes live
        after it is handed over at once (``_relay``). Returns how many runs this replica handed over
        (in every call: the server calls it again once it stopped serving)."""
        self.draining = True
        loop = asyncio.get_running_loop()
        hand_over_at = loop.time() + grace_s
        if self._tasks and grace_s > 0:
            log.info("waiting up to %.0fs for %d runs to finish", grace_s, len(self._tasks))
        await self._until_ended(hand_over_at)
        self._handing_over = True
        left = list(self._relays.values())
        if left:
            log.warning("handing over %d runs still generating", len(left))
        for relay in left:
            self._leave_at_shutdown(relay)
        # Runs handed over store their output; runs on their way to going live (placement,
        # persistence) go on, and are handed over as they go live. Whatever is still on its way after
        # that ends with the replica: a run not yet stored as a refusal its caller may retry elsewhere;
        # one whose row may have landed is found in this replica's index (``Replica.leave``).
        await self._until_ended(loop.time() + self.config.cancel_timeout_s + self.config.store_deadline_s)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        return self.handed_over

    async def _until_ended(self, deadline: float) -> None:
        """Waits until every run task has ended (those started meanwhile too), or ``deadline``."""
        loop = asyncio.get_running_loop()
        while self._tasks and (left := deadline - loop.time()) > 0:
            await asyncio.wait(list(self._tasks), timeout=left)

    def _leave_at_shutdown(self, relay: Relay) -> None:
        """A stored run is handed over (another replica adopts it); a Complete is interrupted."""
        relay.stop(Stop.HANDED_OVER if relay.stored_run is not None else Stop.INTERRUPTED)


def _interrupted(last_seq: int) -> RunOutcome:
    return RunOutcome(
        status=RunStatus.INTERRUPTED,
        last_seq=last_seq,
        finish_reason=FinishReason.ERROR,
        error_code=replay.INTERRUPTED_CODE,
        error_message=replay.INTERRUPTED_MESSAGE,
    )


def _generation(run: Run, output: list[RunDelta]) -> router_pb2.GenerateStart:
    """The request that continues ``run`` exactly from ``output``; ValueError unless its generation is
    stored and its checkpointed events follow `started` without a gap, each with its token ids."""
    if not run.generation:
        raise ValueError("no stored generation (a run from before adoption)")
    for expected, delta in enumerate(output, start=2):
        if delta.seq != expected:
            raise ValueError(f"checkpointed events jump from {expected - 1} to {delta.seq}")
        if len(delta.token_ids) != delta.token_count:
            raise ValueError(f"event {delta.seq} has no token ids")
    try:
        return router_pb2.GenerateStart.FromString(run.generation)
    except DecodeError:
        raise ValueError("its stored generation does not parse") from None


def _token_ids(output: list[RunDelta]) -> list[int]:
    return [token for delta in output for token in delta.token_ids]


def _started(info: RunInfo) -> chat_pb2.RunStarted:
    return chat_pb2.RunStarted(
        run_id=info.run_id,
        chat_id=info.chat_id,
        user_message_id=info.user_message_id,
        assistant_message_id=info.assistant_message_id,
        model=info.model,
        degraded=info.degraded,
    )


def _as_placed(info: RunInfo, routed: router_pb2.GenerateRouted | None) -> RunInfo:
    """The run as the router placed it: its model is the pool's (a cheaper one when degraded)."""
    if routed is None or not routed.model:
        return info
    return dataclasses.replace(info, model=routed.model, degraded=routed.degraded)


def _live_proto(live: LiveRun) -> chat_pb2.Run:
    return chat_pb2.Run(
        run_id=live.info.run_id,
        chat_id=live.info.chat_id,
        status=live.status,
        last_seq=live.last_seq,
        assistant_message_id=live.info.assistant_message_id,
        create_time=convert.timestamp(live.created_at),
    )
