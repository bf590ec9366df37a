"""How this replica continues a run whose replica was lost (or handed it over at shutdown), from the
run's last checkpoint: the same tokens, events and sequence numbers the lost replica would have made.

``adopt`` makes the run this replica's (one conditional write), reads its checkpointed output, holds it
here (STARTING: streams attach to it at once), stores the result of a tool step the lost replica left
unfinished, then has the router place the rest of the answer and relays it like any run here. A run
that cannot be continued is ended as interrupted with its checkpointed output.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from google.protobuf.message import DecodeError

from chatmesh.finish import FinishReason, Usage
from chatmesh.router.v1 import router_pb2
from chatmesh.tiers import tier_of_proto
from chatmesh.tool_format import ToolCall
from memory_store.errors import MemoryStoreError
from memory_store.models import Run, RunDelta, RunOutcome, RunStatus
from memory_store.store import MemoryStore
from orchestrator.metrics import METRICS
from orchestrator.router_client import RouterClient, continued
from orchestrator.runs import replay
from orchestrator.runs.held_run import HeldRun, RunInfo
from orchestrator.runs.held_runs import HeldRuns
from orchestrator.runs.relay import Relay, RelayDeps
from orchestrator.runs.remote_ends import signal_owner
from orchestrator.runs.tool_steps import ToolLoop, result_of, result_record, step_event

log = logging.getLogger(__name__)


class Adoptions:
    def __init__(self, held: HeldRuns, store: MemoryStore, router: RouterClient, deps: RelayDeps) -> None:
        self.held = held
        self.store = store
        self.router = router
        self.deps = deps
        self.config = deps.config

    async def adopt(self, orphan: Run, replica_id: str) -> bool:
        """Continues here a run whose replica was found dead (or handed it over at shutdown): the
        run's output up to its last checkpoint is kept, and the generation goes on from the token
        after it, through the router, with the run's own seed: the rest of the answer, its events and
        their sequence numbers are the ones the lost replica would have produced. Returns whether this
        replica adopted it (another replica may have been first); a run that cannot be continued
        (stored before runs kept their generation) is ended as interrupted instead.

        ``orphan`` may be this replica's own run, one it does not hold (``Membership.reap_own``): it is
        continued the same way."""
        if self.held.draining or self.held.holds(orphan.run_id):
            return False
        # A task of the replica's from the start, so that a drain waits for it (and it goes on if the
        # reaper's pass gives up waiting: a run made ours must go on here).
        adoption = self.held.task(self._adopt(orphan, replica_id), "adoption", orphan.run_id)
        return await asyncio.shield(adoption)

    async def _adopt(self, orphan: Run, replica_id: str) -> bool:
        run = await self.store.adopt_run(orphan, replica_id)
        if run is None:
            return False
        if orphan.owner_id != replica_id:
            # In case it was only paused: it must stop generating.
            await signal_owner(self.store, orphan, self.config.store_deadline_s)
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
        live = self.held.open(info, output)
        self.held.hold(live)
        if pending is not None and tools is not None:
            # Found started, never finished: the tool may have run; it is never run again.
            try:
                frame, turn_ids = await self._interrupted_step(run, live, tools, pending, frame, turn_ids)
            except ValueError as exc:
                log.warning("run %s cannot be continued (%s); interrupting it", run.run_id, exc)
                self.held.let_go(live)
                await self.store.finish_run(run, _interrupted(live.last_seq))
                return False
        frame = continued(frame, turn_ids)
        self.held.task(self._continue_adopted(run, live, frame, tools), "adopted-run")
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
        live: HeldRun,
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
            self.held.let_go(live)
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
        self, run: Run, live: HeldRun, frame: router_pb2.GenerateStart, tools: ToolLoop | None
    ) -> None:
        """Places an adopted run again and relays it to its end; one no router will place is ended as
        interrupted with its checkpointed output (it is this replica's: nobody else would end it)."""
        if tools is not None and tools.steps:
            # The reservation of the turn it continues, the figure the lost replica recorded or was
            # about to (a function of the stored events), so the next step's check counts it; never
            # refused here: that turn was admitted, or its step stored just before the replica died.
            with contextlib.suppress(MemoryStoreError, TimeoutError):
                async with asyncio.timeout(self.config.store_deadline_s):
                    await self.store.record_usage(run.user_id, run.charge_id, tools.reservation(frame))
        try:
            stream = await self.router.place(frame, self.config.max_run_s, self.config.placement_timeout_s)
        except asyncio.CancelledError:
            # The replica shut down before the run went on here: it stays as adopted, its output
            # checkpointed, for another replica to adopt in turn.
            self.held.let_go(live)
            self.held.handed_over += 1
            raise
        except Exception as exc:
            self.held.let_go(live)
            log.warning("run %s could not be placed again (%s); interrupting it", run.run_id, exc)
            with contextlib.suppress(MemoryStoreError, TimeoutError):
                await self.store.finish_run(run, _interrupted(live.last_seq))
            return
        await self.held.relay(Relay(self.deps, live, stream, frame, run, time.monotonic(), tools))


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
