"""The relay of one run: router frames in, run events out, and the run's end stored exactly once.

    router tokens ─► output moderation ─► delta event (seq n) ─► LiveRun (streams follow it)
                                                          └──► Checkpointer ─► Cassandra (behind)
    router finished / error / cancel ─► finish_run (tail + usage + status, one conditional batch)
                                     ─► usage + done (or error) events ─► LiveRun ends

It runs in the run's task, which belongs to the replica, not to a client: streams attach and detach
freely. It stops early
only for ``cancel()`` (CancelRun), output moderation, a run ended elsewhere (a cancel that reached
another replica), or replica shutdown. Each of those sends the router a cancel frame, so engine work
is freed at once; if the router does not confirm in time, the call itself is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from enum import StrEnum

import grpc

from chatmesh.chat.v1 import chat_pb2
from chatmesh.errors import ServiceError, unavailable
from memory_store.errors import MemoryStoreError, Unavailable
from memory_store.models import FinishedRun, FinishReason, Run, RunDelta, RunOutcome, RunStatus, Usage
from memory_store.store import MemoryStore
from orchestrator import convert
from orchestrator.config import RunConfig
from orchestrator.errors import from_exception, from_rpc_error
from orchestrator.metrics import METRICS
from orchestrator.policy.moderation import Moderator
from orchestrator.router_client import GenerateStream
from orchestrator.runs.checkpoints import Checkpointer
from orchestrator.runs.live_run import LiveRun
from orchestrator.runs.replay import INTERRUPTED_CODE, INTERRUPTED_MESSAGE

log = logging.getLogger(__name__)

# How long storing a run's end is retried before the replica gives up on it (and logs it).
FINISH_RETRY_S = 120.0
# How often the owner of a stored run checks whether someone else ended it (a cancel on another replica).
REMOTE_END_POLL_S = 2.0


class Stop(StrEnum):
    """Why a run stops before the engine ends it."""

    CANCELLED = "cancelled"  # CancelRun, here or on another replica
    CONTENT_FILTER = "content_filter"  # output moderation
    INTERRUPTED = "interrupted"  # this replica shuts down


_STOPPED = {
    Stop.CANCELLED: (RunStatus.CANCELLED, FinishReason.CANCELLED),
    Stop.CONTENT_FILTER: (RunStatus.COMPLETED, FinishReason.CONTENT_FILTER),
    Stop.INTERRUPTED: (RunStatus.INTERRUPTED, FinishReason.ERROR),
}


@dataclass(frozen=True)
class RunEnd:
    """How a run ended, for its last step (titles, summaries, the usage of unstored runs)."""

    live: LiveRun
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


class Relay:
    def __init__(
        self,
        deps: RelayDeps,
        live: LiveRun,
        stream: GenerateStream,
        prompt_tokens: int,
        stored_run: Run | None,
        arrived_at: float,
    ) -> None:
        self.deps = deps
        self.live = live
        self.stream = stream
        self.prompt_tokens = prompt_tokens
        self.stored_run = stored_run
        self.arrived_at = arrived_at
        who = f"user {live.info.user_id}, run {live.info.run_id}"
        self.screen = deps.moderator.output_screen(who)
        # Set when the run must stop early; no output is emitted after it.
        self.stop_reason: Stop | None = None
        self._tokens_seen = 0
        self._tokens_unsent = 0
        self._first_delta_at: float | None = None
        self._checkpointer: Checkpointer | None = None
        self._ended = asyncio.Event()

    async def stop(self, reason: Stop) -> None:
        """Stops the run now: no output is emitted after this, and the router is told to stop."""
        if self.stop_reason is not None or self.live.finished:
            return
        self.stop_reason = reason
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
        watcher = None
        if self.stored_run is not None:
            config = self.deps.config
            self._checkpointer = Checkpointer(
                self.deps.store,
                self.stored_run,
                config.checkpoint_events,
                config.checkpoint_interval_ms / 1000,
                config.store_deadline_s,
            )
            watcher = asyncio.create_task(self._watch_remote_end())
        finished = None
        error: ServiceError | None = None
        try:
            async with asyncio.timeout(self.deps.config.max_run_s):
                async for frame in self.stream.frames():
                    kind = frame.WhichOneof("kind")
                    if kind == "tokens":
                        self._tokens_seen += len(frame.tokens.token_ids)
                        await self._emit(frame.tokens.text, len(frame.tokens.token_ids))
                    elif kind == "finished":
                        finished = frame.finished
                        await self._emit(finished.text, 0)
        except grpc.aio.AioRpcError as exc:
            if self.stop_reason is None:
                error = from_rpc_error(exc, "the router")
        except TimeoutError:
            error = unavailable(f"the answer took longer than {self.deps.config.max_run_s:.0f}s")
            self.stream.abort()
        except Exception as exc:
            error = from_exception(exc)
            self.stream.abort()
        finally:
            if watcher is not None:
                watcher.cancel()
            self.stream.close()
        if finished is None and error is None and self.stop_reason is None:
            error = unavailable("the router ended the stream before the answer finished; retry", 1.0)
        try:
            return await self._finish(finished, error)
        finally:
            METRICS.active_runs.dec()
            self._ended.set()

    async def _emit(self, text: str, tokens: int) -> None:
        """Turns released text into a delta event (tokens without text yet ride on the next one)."""
        if self.stop_reason is not None:
            return
        self._tokens_unsent += tokens
        if not text:
            return
        if self.screen.check(text).blocked:
            await self.stop(Stop.CONTENT_FILTER)
            return
        event = self.live.append(delta=chat_pb2.Delta(text=text, token_count=self._tokens_unsent))
        self._tokens_unsent = 0
        if self._first_delta_at is None:
            self._first_delta_at = time.monotonic()
            METRICS.time_to_first_token.labels(self.live.info.model, self.live.info.kind).observe(
                self._first_delta_at - self.arrived_at
            )
        if self._checkpointer is not None:
            self._checkpointer.add(RunDelta(event.seq, text, event.delta.token_count))

    async def _watch_remote_end(self) -> None:
        """Stops the run if another replica ended it (CancelRun there, or a reaper that thought us dead)."""
        assert self.stored_run is not None
        while True:
            await asyncio.sleep(REMOTE_END_POLL_S)
            with contextlib.suppress(MemoryStoreError, TimeoutError):
                async with asyncio.timeout(self.deps.config.store_deadline_s):
                    run = await self.deps.store.get_run(self.live.info.user_id, self.live.info.run_id)
                if run.status.terminal:
                    await self.stop(Stop.CANCELLED)
                    return

    # -- the end --------------------------------------------------------------------------------

    async def _finish(self, finished, error: ServiceError | None) -> RunEnd:
        status, reason = self._status(finished, error)
        if finished is not None and finished.HasField("usage"):
            u = finished.usage
            usage = Usage(u.prompt_tokens, u.cached_prompt_tokens, u.completion_tokens)
        else:
            usage = Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self._tokens_seen)
        tail = await self._checkpointer.close() if self._checkpointer is not None else []
        message_id = ""
        if self.stored_run is not None:
            ended = await self._store_end(status, reason, usage, error, tail)
            if ended is None:
                status, reason = RunStatus.FAILED, FinishReason.ERROR
                error = unavailable("the answer could not be stored; regenerate it", 1.0)
            else:
                if not ended.applied:
                    # Someone else ended it first: their verdict is the run's.
                    status, reason = ended.run.status, ended.run.finish_reason
                    with contextlib.suppress(MemoryStoreError, TimeoutError):
                        await self.deps.store.record_usage(
                            self.live.info.user_id, self.live.info.run_id, usage
                        )
                message_id = ended.message.message_id if ended.message else ""
        self._publish_end(status, reason, usage, error, message_id)
        self._observe(status, reason, usage)
        return RunEnd(self.live, status, reason, usage, message_id)

    def _status(self, finished, error: ServiceError | None) -> tuple[RunStatus, FinishReason | None]:
        if self.stop_reason is not None:
            return _STOPPED[self.stop_reason]
        if error is not None or finished is None:
            return RunStatus.FAILED, FinishReason.ERROR
        reason = convert.ENGINE_FINISH.get(finished.finish_reason, FinishReason.STOP)
        if reason is FinishReason.CANCELLED:
            return RunStatus.CANCELLED, reason
        return RunStatus.COMPLETED, reason

    async def _store_end(
        self,
        status: RunStatus,
        reason: FinishReason | None,
        usage: Usage,
        error: ServiceError | None,
        tail: list[RunDelta],
    ) -> FinishedRun | None:
        """finish_run, retried while Cassandra is unavailable (it is idempotent); None if it never took."""
        assert self.stored_run is not None
        failed = status in (RunStatus.FAILED, RunStatus.INTERRUPTED)
        error_code = error.code.name if error else (INTERRUPTED_CODE if failed else None)
        error_message = error.message if error else (INTERRUPTED_MESSAGE if failed else None)
        outcome = RunOutcome(
            status=status,
            # The seq of the last event this run will have: error, or usage + done.
            last_seq=self.live.last_seq + (1 if failed else 2),
            finish_reason=reason,
            tail=tuple(tail),
            usage=usage,
            error_code=error_code,
            error_message=error_message,
        )
        deadline = time.monotonic() + FINISH_RETRY_S
        delay = 0.1
        while True:
            try:
                async with asyncio.timeout(self.deps.config.store_deadline_s):
                    return await self.deps.store.finish_run(self.stored_run, outcome)
            except Exception as exc:
                retryable = isinstance(exc, (TimeoutError, Unavailable))
                if not retryable:
                    log.error("run %s could not be finished: %s", self.live.info.run_id, exc, exc_info=exc)
                    return None
                if time.monotonic() + delay > deadline:
                    log.error(
                        "run %s could not be stored for %.0fs; giving up",
                        self.live.info.run_id,
                        FINISH_RETRY_S,
                    )
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
        live.finish(convert.RUN_STATUSES[status])

    def _observe(self, status: RunStatus, reason: FinishReason | None, usage: Usage) -> None:
        info = self.live.info
        now = time.monotonic()
        METRICS.runs.labels(info.kind, status.value, reason.value if reason else "none").inc()
        METRICS.run_duration.labels(info.model, status.value).observe(now - self.arrived_at)
        METRICS.token_usage.labels(info.model, "input").observe(usage.prompt_tokens)
        METRICS.token_usage.labels(info.model, "output").observe(usage.completion_tokens)
        METRICS.budget_tokens.labels(info.tier).inc(usage.total_tokens)
        if self._first_delta_at is not None and usage.completion_tokens > 1:
            METRICS.time_per_output_token.labels(info.model).observe(
                (now - self._first_delta_at) / (usage.completion_tokens - 1)
            )
