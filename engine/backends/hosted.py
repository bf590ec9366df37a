"""A hosted engine: EngineService in front of an engine that schedules and caches on its own.

TensorRT-LLM's ``LLM`` and a Triton server each bring their own scheduler, batching and paged KV
cache, so they do not fit under our ``LLMEngine`` (whose scheduler hands a ``ModelRunner`` one step
at a time). ``HostedEngine`` is the other seam: it offers EngineService exactly what ``LLMEngine``
does (``add_request``/``cancel`` from any thread, outputs through ``on_outputs``, a ``KvEventLog``,
``stats``, ``failure``) and drives a ``GenerationBackend`` that only has to stream token ids.

What stays ours whichever backend computes: request validation (the service), the stop rule
(``engine.stopping``: EOS, stop tokens, stop strings, max_tokens, on our detokenizer), the text
released to clients, usage accounting, the KV event log the router subscribes to, load reports and
metrics. A backend that ends a request on its own (its EOS, its length limit) is honoured too.

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
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from chatmesh.tokenizer import ChatTokenizer
from engine.config import EngineConfig
from engine.detokenizer import Detokenizer
from engine.kv_events import KvEventLog
from engine.llm_engine import DuplicateRequestError, EngineUnavailableError, QueueFullError
from engine.metrics import EngineMetrics
from engine.model.runner import ModelSpec
from engine.outputs import EngineStats, Finish, FinishReason, RequestOutput, Usage
from engine.sequence import EngineRequest, SamplingParams
from engine.stopping import check_token

log = logging.getLogger(__name__)

LOAD_POLL_S = 0.5  # how often the backend's KV usage is read for load reports
_RETRY_AFTER_S = 1.0


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
    ) -> AsyncIterator[TokenDelta]:
        """Streams the output for ``context``. Closing the iterator early must abort the request
        in the backend (its KV blocks are freed there)."""
        ...

    async def kv_usage(self) -> KvUsage | None:
        """The backend's KV pool use now, or None when it does not say."""
        ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class HostedRunner:
    """The runner facts EngineService reports (``GetModelInfo``); the backend does the computing, and
    the engine's ``stop`` closes it, so ``close`` has nothing left to release."""

    spec: ModelSpec
    backend: str
    tensor_parallel_size: int

    def close(self) -> None:
        pass


@dataclass(eq=False)
class _Live:
    request: EngineRequest
    detokenizer: Detokenizer
    arrival: float
    num_output: int = 0  # output tokens so far, resumed ones included
    new_tokens: int = 0
    cached_tokens: int = 0
    first_token_at: float | None = None
    task: asyncio.Task | None = None

    @property
    def context_tokens(self) -> int:
        return len(self.request.prompt_token_ids) + len(self.request.resumed_output_token_ids)


@dataclass
class _Counters:
    prefix_hit_tokens: int = 0
    prefix_queried_tokens: int = 0
    generated_tokens: int = 0
    kv: KvUsage = field(default_factory=lambda: KvUsage(0, 0))


