"""The engine: requests in, one scheduler step at a time, token outputs out.

``add_request`` and ``cancel`` may be called from any thread (the gRPC event loop): they only put work
in an inbox. The step loop runs in its own thread, so the model never blocks the event loop:

    take the inbox (new requests, cancels: their blocks are freed here, before scheduling)
    → schedule → run the model → sample → detokenize and check stops → free finished requests
    → publish the step's KV events as one batch → publish the load → hand all outputs over in one call.

Tests call ``step()`` directly instead of starting the thread.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np

from chatmesh.errors import ServiceError
from chatmesh.tokenizer import ChatTokenizer
from engine.config import EngineConfig
from engine.detokenizer import Detokenizer
from engine.kv_cache import KVCacheManager, size_kv_pool
from engine.kv_events import KvEventLog
from engine.metrics import EngineMetrics
from engine.model.runner import ModelRunner, SequenceChunk
from engine.outputs import EngineStats, Finish, FinishReason, RequestOutput, Usage
from engine.sampler import sample
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import EngineRequest, Sequence
from engine.stopping import check_token

log = logging.getLogger(__name__)

# Retry hint for a full queue when no request has finished yet to estimate the drain rate from.
_DEFAULT_RETRY_AFTER_S = 1.0


class QueueFullError(ServiceError):
    def __init__(self, waiting: int, retry_after_s: float) -> None:
        message = f"the engine's waiting queue is full ({waiting} requests); retry later"
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED, message, retry_after_s)


class DuplicateRequestError(ServiceError):
    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.ALREADY_EXISTS, message)


class EngineUnavailableError(ServiceError):
    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)


@dataclass
class _Live:
    """A request the step thread is working on."""

    seq: Sequence
    detokenizer: Detokenizer
    arrival: float
    first_token_at: float | None = None


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        tokenizer: ChatTokenizer,
        on_outputs: Callable[[list[RequestOutput]], None] | None = None,
        metrics: EngineMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.instance_id = uuid.uuid4().hex
        spec = runner.spec
        bytes_per_block = runner.kv_bytes_per_block(config.block_size)
        num_blocks = size_kv_pool(config, spec.context_length, bytes_per_block)
        log.info(
            "sizing KV cache: %d blocks of %d tokens (%d tokens, %.0f MiB)",
            num_blocks,
            config.block_size,
            num_blocks * config.block_size,
            num_blocks * bytes_per_block / 2**20,
        )
        runner.allocate_kv_cache(num_blocks, config.block_size)
        self.events = KvEventLog(config.kv_events_buffer)
        self.kv = KVCacheManager(
            num_blocks, config.block_size, self.events, config.enable_prefix_caching, config.block_hash_seed
        )
        self.scheduler = Scheduler(
            self.kv,
            config.max_batched_tokens,
            config.max_running_requests,
            watermark_blocks=num_blocks // 100,
        )
        # A request must fit in the pool on its own, or it could never finish.
        self.context_length = min(spec.context_length, num_blocks * config.block_size)
        if self.context_length < spec.context_length:
            log.warning(
                "the KV pool holds %d tokens, less than the model's context of %d: requests are limited to it",
                self.context_length,
                spec.context_length,
            )
        self._eos = frozenset(tokenizer.eos_token_ids)
        # Receives each step's outputs, in the step thread (the service routes them to their streams).
        self.on_outputs = on_outputs or (lambda outputs: None)
        # Called once, in the step thread, when the engine stops serving (even with no request open).
        self.on_failure: Callable[[str], None] = lambda message: None
        self._metrics = metrics
        self._clock = clock
        self._live: dict[str, _Live] = {}  # step thread only
        self._generated_tokens = 0
        self._finish_times: deque[float] = deque(maxlen=32)  # to estimate retry hints
        # The inbox, shared with other threads.
        self._wakeup = threading.Condition()
        self._new: list[tuple[EngineRequest, float]] = []
        self._cancels: list[str] = []
        self._ids: set[str] = set()  # every request in the inbox or live
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._failing = ""  # a failure reported from another thread, for the step thread to act on
        self.failure = ""  # why the engine stopped serving, if it did
        if hasattr(runner, "on_failure"):  # a runner whose workers can die between steps tells us
            runner.on_failure = self.fail
        self.stats = self._current_stats()

    # -- any thread ----------------------------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        """Queues a validated request; raises a ``ServiceError`` (full, duplicate, unavailable) if the
        engine does not take it."""
        with self._wakeup:
            if self.failure or self._stopping:
                raise EngineUnavailableError(self.failure or "the engine is stopping")
            if request.request_id in self._ids:
                raise DuplicateRequestError(f"request id {request.request_id!r} is already in use")
            waiting = self.scheduler.num_waiting + len(self._new)
            if waiting >= self.config.max_waiting_requests:
                raise QueueFullError(waiting, self._retry_after_s())
            self._ids.add(request.request_id)
            self._new.append((request, self._clock()))
            self._wakeup.notify()

    def cancel(self, request_id: str) -> None:
        """Stops a request; its blocks are freed at the start of the next step."""
        with self._wakeup:
            if request_id in self._ids:
                self._cancels.append(request_id)
                self._wakeup.notify()

    def fail(self, message: str) -> None:
        """Stops serving, from any thread: the step loop ends every request with ``message``."""
        with self._wakeup:
            self._failing = self._failing or message
            self._wakeup.notify()

    def has_unfinished_requests(self) -> bool:
        with self._wakeup:
            return bool(self._ids)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine-step", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stops the step loop after the step in progress."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.error("the step thread did not stop within %.0fs", timeout_s)

    # -- the step thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        idle = False
        while True:
            with self._wakeup:
                while not (self._stopping or self._failing or self._new or self._cancels):
                    if not self.scheduler.has_work():
                        self._wakeup.wait()
                    elif idle:  # the last step could run nothing: look again soon, without spinning
                        self._wakeup.wait(timeout=0.05)
                        break
                    else:
                        break
                if self._stopping:
                    return
                failing = self._failing
            outputs: list[RequestOutput] = []
            if failing:
                self._fail(failing, outputs)
                self.on_outputs(outputs)
            else:
                try:
                    idle = not self.step()
                except Exception as exc:
                    log.exception("engine step failed; the engine stops serving")
                    self._fail(f"engine step failed: {exc}", outputs)
                    self.on_outputs(outputs)
            if self.failure:
                log.error("the step loop stopped: %s", self.failure)
                return

    def step(self) -> bool:
        """Runs one step; False if there was nothing to do (or the engine failed)."""
        if self.failure:
            return False
        outputs: list[RequestOutput] = []
        self._take_inbox(outputs)
        batch = self.scheduler.schedule()
        if batch.scheduled:
            self._execute(batch, outputs)
        self.events.flush()
        self.stats = self._current_stats()
        if self._metrics is not None:
            self._metrics.observe_step(self.stats)
        if outputs:
            self.on_outputs(outputs)
        return bool(batch.scheduled or outputs)

    def _take_inbox(self, outputs: list[RequestOutput]) -> None:
        with self._wakeup:
            new, self._new = self._new, []
            cancels, self._cancels = self._cancels, []
            # Into the scheduler under the lock, so the waiting count admission reads is never short.
            for request, arrival in new:
                seq = Sequence(request, arrival, self.config.priority_aging_s)
                self._live[request.request_id] = _Live(
                    seq, Detokenizer(self.tokenizer, request.sampling.stop), arrival
                )
                self.scheduler.add(seq)
        for request, _ in new:
            self._replay_resumed(self._live[request.request_id], outputs)
        for request_id in cancels:
            if (live := self._live.get(request_id)) is not None:
                outputs.append(self._end(live, FinishReason.CANCELLED))

    def _replay_resumed(self, live: _Live, outputs: list[RequestOutput]) -> None:
        """Feeds output delivered by an earlier engine through the detokenizer and stop checks, without
        sending it again; a request whose resumed output already ends it finishes at once."""
        resumed = live.seq.request.resumed_output_token_ids
        for position, token in enumerate(resumed, start=1):
            reason, matched_stop, _ = self._check_token(live, token, position)
            if reason is not None:
                outputs.append(self._end(live, reason, matched_stop))
                return

    def _execute(self, batch: SchedulerOutput, outputs: list[RequestOutput]) -> None:
        chunks = []
        for seq, num_new in batch.scheduled.items():
            start = seq.num_computed_tokens
            chunks.append(
                SequenceChunk(
                    token_ids=np.asarray(seq.token_ids[start : start + num_new], dtype=np.int32),
                    start_position=start,
                    block_table=np.asarray(seq.block_table, dtype=np.int32),
                    needs_logits=start + num_new == seq.num_tokens,
                )
            )
        try:
            logits = self.runner.execute(chunks)
        except Exception as exc:
            log.exception("the model runner failed; the engine stops serving")
            self._fail(f"model runner failed: {exc}", outputs)
            return
        self.scheduler.update(batch)
        sampled = [seq for seq, chunk in zip(batch.scheduled, chunks, strict=True) if chunk.needs_logits]
        tokens = sample(
            logits, [seq.request.sampling for seq in sampled], [seq.num_output_tokens for seq in sampled]
        )
        now = self._clock()
        for seq, token in zip(sampled, tokens, strict=True):
            outputs.append(self._append_token(self._live[seq.request_id], token, now))

    def _append_token(self, live: _Live, token: int, now: float) -> RequestOutput:
        seq = live.seq
        index = seq.num_output_tokens
        seq.token_ids.append(token)
        self._generated_tokens += 1
        if live.first_token_at is None:
            live.first_token_at = now
            if self._metrics is not None:
                self._metrics.time_to_first_token.observe(now - live.arrival)
        reason, matched_stop, text = self._check_token(live, token, seq.num_output_tokens)
        output = RequestOutput(seq.request_id, index, [token], text)
        if reason is not None:
            output.finish = self._finish(live, reason, matched_stop)
        return output

    def _check_token(self, live: _Live, token: int, num_output: int) -> tuple[FinishReason | None, str, str]:
        """Detokenizes output token number ``num_output``: (finish reason or None, matched stop, text)."""
        params = live.seq.request.sampling
        return check_token(params, self._eos, self.tokenizer, live.detokenizer, token, num_output)

    def _finish(self, live: _Live, reason: FinishReason, matched_stop: str = "") -> Finish:
        """Ends a request: its blocks go back to the pool now."""
        seq = live.seq
        self.scheduler.finish(seq)
        del self._live[seq.request_id]
        with self._wakeup:
            self._ids.discard(seq.request_id)
        now = self._clock()
        self._finish_times.append(now)
        if self._metrics is not None:
            self._metrics.observe_finish(
                live.arrival, live.first_token_at, now, seq.num_new_output_tokens, reason.value
            )
        return Finish(reason, self._usage(seq), live.detokenizer.flush(), matched_stop)

    @staticmethod
    def _usage(seq: Sequence) -> Usage:
        return Usage(seq.num_context_tokens, max(seq.num_cached_tokens, 0), seq.num_new_output_tokens)

    def _end(self, live: _Live, reason: FinishReason, matched_stop: str = "") -> RequestOutput:
        """Ends a request between tokens (cancelled, or its resumed output already complete)."""
        finish = self._finish(live, reason, matched_stop)
        return RequestOutput(live.seq.request_id, live.seq.num_output_tokens, [], "", finish)

    def _fail(self, message: str, outputs: list[RequestOutput]) -> None:
        """Stops serving: every request ends with ``message`` as its error. The scheduler is not
        consulted (it may be what failed); a failed engine neither steps nor frees blocks again."""
        with self._wakeup:
            self.failure = message
            new, self._new, self._cancels = self._new, [], []
            self._ids.clear()
        for request, _ in new:
            context = len(request.prompt_token_ids) + len(request.resumed_output_token_ids)
            finish = Finish(FinishReason.CANCELLED, Usage(context, 0, 0), error=message)
            outputs.append(
                RequestOutput(request.request_id, len(request.resumed_output_token_ids), [], "", finish)
            )
        for live in self._live.values():
            finish = Finish(FinishReason.CANCELLED, self._usage(live.seq), error=message)
            outputs.append(RequestOutput(live.seq.request_id, live.seq.num_output_tokens, [], "", finish))
        self._live.clear()
        self.on_failure(message)

    def _retry_after_s(self) -> float:
        """About when a queue slot frees up: the mean time between recent finishes."""
        times = self._finish_times
        if len(times) < 2 or times[-1] <= times[0]:
            return _DEFAULT_RETRY_AFTER_S
        return min(30.0, max(0.1, (times[-1] - times[0]) / (len(times) - 1)))

    def _current_stats(self) -> EngineStats:
        return EngineStats(
            waiting_requests=self.scheduler.num_waiting + len(self._new),
            running_requests=len(self.scheduler.running),
            kv_blocks_total=self.kv.num_blocks,
            kv_blocks_used=self.kv.num_used_blocks,
            prefix_hit_tokens=self.scheduler.prefix_hit_tokens,
            prefix_queried_tokens=self.scheduler.prefix_queried_tokens,
            generated_tokens=self._generated_tokens,
            preemptions=self.scheduler.num_preemptions,
        )
