"""A hosted engine: EngineService in front of an engine that schedules and caches on its own.

TensorRT-LLM's ``LLM`` and a Triton server each bring their own scheduler, batching and paged KV
cache, so they do not fit under our ``LLMEngine`` (whose scheduler hands a ``ModelRunner`` one step
at a time). ``HostedEngine`` is the other seam: it offers EngineService exactly what ``LLMEngine``
does (``add_request``/``cancel`` from any thread, outputs through ``on_outputs``, a ``KvEventLog``,
``stats``, ``failure``) and drives a ``GenerationBackend`` that only has to stream token ids.

What stays ours whichever backend computes: request validation (the service), each request's life
(``engine.request_tracker``, shared with ``LLMEngine``: admission, replay of resumed output, the stop
rule, the text released to clients, usage, metrics), the KV event log the router subscribes to and
load reports. This class only adapts the backend: it starts it, streams each request through it,
and passes on what the backend says itself (its own end of a request, its prefix-cache hits, its KV
pool use).

Threading: the backend runs on its own asyncio loop in a thread ("engine-io"), as ``LLMEngine``'s
step loop has its own thread, so a backend's Python work never stalls the gRPC loop. Everything
below marked "loop" runs only there; the KV event log has that thread as its single writer.

Failure: a backend error is treated as the engine failing (every request ends with the error, health
goes NOT_SERVING, the router fails the requests over) — a per-request rejection is not expected
since the service validated the request against the same model.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from chatmesh.finish import FinishReason
from chatmesh.tokenizer import ChatTokenizer
from engine.config import EngineConfig
from engine.kv_events import KvEventLog
from engine.metrics import EngineMetrics
from engine.model.runner import ModelSpec
from engine.outputs import EngineStats, RequestOutput
from engine.request import EngineRequest, SamplingParams
from engine.request_tracker import RequestTracker, TrackedRequest

log = logging.getLogger(__name__)

LOAD_POLL_S = 0.5  # how often the backend's KV usage is read for load reports


@dataclass(frozen=True)
class TokenDelta:
    """New output of one request, as a backend streams it."""

    token_ids: Sequence[int]  # new output tokens, in order (may be empty)
    finish_reason: str | None = None  # "stop" | "length" when the backend ended the request itself
    cached_prompt_tokens: int | None = None  # context tokens the backend reused from its KV cache


@dataclass(frozen=True)
class KvUsage:
    used_blocks: int
    total_blocks: int


class GenerationBackend(Protocol):
    """What a hosted backend implements; every coroutine runs on the engine's io loop."""

    name: str  # "trtllm", "triton": what GetModelInfo reports as the backend
    tensor_parallel_size: int
    context_limit: int | None  # the backend's own longest sequence, once started (None: the model's)

    async def start(self, events: KvEventLog) -> None:
        """Connects or loads the model. A backend with KV events records them into ``events``
        (``stored``/``removed`` then ``flush``) from tasks on this loop until ``close``."""
        ...

    def generate(
        self, request_id: str, context: Sequence[int], params: SamplingParams, max_new_tokens: int
    ) -> AsyncGenerator[TokenDelta]:
        """Streams the output for ``context``. Closing the iterator early must abort the request
        in the backend (its KV blocks are freed there)."""
        ...

    async def kv_usage(self) -> KvUsage | None:
        """The backend's KV pool use now, or None when it does not say."""
        ...

    async def close(self) -> None: ...


@dataclass
class _Counters:
    prefix_hit_tokens: int = 0
    prefix_queried_tokens: int = 0
    kv: KvUsage = field(default_factory=lambda: KvUsage(0, 0))