class HostedEngine:
    """Serves a ``GenerationBackend`` with ``LLMEngine``'s interface (what EngineService calls)."""

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
        self.backend = backend
        self.tokenizer = tokenizer
        self.runner = HostedRunner(spec, backend.name, backend.tensor_parallel_size)
        self.instance_id = uuid.uuid4().hex
        self.context_length = spec.context_length
        self.events = KvEventLog(config.kv_events_buffer)
        self.on_outputs: Callable[[list[RequestOutput]], None] = lambda outputs: None
        self.failure = ""
        self.stats = EngineStats()
        self._metrics = metrics
        self._clock = clock
        self._eos = frozenset(tokenizer.eos_token_ids)
        self._lock = threading.Lock()
        self._admitted: set[str] = set()  # request ids admitted and not finished (any thread, under lock)
        self._stopping = False
        self._live: dict[str, _Live] = {}  # loop
        self._counters = _Counters()  # loop
        self._load_warned = False  # loop
        self._loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None

    # -- any thread ----------------------------------------------------------------------------------

    def load(self, timeout_s: float = 1800.0) -> None:
        """Starts the backend and returns once it serves (model loading can take minutes)."""
        ready = threading.Event()
        errors: list[BaseException] = []
        self._thread = threading.Thread(
            target=self._run, args=(ready, errors), name=f"engine-{self.backend.name}", daemon=True
        )
        self._thread.start()
        if not ready.wait(timeout_s):
            raise RuntimeError(f"the {self.backend.name} backend did not start within {timeout_s:.0f}s")
        if errors:
            raise RuntimeError(f"the {self.backend.name} backend did not start: {errors[0]}") from errors[0]

    def start(self) -> None:
        """Nothing left to start: ``load`` started the backend, and requests flow from ``add_request``.
        (``LLMEngine.start`` starts its step thread here; the service calls this on either engine.)"""
        if self._thread is None:
            raise RuntimeError("load() the hosted engine before serving it")

    def add_request(self, request: EngineRequest) -> None:
        with self._lock:
            if self.failure or self._stopping:
                raise EngineUnavailableError(self.failure or "the engine is stopping")
            if request.request_id in self._admitted:
                raise DuplicateRequestError(f"request id {request.request_id!r} is already in use")
            # The backend queues internally; we bound what we hand it to running + waiting slots.
            limit = self.config.max_running_requests + self.config.max_waiting_requests
            if len(self._admitted) >= limit:
                raise QueueFullError(len(self._admitted), _RETRY_AFTER_S)
            self._admitted.add(request.request_id)
        self._loop.call_soon_threadsafe(self._begin, request, self._clock())

    def cancel(self, request_id: str) -> None:
        # After _begin in the loop's FIFO, so a cancel right after add_request finds its task.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._cancel, request_id)

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self._admitted)

    def stop(self, timeout_s: float = 30.0) -> None:
        with self._lock:
            self._stopping = True
        if self._stop is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.error("the %s backend did not stop within %.0fs", self.backend.name, timeout_s)

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
            await self.backend.start(self.events)
        except Exception as exc:
            log.debug("the %s backend failed to start", self.backend.name, exc_info=True)
            errors.append(exc)
            with contextlib.suppress(Exception):  # release whatever it did start
                await self.backend.close()
            ready.set()
            return
        if self.backend.context_limit:  # longer requests must be refused by the service, not fail here
            self.context_length = min(self.context_length, self.backend.context_limit)
        await self._poll_load()  # GetModelInfo's pool size is known from the first moment
        ready.set()
        try:
            while not self._stop.is_set():
                await self._poll_load()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), LOAD_POLL_S)
        finally:
            for live in list(self._live.values()):
                if live.task is not None:
                    live.task.cancel()
            await asyncio.gather(
                *(t for live in self._live.values() if (t := live.task)), return_exceptions=True
            )
            await self.backend.close()

    async def _poll_load(self) -> None:
        try:
            usage = await self.backend.kv_usage()
        except Exception as exc:  # load reports go stale; serving goes on
            if not self._load_warned:
                log.warning(
                    "the %s backend's KV usage cannot be read (%s); reporting none", self.backend.name, exc
                )
                self._load_warned = True
            usage = None
        if usage is not None:
            self._counters.kv = usage
        self._publish_stats()

    def _begin(self, request: EngineRequest, arrival: float) -> None:
        live = _Live(request, Detokenizer(self.tokenizer, request.sampling.stop), arrival)
        self._live[request.request_id] = live
        self._counters.prefix_queried_tokens += live.context_tokens
        live.task = self._loop.create_task(self._serve(live))
        self._publish_stats()

    def _cancel(self, request_id: str) -> None:
        if (live := self._live.get(request_id)) is not None and live.task is not None:
            live.task.cancel()

    async def _serve(self, live: _Live) -> None:
        request = live.request
        try:
            if (ended := self._replay_resumed(live)) is not None:
                self._emit(ended)
                return
            context = (*request.prompt_token_ids, *request.resumed_output_token_ids)
            max_new = request.sampling.max_tokens - len(request.resumed_output_token_ids)
            stream = self.backend.generate(request.request_id, context, request.sampling, max_new)
            async with contextlib.aclosing(stream) as deltas:
                async for delta in deltas:
                    output = self._accept(live, delta)
                    self._emit(output)
                    if output.finish is not None:
                        return  # leaving the `async with` aborts the request in the backend
            # The backend ended the stream without a finish reason: it hit its own limit.
            self._emit(self._end(live, FinishReason.LENGTH))
        except asyncio.CancelledError:
            if request.request_id in self._live:
                self._emit(self._end(live, FinishReason.CANCELLED))
        except Exception as exc:
            log.exception("the %s backend failed serving %s", self.backend.name, request.request_id)
            self._fail(f"{self.backend.name} backend failed: {exc}")

    def _replay_resumed(self, live: _Live) -> RequestOutput | None:
        """Output an earlier engine delivered goes through the stop check without being sent again."""
        for token in live.request.resumed_output_token_ids:
            live.num_output += 1
            reason, matched, _ = self._check(live, token)
            if reason is not None:
                return self._end(live, reason, matched)
        return None

    def _accept(self, live: _Live, delta: TokenDelta) -> RequestOutput:
        now = self._clock()
        if delta.cached_prompt_tokens is not None:
            live.cached_tokens = min(delta.cached_prompt_tokens, live.context_tokens)
        output = RequestOutput(live.request.request_id, live.num_output, [], "")
        texts = []
        for token in delta.token_ids:
            if live.first_token_at is None:
                live.first_token_at = now
                if self._metrics is not None:
                    self._metrics.time_to_first_token.observe(now - live.arrival)
            live.num_output += 1
            live.new_tokens += 1
            self._counters.generated_tokens += 1
            output.token_ids.append(token)
            reason, matched, text = self._check(live, token)
            texts.append(text)
            if reason is not None:
                output.text = "".join(texts)
                output.finish = self._finish(live, reason, matched)
                return output
        output.text = "".join(texts)
        if delta.finish_reason is not None:
            reason = FinishReason.LENGTH if delta.finish_reason == "length" else FinishReason.STOP
            output.finish = self._finish(live, reason)
        return output

    def _check(self, live: _Live, token: int) -> tuple[FinishReason | None, str, str]:
        params = live.request.sampling
        return check_token(params, self._eos, self.tokenizer, live.detokenizer, token, live.num_output)

    def _finish(self, live: _Live, reason: FinishReason, matched_stop: str = "") -> Finish:
        self._live.pop(live.request.request_id, None)
        with self._lock:
            self._admitted.discard(live.request.request_id)
        self._counters.prefix_hit_tokens += live.cached_tokens
        if self._metrics is not None:
            self._metrics.observe_finish(
                live.arrival, live.first_token_at, self._clock(), live.new_tokens, reason.value
            )
        usage = Usage(live.context_tokens, live.cached_tokens, live.new_tokens)
        return Finish(reason, usage, live.detokenizer.flush(), matched_stop)

    def _end(self, live: _Live, reason: FinishReason, matched_stop: str = "") -> RequestOutput:
        finish = self._finish(live, reason, matched_stop)
        return RequestOutput(live.request.request_id, live.num_output, [], "", finish)

    def _emit(self, output: RequestOutput) -> None:
        self._publish_stats()
        self.on_outputs([output])

    def _fail(self, message: str) -> None:
        """Stops serving: every live request ends with ``message`` as its error."""
        with self._lock:
            if self.failure:
                return
            self.failure = message
            self._admitted.clear()
        outputs = []
        for live in list(self._live.values()):
            usage = Usage(live.context_tokens, live.cached_tokens, live.new_tokens)
            finish = Finish(FinishReason.CANCELLED, usage, error=message)
            outputs.append(RequestOutput(live.request.request_id, live.num_output, [], "", finish))
            if live.task is not None and live.task is not asyncio.current_task():
                live.task.cancel()
        self._live.clear()
        self.on_outputs(outputs)

    def _publish_stats(self) -> None:
        started = sum(1 for live in self._live.values() if live.first_token_at is not None)
        c = self._counters
        self.stats = EngineStats(
            waiting_requests=len(self._live) - started,
            running_requests=started,
            kv_blocks_total=c.kv.total_blocks,
            kv_blocks_used=c.kv.used_blocks,
            prefix_hit_tokens=c.prefix_hit_tokens,
            prefix_queried_tokens=c.prefix_queried_tokens,
            generated_tokens=c.generated_tokens,
        )
        if self._metrics is not None:
            self._metrics.observe_step(self.stats)
