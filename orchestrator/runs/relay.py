"""The relay of one run: router frames in, run events out, and the run's end stored exactly once.

    router tokens ─► output moderation ─► delta event (seq n) ─► HeldRun (streams follow it)
                                                          └──► RunCheckpoints ─► Cassandra (behind)
    router finished / error / cancel ─► finish_run (tail + usage + status, one conditional batch)
                                     ─► usage + done (or error) events ─► HeldRun ends

It runs in the run's task, which belongs to the replica, not to a client: streams attach and detach
freely. The router's token frames are relayed where they arrive, on the router link's reading task
(``GenerateStream.frames``), so a token wakes no task of the run's: only the streams following it.
It stops early only for ``cancel()`` (CancelRun), output moderation, a run ended elsewhere (a
cancel that reached another replica) or adopted elsewhere (``remote_ends.py`` watches for both), or
replica shutdown. Each of those sends the router a cancel frame, so engine work is freed at once; if
the router does not confirm in time, the call itself is cancelled.

Every delta of a stored run is a function of the tokens alone (one per token that releases text,
carrying the tokens since the one before; ``chatmesh.token_text``), never of how the engine or router
grouped them into frames (an unstored run, Complete, is never replayed: its deltas follow the frames).
So when the router dies mid-answer, the same request goes on through another router resuming
after the tokens so far, and when this replica dies, the replica that adopts the run regenerates the
tokens after its last checkpoint: either way the events that follow are the ones this relay would
have produced, with the same sequence numbers, and a client resuming from any of them sees no gap
and no duplicate.

When this replica shuts down (or finds another replica adopted the run while it was unreachable), it
does not end the run: it hands it over. Its output is checkpointed, the router told to stop, and the
streams attached here end with UNAVAILABLE, to resume (after_seq) where the run goes on.

A run offered the orchestrator's own tools (``tool_steps.py``, docs/tools.md) may end a model turn with
a tool call: its "step started" event is stored before the tool runs, its "step result" after, and the
next turn goes on as a new generation of the same run, its events numbered on.

An end that cannot be stored for ``finish_retry_s`` (Cassandra unreachable all that while) ends the
streams with UNAVAILABLE, and this replica stores it later, as they were told (``late_ends.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from chatmesh.chat.v1 import chat_pb2
from chatmesh.engine.v1 import engine_pb2
from chatmesh.errors import ServiceError, unavailable
from chatmesh.finish import FinishReason, Usage
from chatmesh.router.v1 import router_pb2
from chatmesh.token_text import token_pieces
from chatmesh.tool_format import ToolCall
from memory_store.errors import MemoryStoreError, OwnerChanged, Unavailable
from memory_store.models import FinishedRun, Run, RunDelta, RunOutcome, RunStatus
from memory_store.store import MemoryStore
from orchestrator import convert
from orchestrator.config import RunConfig
from orchestrator.errors import from_downstream, from_exception
from orchestrator.metrics import METRICS
from orchestrator.policy.admission import Budgets
from orchestrator.policy.moderation import Moderator
from orchestrator.prompting.models import Models
from orchestrator.router_client import GenerateStream, RouterClient, RouterError, continued
from orchestrator.runs.checkpoints import CheckpointWriter, RunCheckpoints, encoded_logprobs
from orchestrator.runs.held_run import HeldRun
from orchestrator.runs.late_ends import LateEnds
from orchestrator.runs.replay import INTERRUPTED_CODE, INTERRUPTED_MESSAGE
from orchestrator.runs.run_state import Stop
from orchestrator.runs.tool_steps import (
    ToolLoop,
    call_of,
    result_of,
    result_record,
    started_record,
    step_event,
)
from orchestrator.tools.toolbox import Toolbox

log = logging.getLogger(__name__)


def usage_settled_after_s(config: RunConfig) -> float:
    """How long after a run starts its usage record may still change: its generation ends by
    ``max_run_s`` (an adopter goes on past its first owner's deadline, hence twice), and its owner
    records the end within ``finish_retry_s`` of it (or later, a late end: ``late_ends.py``)."""
    return 2 * config.max_run_s + config.finish_retry_s


# How many times one answer goes on through another router after its router failed mid-stream.
MAX_ROUTER_FAILOVERS = 3
# What a router call ending in these means: the router (or the way to it) failed, not the request.
_ROUTER_LOST = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.CANCELLED,
    }
)


# Stops that leave the run to another replica rather than ending it.
_LEFT_TO_ANOTHER = frozenset({Stop.HANDED_OVER, Stop.SUPERSEDED})

_STOPPED = {
    Stop.CANCELLED: (RunStatus.CANCELLED, FinishReason.CANCELLED),
    Stop.CONTENT_FILTER: (RunStatus.COMPLETED, FinishReason.CONTENT_FILTER),
    Stop.INTERRUPTED: (RunStatus.INTERRUPTED, FinishReason.ERROR),
}


@dataclass(frozen=True)
class RunEnd:
    """How a run ended, for its last step (titles, summaries, the usage of unstored runs)."""

    live: HeldRun
    status: RunStatus
    finish_reason: FinishReason | None
    usage: Usage
    # The stored assistant message's id ("" if nothing was stored).
    assistant_message_id: str


@dataclass(frozen=True)
class RelayDeps:
    store: MemoryStore
    moderator: Moderator
    config: RunConfig
    router: RouterClient
    checkpoints: CheckpointWriter
    late_ends: LateEnds
    # The orchestrator's own tools (None: off), and the served models: a step's result is encoded with
    # the tokenizer and template of the model its run asked for.
    toolbox: Toolbox | None = None
    models: Models | None = None
    # Where a turn after a tool step asks for the tokens of its prompt (beyond the run's reservation).
    budgets: Budgets | None = None

    def tool_loop(self, first: router_pb2.GenerateStart, user_id: str, tier: str) -> ToolLoop | None:
        """The tool loop of a stored run whose first turn is ``first`` (None: it was offered no tools)."""
        if self.toolbox is None or self.models is None:
            return None
        model = self.models.by_name.get(first.model)
        if model is None:  # an adopted run of a model this replica does not serve
            raise ValueError(f"its model {first.model!r} is not served here")
        return ToolLoop.of(self.toolbox, model.tokenizer, first, user_id, tier)


def _usage_of(finished) -> Usage | None:
    """A turn's usage as its router counted it."""
    if finished is None or not finished.HasField("usage"):
        return None
    u = finished.usage
    return Usage(u.prompt_tokens, u.cached_prompt_tokens, u.completion_tokens)


class Relay:
    def __init__(
        self,
        deps: RelayDeps,
        live: HeldRun,
        stream: GenerateStream,
        start: router_pb2.GenerateStart,
        stored_run: Run | None,
        arrived_at: float,
        tools: ToolLoop | None = None,
    ) -> None:
        """``start`` is the request ``stream`` was opened with: its ``resumed_output_token_ids`` are the
        output of its turn ``live`` already holds (an adopted run's checkpointed deltas). ``tools``: the
        run's tool loop, where its turns may call the orchestrator's tools."""
        self.deps = deps
        self.live = live
        self.stream = stream
        self.start = start
        self.prompt_tokens = len(start.prompt_token_ids)
        self.stored_run = stored_run
        self.arrived_at = arrived_at
        self.tools = tools
        # A turn offered tools whose text begins as a call does (its grammar lets text begin with
        # anything else) is held back here to its end: a call is a step, its text never an answer's.
        self._call_text: list[str] | None = None
        # Whether the current turn's first text came (it decides; an adopted turn with output is text).
        self._decided = bool(start.resumed_output_token_ids)
        who = f"user {live.info.user_id}, run {live.info.run_id}"
        self.screen = deps.moderator.output_screen(who)
        # Patterns may straddle the resumption point: the screen first sees what is already out.
        if resumed_text := live.text():
            self.screen.check(resumed_text)
        # Set when the run must stop early; no output is emitted after it.
        self.stop_reason: Stop | None = None
        # Every output token of the current turn so far (4 bytes each; a list of ints would take 36),
        # and those not yet carried by a delta (their text is held back).
        self._output_ids = array("I", start.resumed_output_token_ids)
        self._unsent_ids: list[int] = []
        self._unsent_logprobs: list[chat_pb2.TokenLogprob] = []
        self._first_delta_at: float | None = None
        # What the run's budget reservation holds (a tool loop's: ``ToolLoop.reservation``), as of the
        # turn before the current one.
        self._reserved = Usage()
        self._checkpointer: RunCheckpoints | None = None
        self._ended = asyncio.Event()

    def stop(self, reason: Stop) -> None:
        """Stops the run now: no output is emitted after this, and the router is told to stop."""
        if self.stop_reason is not None or self.live.state.done_here:
            return
        self.stop_reason = reason
        if reason is Stop.CANCELLED:
            self.live.cancelling()
        self.stream.cancel()
        # The router confirms with a final frame; if it does not, the call is cut.
        asyncio.get_running_loop().call_later(self.deps.config.cancel_timeout_s, self.stream.abort)

    async def wait(self, timeout_s: float) -> None:
        """Waits up to ``timeout_s`` for the run's end to be stored and published."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._ended.wait()

    # -- the relay ------------------------------------------------------------------------------

    async def run(self) -> RunEnd:
        """Relays the router's frames into the run's events until the run ends; stores and publishes
        the end, and returns it."""
        METRICS.active_runs.inc()
        if self.stored_run is not None:
            self._checkpointer = self.deps.checkpoints.open(self.stored_run)
        finished = None
        error: ServiceError | None = None
        try:
            async with asyncio.timeout(self.deps.config.max_run_s):
                while True:
                    finished = await self._turn()
                    call = self._tool_call(finished)
                    if call is None:
                        break
                    start = await self._step(call, finished)
                    if start is None:
                        break  # no tokens left for another turn: the answer ends with the result
                    finished = None  # the turn is counted in the tool loop's usage
                    self._begin_turn(start)
                    if self.stop_reason is not None:
                        break
                    await self._place_turn()
        except RouterError as exc:
            if self.stop_reason is None:
                error = from_downstream(exc.error, "the router")
        except ServiceError as exc:  # no router would go on with it
            error = exc
        except TimeoutError:
            error = unavailable(f"the answer took longer than {self.deps.config.max_run_s:.0f}s")
            self.stream.abort()
        except Exception as exc:
            error = from_exception(exc)
            self.stream.abort()
        finally:
            self.stream.close()
        if finished is None and error is None and self.stop_reason is None:
            error = unavailable("the router ended the stream before the answer finished; retry", 1.0)
        try:
            return await self._finish(finished, error)
        finally:
            METRICS.active_runs.dec()
            self._ended.set()

    async def _turn(self):
        """Relays one model turn's frames; returns its ``finished`` frame (None if it stopped early)."""
        finished = None
        for failover in range(MAX_ROUTER_FAILOVERS + 1):
            if failover:
                METRICS.router_failovers.inc()
                await self._continue_elsewhere()
            try:
                async for frame in self.stream.frames(self._relay_tokens):
                    if frame.WhichOneof("kind") == "finished":
                        finished = frame.finished
                        self._emit(finished.text, ())
            except RouterError as exc:
                if self.stop_reason is not None:
                    break
                if exc.error.code not in _ROUTER_LOST or failover == MAX_ROUTER_FAILOVERS:
                    raise
                log.warning(
                    "run %s: its router failed (%s); going on through another",
                    self.live.info.run_id,
                    exc.error,
                )
                continue
            if finished is not None or self.stop_reason is not None:
                break
            log.warning(
                "run %s: its router ended the stream early; going on through another", self.live.info.run_id
            )
        return finished

    # -- tool steps -----------------------------------------------------------------------------

    def _tool_call(self, finished) -> ToolCall | None:
        """The tool call the turn ended with, where its run has tools and it may call one."""
        if self.tools is None or finished is None or self.stop_reason is not None:
            return None
        if self._call_text is None:
            return None
        stopped = finished.finish_reason == engine_pb2.FINISH_REASON_STOP
        call = self.tools.call_in("".join(self._call_text), stopped)
        if call is None:  # not a call after all (cut by max_tokens): it is text
            held, self._call_text = "".join(self._call_text), None
            self._emit(held, ())
        return call

    async def _step(self, call: ToolCall, finished) -> router_pb2.GenerateStart | None:
        """Stores the step started, runs the tool, stores its result: the next turn's request (None
        when the answer has no tokens left). The tool runs only once its step is stored as this
        replica's; a step another replica stored first (this one was taken for dead meanwhile) is left
        to it: the result here is "interrupted", unless that replica's result is stored first."""
        assert self.tools is not None and self.stored_run is not None
        mine = started_record(call, self.stored_run.owner_id)
        # The call's tokens go with its step (its text is in no delta): an adopter rebuilds from them.
        call_ids, self._unsent_ids, self._unsent_logprobs = tuple(self._unsent_ids), [], []
        stored = await self._store_step(mine, call_ids)
        if stored == mine:
            # The audit line of an execution (one per step: the chaos suite counts them, bench/chaos.py).
            log.info("run %s: tool step %s runs %s", self.live.info.run_id, call.id, call.name)
            result = await self.tools.run(call)
        elif (call_of(stored) or call).id == call.id:
            result = self.tools.toolbox.interrupted(call)
        else:
            raise unavailable("this answer's events diverged from those stored; resume it", 1.0)
        kept = result_of(await self._store_step(result_record(result)))
        if kept is None or kept.call_id != call.id:
            raise unavailable("this answer's events diverged from those stored; resume it", 1.0)
        result = kept  # ours, or the result the replica that ran the tool stored first
        usage = _usage_of(finished) or Usage(self.prompt_tokens, 0, len(self._output_ids))
        completion = self.tools.earlier.completion_tokens + usage.completion_tokens
        self._reserved = self.tools.reservation(self.start)
        return self.tools.next_turn(self._output_ids, usage, result, completion)

    async def _store_step(self, record: str, token_ids: tuple[int, ...] = ()) -> str:
        """Stores a step event (after every event before it), then publishes it; returns the record
        stored at its seq: ``record``, or what another replica stored there first. A stream never
        shows a step that a replica adopting the run would not find. One that cannot be stored ends
        the run (unpublished)."""
        assert self._checkpointer is not None and self.stored_run is not None
        seq = self.live.last_seq + 1
        deadline_s = self.deps.config.store_deadline_s
        if not await self._checkpointer.store_now(deadline_s):
            raise unavailable("a tool step could not be stored; the answer stops here", 1.0)
        try:
            async with asyncio.timeout(deadline_s):
                step = RunDelta(seq, "", len(token_ids), token_ids, record)
                stored = await self.deps.store.store_step(self.stored_run, step)
        except (TimeoutError, MemoryStoreError):
            raise unavailable("a tool step could not be stored; the answer stops here", 1.0) from None
        if not stored:
            raise unavailable("this answer's events diverged from those stored; resume it", 1.0)
        self.live.append(**step_event(stored))
        return stored

    def _begin_turn(self, start: router_pb2.GenerateStart) -> None:
        """The model's turn after a step, the same run's next generation, is the current one now."""
        self.start = start
        self.prompt_tokens = 0  # charged once it is placed
        self._output_ids = array("I")
        self._call_text = None
        self._decided = False

    async def _place_turn(self) -> None:
        """Places the turn after a step, once the run's reservation is raised by its prompt (refused,
        RESOURCE_EXHAUSTED, when the user's window has no room for it: the answer ends after the step)."""
        config, budgets, tools, run = self.deps.config, self.deps.budgets, self.tools, self.stored_run
        if budgets is not None and tools is not None and run is not None:
            estimate = tools.reservation(self.start)
            more = estimate.total_tokens - self._reserved.total_tokens
            await budgets.reserve_more(
                tools.user_id, tools.tier, self.start.model, run.charge_id, estimate, more
            )
        self.stream = await self.deps.router.place(self.start, config.max_run_s, config.placement_timeout_s)
        self.prompt_tokens = len(self.start.prompt_token_ids)
        if self.stop_reason is not None:  # stopped while it was being placed
            self.stream.cancel()

    async def _continue_elsewhere(self) -> None:
        """Opens the run's request again through the routers that are up, resuming after the output
        so far (the dead router's engine work ended with its stream)."""
        self.stream.abort()
        config = self.deps.config
        self.stream = await self.deps.router.place(
            continued(self.start, self._output_ids), config.max_run_s, config.placement_timeout_s
        )

    def _relay_tokens(self, tokens: engine_pb2.GenerateTokens) -> None:
        """A stored run's deltas are one per token, so that an adopter numbers them the same; an
        unstored run (Complete) is never replayed, so its deltas follow the frames, and a reader that
        fell behind gets one delta for all that the router merged."""
        logprobs = tokens.logprobs
        if self.stored_run is None:
            self._emit(tokens.text, tokens.token_ids, logprobs)
            return
        for i, (token_id, text) in enumerate(token_pieces(tokens)):
            self._emit(text, (token_id,), logprobs[i : i + 1])

    def _emit(
        self, text: str, token_ids: Sequence[int], logprobs: Sequence[engine_pb2.TokenLogprob] = ()
    ) -> None:
        """Turns released text into a delta event (tokens without text yet, and their logprobs, ride on
        the next one)."""
        if self.stop_reason is not None:
            return
        self._output_ids.extend(token_ids)
        self._unsent_ids.extend(token_ids)
        # engine.v1's TokenLogprob and chat.v1's have the same fields and numbers: the bytes carry over.
        self._unsent_logprobs += [chat_pb2.TokenLogprob.FromString(lp.SerializeToString()) for lp in logprobs]
        if not text:
            return
        if self._holds_call(text):
            return
        if self.screen.check(text).blocked:
            self.stop(Stop.CONTENT_FILTER)
            return
        covered, covered_logprobs = tuple(self._unsent_ids), self._unsent_logprobs
        self._unsent_ids.clear()
        self._unsent_logprobs = []
        seq = self.live.append_delta(text, len(covered), covered_logprobs)
        if self._first_delta_at is None:
            self._first_delta_at = time.monotonic()
            info = self.live.info
            METRICS.time_to_first_token.labels(info.model, info.kind, info.tier).observe(
                self._first_delta_at - self.arrived_at
            )
        if self._checkpointer is not None:
            self._checkpointer.add(
                RunDelta(seq, text, len(covered), covered, logprobs=encoded_logprobs(covered_logprobs))
            )

    def _holds_call(self, text: str) -> bool:
        """Whether ``text`` is held back as part of a tool call (the turn's first text decides)."""
        if self._call_text is not None:
            self._call_text.append(text)
            return True
        if self._decided:
            return False
        self._decided = True
        if self.tools is None or not text.startswith("<") or not self.tools.offered():
            return False
        self._call_text = [text]
        return True

    # -- the end --------------------------------------------------------------------------------

    async def _finish(self, finished, error: ServiceError | None) -> RunEnd:
        earlier = self.tools.earlier if self.tools is not None else Usage()
        if (turn := _usage_of(finished)) is not None:
            usage = earlier + turn
        elif self._output_ids or self.stop_reason is not None or earlier.total_tokens:
            usage = earlier + Usage(prompt_tokens=self.prompt_tokens, completion_tokens=len(self._output_ids))
        else:
            usage = Usage()  # failed before its first token: charged nothing (its retry answers it)
        tail = []
        if (checkpointer := self._checkpointer) is not None:
            # A run handed over is continued from its checkpoints: they must hold all it streamed.
            flush = self.stop_reason is Stop.HANDED_OVER or checkpointer.too_long_for_a_tail()
            tail = await checkpointer.close(self.deps.config.store_deadline_s if flush else 0.0)
        if self.stop_reason in _LEFT_TO_ANOTHER:
            return self._leave(usage)
        status, reason = self._status(finished, error)
        message_id = ""
        if self.stored_run is not None:
            try:
                ended = await self._store_end(self._outcome(status, reason, usage, error, tail))
            except OwnerChanged:
                self.stop_reason = Stop.SUPERSEDED
                return self._leave(usage)
            except Exception as exc:  # refused: no retry would take it
                log.error("run %s could not be finished: %s", self.live.info.run_id, exc, exc_info=exc)
                status, reason = RunStatus.FAILED, FinishReason.ERROR
                error = unavailable("the answer could not be stored; regenerate it", 1.0)
            else:
                if ended is None:
                    # Cassandra unreachable all along: the streams end now, told what the end stored
                    # later says.
                    status, reason = RunStatus.FAILED, FinishReason.ERROR
                    error = unavailable("the answer could not be stored in time; it is stored later", 1.0)
                    late = self._outcome(status, reason, usage, error, tail)
                    self.deps.late_ends.add(self.stored_run, late, self._output())
                else:
                    if not ended.applied:
                        # Someone else ended it first: their verdict is the run's.
                        status, reason = ended.run.status, ended.run.finish_reason
                        with contextlib.suppress(MemoryStoreError, TimeoutError):
                            await self.deps.store.record_usage(
                                self.live.info.user_id, self.stored_run.charge_id, usage
                            )
                    message_id = ended.message.message_id if ended.message else ""
        self._publish_end(status, reason, usage, error, message_id)
        self._observe(status, reason, usage)
        return RunEnd(self.live, status, reason, usage, message_id)

    def _leave(self, usage: Usage) -> RunEnd:
        """Leaves the run to the replica that goes on with it: the streams here end, to resume there
        (what was not checkpointed, the adopter regenerates: it is a function of the tokens before it)."""
        self.live.hand_over()
        METRICS.runs_left.labels(str(self.stop_reason)).inc()
        log.info("run %s left to another replica (%s)", self.live.info.run_id, self.stop_reason)
        return RunEnd(self.live, RunStatus.IN_PROGRESS, None, usage, "")

    def _status(self, finished, error: ServiceError | None) -> tuple[RunStatus, FinishReason | None]:
        if self.stop_reason is not None:
            return _STOPPED[self.stop_reason]
        if error is not None or finished is None:
            return RunStatus.FAILED, FinishReason.ERROR
        reason = convert.ENGINE_FINISH.get(finished.finish_reason, FinishReason.STOP)
        if reason is FinishReason.CANCELLED:
            return RunStatus.CANCELLED, reason
        return RunStatus.COMPLETED, reason

    def _outcome(
        self,
        status: RunStatus,
        reason: FinishReason | None,
        usage: Usage,
        error: ServiceError | None,
        tail: list[RunDelta],
    ) -> RunOutcome:
        failed = status in (RunStatus.FAILED, RunStatus.INTERRUPTED)
        return RunOutcome(
            status=status,
            # The seq of the last event this run will have: error, or usage + done.
            last_seq=self.live.last_seq + (1 if failed else 2),
            finish_reason=reason,
            tail=tuple(tail),
            usage=usage,
            error_code=error.code.name if error else (INTERRUPTED_CODE if failed else None),
            error_message=error.message if error else (INTERRUPTED_MESSAGE if failed else None),
        )

    def _output(self) -> list[RunDelta]:
        """Every delta this run has, checkpointed or in the tail (an adopted run's live events start
        with the checkpoints it was adopted with): a finish that wins stores the answer from it."""
        return [RunDelta(seq, text, token_count) for seq, text, token_count in self.live.deltas()]

    async def _store_end(self, outcome: RunOutcome) -> FinishedRun | None:
        """finish_run, retried while Cassandra is unavailable (it is idempotent) for ``finish_retry_s``;
        None if it was unavailable all that while (any other failure is raised)."""
        assert self.stored_run is not None
        output = self._output()
        retry_s = self.deps.config.finish_retry_s
        deadline = time.monotonic() + retry_s
        delay = 0.1
        while True:
            try:
                async with asyncio.timeout(self.deps.config.store_deadline_s):
                    return await self.deps.store.finish_run(self.stored_run, outcome, output)
            except (TimeoutError, Unavailable):
                if time.monotonic() + delay > deadline:
                    log.error("run %s could not be stored for %.0fs", self.live.info.run_id, retry_s)
                    return None
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    def _publish_end(
        self,
        status: RunStatus,
        reason: FinishReason | None,
        usage: Usage,
        error: ServiceError | None,
        message_id: str,
    ) -> None:
        live = self.live
        try:
            if status in (RunStatus.FAILED, RunStatus.INTERRUPTED):
                if status is RunStatus.INTERRUPTED:
                    run_error = chat_pb2.RunError(code=INTERRUPTED_CODE, message=INTERRUPTED_MESSAGE)
                else:
                    error = error or unavailable("the answer failed")
                    run_error = chat_pb2.RunError(
                        code=error.code.name,
                        message=error.message,
                        retry_after_ms=round((error.retry_after_s or 0) * 1000),
                    )
                live.append(error=run_error)
            else:
                live.append(usage=convert.usage(usage))
                live.append(
                    done=chat_pb2.Done(
                        finish_reason=convert.finish_reason(reason),
                        assistant_message_id=message_id,
                    )
                )
        finally:
            # Whatever happened, the run has ended here: its followers' streams end rather than wait.
            live.finish(convert.RUN_STATUSES[status])

    def _observe(self, status: RunStatus, reason: FinishReason | None, usage: Usage) -> None:
        info = self.live.info
        now = time.monotonic()
        METRICS.runs.labels(info.kind, status.value, reason.value if reason else "none", info.model).inc()
        METRICS.run_duration.labels(info.model, status.value).observe(now - self.arrived_at)
        METRICS.token_usage.labels(info.model, "input").observe(usage.prompt_tokens)
        METRICS.token_usage.labels(info.model, "output").observe(usage.completion_tokens)
        METRICS.budget_tokens.labels(info.tier, info.model).inc(usage.total_tokens)
        if self._first_delta_at is not None and usage.completion_tokens > 1:
            METRICS.time_per_output_token.labels(info.model, info.tier).observe(
                (now - self._first_delta_at) / (usage.completion_tokens - 1)
            )