class HostedEngine:
    """Serves a ``GenerationBackend`` with ``LLMEngine``'s interface (what EngineService calls)."""

    # A backend samples with its own sampler, which is given temperature, top-p, top-k and seed only:
    # requests for more are refused rather than answered without them.
    serves_extra_knobs = False

    def __init__(
        self,
        config: EngineConfig,
        backend: GenerationBackend,
        tokenizer: ChatTokenizer,
        spec: ModelSpec,
        metrics: EngineMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._backend = backend
        # What GetModelInfo reports.
        self.spec = spec
        self.backend = backend.name
        self.tensor_parallel_size = backend.tensor_parallel_size
        self.tokenizer = tokenizer
        self.instance_id = uuid.uuid4().hex
        self.constrained_decoding = False  # the backend samples; it takes no token masks from us
        self.context_length = spec.context_length
        self.events = KvEventLog(config.kv_events_buffer)
        self.on_outputs: Callable[[list[RequestOutput]], None] = lambda outputs: None
        self.on_failure: Callable[[str], None] = lambda message: None
        self.stats = EngineStats()
        self.tracker = RequestTracker(tokenizer, self._release, metrics, clock)
        self.metrics = metrics
        self._tasks: dict[str, asyncio.Task] = {}  # loop: each request's stream through the backend
        self._counters = _Counters()  # loop
        self._load_warned = False  # loop
        self._loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None

    @property
    def failure(self) -> str:
        """Why the engine stopped serving, if it did."""
        return self.tracker.failure

    # -- any thread ----------------------------------------------------------------------------------

    def load(self, timeout_s: float = 1800.0) -> None:
        """Starts the backend and returns once it serves (model loading can take minutes)."""
        ready = threading.Event()
        errors: list[BaseException] = []
        self._thread = threading.Thread(
            target=self._run, args=(ready, errors), name=f"engine-{self.backend}", daemon=True
        )
        self._thread.start()
        if not ready.wait(timeout_s):
            raise RuntimeError(f"the {self.backend} backend did not start within {timeout_s:.0f}s")
        if errors:
            raise RuntimeError(f"the {self.backend} backend did not start: {errors[0]}") from errors[0]

    def start(self) -> None:
        """Nothing left to start: ``load`` started the backend, and requests flow from ``add_request``.
        (``LLMEngine.start`` starts its step thread here; the service calls this on either engine.)"""
        if self._thread is None:
            raise RuntimeError("load() the hosted engine before serving it")

    def add_request(self, request: EngineRequest) -> None:
        # The backend queues internally; we bound what we hand it to running + waiting slots.
        self.tracker.admit(request, self.config.max_running_requests + self.config.max_waiting_requests)
        self._loop.call_soon_threadsafe(self._begin)

    def cancel(self, request_id: str) -> None:
        # After _begin in the loop's FIFO, so a cancel right after add_request finds its task.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._cancel, request_id)

    def stop(self, timeout_s: float = 30.0) -> None:
        self.tracker.stop_admitting()
        if self._stop is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.error("the %s backend did not stop within %.0fs", self.backend, timeout_s)

    def close(self) -> None:
        """Nothing to release: ``stop`` closed the backend on its loop."""

    # -- the loop ------------------------------------------------------------------------------------

    def _run(self, ready: threading.Event, errors: list[BaseException]) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main(ready, errors))
        finally:
            self._loop.close()

    async def _main(self, ready: threading.Event, errors: list[BaseException]) -> None:
        self._stop = asyncio.Event()
        try:
            await self._backend.start(self.events)
        except Exception as exc:
            log.debug("the %s backend failed to start", self.backend, exc_info=True)
            errors.append(exc)
            with contextlib.suppress(Exception):  # release whatever it did start
                await self._backend.close()
            ready.set()
            return
        if self._backend.context_limit:  # longer requests must be refused by the service, not fail here
            self.context_length = min(self.context_length, self._backend.context_limit)
        await self._poll_load()  # GetModelInfo's pool size is known from the first moment
        ready.set()
        try:
            while not self._stop.is_set():
                await self._poll_load()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), LOAD_POLL_S)
        finally:
            tasks = list(self._tasks.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._backend.close()

    async def _poll_load(self) -> None:
        try:
            usage = await self._backend.kv_usage()
        except Exception as exc:  # load reports go stale; serving goes on
            if not self._load_warned:
                log.warning(
                    "the %s backend's KV usage cannot be read (%s); reporting none", self.backend, exc
                )
                self._load_warned = True
            usage = None
        if usage is not None:
            self._counters.kv = usage
        self._publish_stats()

    def _begin(self) -> None:
        for tracked in self.tracker.take_admitted():
            self._counters.prefix_queried_tokens += tracked.num_context_tokens
            self._tasks[tracked.request_id] = self._loop.create_task(self._serve(tracked))
        self._publish_stats()

    def _cancel(self, request_id: str) -> None:
        if (task := self._tasks.get(request_id)) is not None:
            task.cancel()

    def _release(self, request_id: str) -> None:
        """A request ended (the tracker calls this). Its task returns on its own: leaving the backend's
        stream aborts the request there."""
        self._tasks.pop(request_id, None)

    async def _serve(self, tracked: TrackedRequest) -> None:
        request = tracked.request
        try:
            if (ended := self.tracker.replay_resumed(tracked)) is not None:
                self._emit(ended)
                return
            context = (*request.prompt_token_ids, *request.resumed_output_token_ids)
            max_new = request.sampling.max_tokens - len(request.resumed_output_token_ids)
            stream = self._backend.generate(request.request_id, context, request.sampling, max_new)
            async with contextlib.aclosing(stream) as deltas:
                async for delta in deltas:
                    output = self._accept(tracked, delta)
                    self._emit(output)
                    if output.finish is not None:
                        return  # leaving the `async with` aborts the request in the backend
            # The backend ended the stream without a finish reason: it hit its own limit.
            self._emit(self.tracker.end(tracked, FinishReason.LENGTH))
        except asyncio.CancelledError:
            if request.request_id in self.tracker.requests:
                self._emit(self.tracker.end(tracked, FinishReason.CANCELLED))
        except Exception as exc:
            log.exception("the %s backend failed serving %s", self.backend, request.request_id)
            self._fail(f"{self.backend} backend failed: {exc}")

    def _accept(self, tracked: TrackedRequest, delta: TokenDelta) -> RequestOutput:
        """A backend's delta as our output: the backend's prefix-cache hit, our stop rule on its tokens,
        and its own end of the request when ours did not come first."""
        if delta.cached_prompt_tokens is not None:
            cached = min(delta.cached_prompt_tokens, tracked.num_context_tokens)
            self._counters.prefix_hit_tokens += cached - tracked.cached_prompt_tokens
            tracked.cached_prompt_tokens = cached
        output = self.tracker.add_tokens(tracked, delta.token_ids)
        if output.finish is None and delta.finish_reason is not None:
            reason = FinishReason.LENGTH if delta.finish_reason == "length" else FinishReason.STOP
            output.finish = self.tracker.finish(tracked, reason)
        return output

    def _emit(self, output: RequestOutput) -> None:
        self._publish_stats()
        self.on_outputs([output])

    def _fail(self, message: str) -> None:
        """Stops serving: every unfinished request ends with ``message`` as its error."""
        if self.failure:
            return
        outputs = self.tracker.fail(message)
        for task in self._tasks.values():
            if task is not asyncio.current_task():
                task.cancel()
        self._tasks.clear()
        self.on_outputs(outputs)
        self.on_failure(message)

    def _publish_stats(self) -> None:
        started = sum(1 for tracked in self.tracker.requests.values() if tracked.first_token_at is not None)
        c = self._counters
        self.stats = EngineStats(
            waiting_requests=len(self.tracker.requests) - started,
            blocked_requests=len(self.tracker.requests) - started,  # the server's queue is not ours to see
            running_requests=started,
            kv_blocks_total=c.kv.total_blocks,
            kv_blocks_used=c.kv.used_blocks,
            prefix_hit_tokens=c.prefix_hit_tokens,
            prefix_queried_tokens=c.prefix_queried_tokens,
            generated_tokens=self.tracker.generated_tokens,
        )
        if self.metrics is not None:
            self.metrics.observe_step(self.stats)
