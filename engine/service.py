"""EngineService: the engine's gRPC face (see protos/chatmesh/engine/v1/engine.proto for the contract)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import grpc

from chatmesh.engine.v1 import engine_pb2, engine_pb2_grpc
from chatmesh.errors import ServiceError, unavailable
from chatmesh.finish import FinishReason
from chatmesh.tokenizer import ChatTokenizer
from engine.config import EngineConfig
from engine.kv_events import BlocksStored, KvEventBatch, KvEventLog, SubscriberOverflow
from engine.metrics import EngineMetrics
from engine.model.runner import ModelSpec
from engine.outputs import EngineStats, Finish, RequestOutput
from engine.request import EngineRequest
from engine.streams import OutputDispatcher, RequestStream
from engine.structured import CompiledGrammar, GrammarCompiler
from engine.validation import ServedModel, request_from_proto
from meshkit.links import LinkMessages, ServedRequests

log = logging.getLogger(__name__)

ENGINE_MESSAGES = LinkMessages.of(engine_pb2)
DEFAULT_WATCH_INTERVAL_MS = 200
MIN_WATCH_INTERVAL_MS = 10

_FINISH_REASONS = {
    FinishReason.STOP: engine_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: engine_pb2.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: engine_pb2.FINISH_REASON_CANCELLED,
}


class ServedEngine(Protocol):
    """What EngineService serves: ``LLMEngine``, or a ``HostedEngine`` (TensorRT-LLM, Triton)."""

    config: EngineConfig
    tokenizer: ChatTokenizer
    instance_id: str
    constrained_decoding: bool  # whether it masks logits for requests with a constraint (structured)
    metrics: EngineMetrics | None
    context_length: int  # the longest request it takes (prompt + max_tokens)
    events: KvEventLog
    stats: EngineStats  # the load after the last step
    on_outputs: Callable[[list[RequestOutput]], Any]  # called with each step's outputs
    on_failure: Callable[[str], Any]  # called once when it stops serving
    # Whether it applies penalties, logit bias, min-p and logprobs (engine.validation.EXTRA_KNOBS).
    serves_extra_knobs: bool

    @property
    def spec(self) -> ModelSpec: ...
    @property
    def backend(self) -> str: ...  # what computes: "cpu", "null", "cuda", "trtllm", "triton", ...
    @property
    def tensor_parallel_size(self) -> int: ...
    @property
    def failure(self) -> str: ...  # why it stopped serving, if it did

    def add_request(self, request: EngineRequest) -> None: ...
    def cancel(self, request_id: str) -> None: ...
    def start(self) -> None: ...
    def stop(self, timeout_s: float = 30.0) -> None: ...
    def close(self) -> None: ...


class EngineService(engine_pb2_grpc.EngineServiceServicer):
    """Serves one engine. Create it on the event loop that serves it, then ``engine.start()``."""

    def __init__(self, engine: ServedEngine) -> None:
        self.engine = engine
        self._loop = asyncio.get_running_loop()
        self.failed = asyncio.Event()  # set when the engine reports a failure; health should go NOT_SERVING
        self.dispatcher = OutputDispatcher(
            self._loop, on_error=lambda message: self.failed.set(), token_bytes=engine.tokenizer.token_bytes
        )
        engine.on_outputs = self.dispatcher.submit
        engine.on_failure = lambda message: self._loop.call_soon_threadsafe(self.failed.set)
        self.draining = False
        self._watchers: set[asyncio.Event] = set()  # wake-ups of the open streams a drain must end
        self._model = ServedModel(
            name=engine.config.served_model_name or engine.tokenizer.model_name,
            tokenizer_fingerprint=engine.tokenizer.fingerprint,
            vocab_size=engine.spec.vocab_size,
            context_length=engine.context_length,
            serves_extra_knobs=engine.serves_extra_knobs,
        )
        # Constraints compile in threads of their own: a slow one stalls neither the step nor the loop.
        self._grammars = GrammarCompiler(engine.tokenizer) if engine.constrained_decoding else None
        self._compiles = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-compile")

    async def drain(self) -> None:
        """Stops taking requests; ends the watch streams, and each GenerateMany stream once no request is
        left on it, so that only requests in progress hold the drain."""
        self.draining = True
        for wake in self._watchers:
            wake.set()

    @property
    def serving(self) -> bool:
        return not (self.draining or self.engine.failure)

    # -- GenerateMany: every request of one router on one stream ----------------------------------

    async def GenerateMany(
        self,
        request_iterator: AsyncIterator[engine_pb2.GenerateManyRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[engine_pb2.GenerateManyResponse]:
        # A drain ends the call once no request is left on it.
        async for message in _ManyRequests(self).serve(request_iterator, self._watchers):
            yield message

    # -- admission: validated, its constraint compiled, then queued in the engine --------------------

    def validated(self, start: engine_pb2.GenerateStart) -> EngineRequest:
        """The request ``start`` asks for; raises ServiceError if it is not taken."""
        if not self.serving:
            raise unavailable(self.engine.failure or "the engine is draining")
        request = request_from_proto(start, self._model)
        if request.sampling.constraint is not None and self._grammars is None:
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"sampling.structured: the {self.engine.backend} backend does not support structured outputs",
            )
        return request

    def with_cached_grammar(self, request: EngineRequest) -> EngineRequest | None:
        """``request`` ready for the engine without a compile (no constraint, or one compiled before);
        None if its constraint needs ``with_compiled_grammar``."""
        constraint = request.sampling.constraint
        if constraint is None:
            return request
        assert self._grammars is not None  # validated
        compiled = self._grammars.cached(constraint)
        if compiled is not None and self.engine.metrics is not None:
            self.engine.metrics.grammar_cache_hits.inc()
        return None if compiled is None else self._with_grammar(request, compiled)

    async def with_compiled_grammar(self, request: EngineRequest) -> EngineRequest:
        """``request`` with its constraint compiled (in the compile threads); INVALID_ARGUMENT naming
        the problem if it does not compile."""
        constraint = request.sampling.constraint
        assert constraint is not None and self._grammars is not None
        started = self._loop.time()
        try:
            compiled = await self._loop.run_in_executor(self._compiles, self._grammars.compile, constraint)
        except ValueError as exc:
            self._observe_compile(started, "refused")
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"sampling.structured: {exc}") from None
        self._observe_compile(started, "compiled")
        return self._with_grammar(request, compiled)

    def _observe_compile(self, started: float, outcome: str) -> None:
        if self.engine.metrics is not None:
            self.engine.metrics.grammar_compile.labels(outcome).observe(self._loop.time() - started)

    def _with_grammar(self, request: EngineRequest, compiled: CompiledGrammar) -> EngineRequest:
        try:  # output resumed after a failover must be what the constraint allows
            compiled.start(request.resumed_output_token_ids)
        except ValueError as exc:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        return dataclasses.replace(request, grammar=compiled)

    def add(self, request: EngineRequest) -> None:
        """Queues ``request`` in the engine; raises ServiceError (full, draining) if it is not taken."""
        if not self.serving:
            raise unavailable(self.engine.failure or "the engine is draining")
        self.engine.add_request(request)

    def accepted(self, request: EngineRequest) -> engine_pb2.GenerateAccepted:
        return engine_pb2.GenerateAccepted(
            engine_instance_id=self.engine.instance_id,
            context_tokens=len(request.prompt_token_ids) + len(request.resumed_output_token_ids),
        )

    # -- KV events -----------------------------------------------------------------------------------

    async def KvEvents(
        self, request: engine_pb2.KvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.KvEventsResponse]:
        if self.draining:  # a router would only resubscribe in a loop until this process exits
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is draining")
        wake = asyncio.Event()
        snapshot, subscription = self.engine.events.subscribe(lambda: self._wake_from_thread(wake))
        self._watchers.add(wake)
        instance_id = self.engine.instance_id
        try:
            yield engine_pb2.KvEventsResponse(
                engine_instance_id=instance_id,
                snapshot=engine_pb2.KvSnapshot(
                    sequence_number=snapshot.sequence_number, block_hashes=sorted(snapshot.block_hashes)
                ),
            )
            while not self.draining:
                await wake.wait()
                wake.clear()
                try:
                    batches = subscription.take()
                except SubscriberOverflow as exc:
                    await context.abort(grpc.StatusCode.ABORTED, f"{exc}: resubscribe for a fresh snapshot")
                for batch in batches:
                    yield engine_pb2.KvEventsResponse(
                        engine_instance_id=instance_id, batch=_batch_proto(batch)
                    )
        finally:
            self._watchers.discard(wake)
            subscription.close()

    def _wake_from_thread(self, wake: asyncio.Event) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: the process is exiting
            self._loop.call_soon_threadsafe(wake.set)

    # -- load and model info -------------------------------------------------------------------------

    async def WatchLoad(
        self, request: engine_pb2.WatchLoadRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.WatchLoadResponse]:
        async for response in watch_load(request, context, self._watchers, lambda: self.draining, self._load):
            yield response

    async def GetLoad(
        self, request: engine_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.GetLoadResponse:
        return engine_pb2.GetLoadResponse(load=self._load())

    async def GetModelInfo(
        self, request: engine_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.GetModelInfoResponse:
        engine = self.engine
        return engine_pb2.GetModelInfoResponse(
            model=self._model.name,
            tokenizer_fingerprint=self._model.tokenizer_fingerprint,
            block_size=engine.config.block_size,
            block_hash_seed=engine.config.block_hash_seed,
            context_length=engine.context_length,
            vocab_size=self._model.vocab_size,
            eos_token_ids=engine.tokenizer.eos_token_ids,
            backend=engine.backend,
            tensor_parallel_size=engine.tensor_parallel_size,
            engine_instance_id=engine.instance_id,
            kv_blocks_total=engine.stats.kv_blocks_total,
        )

    def _load(self) -> engine_pb2.EngineLoad:
        stats = self.engine.stats
        return engine_pb2.EngineLoad(
            waiting_requests=stats.waiting_requests,
            blocked_requests=stats.blocked_requests,
            running_requests=stats.running_requests,
            max_waiting_requests=self.engine.config.max_waiting_requests,
            max_running_requests=self.engine.config.max_running_requests,
            kv_blocks_total=stats.kv_blocks_total,
            kv_blocks_used=stats.kv_blocks_used,
            kv_usage=stats.kv_usage,
            prefix_hit_tokens=stats.prefix_hit_tokens,
            prefix_queried_tokens=stats.prefix_queried_tokens,
            generated_tokens=stats.generated_tokens,
            serving=self.serving,
            prefill_tokens=stats.prefill_tokens,
            max_batched_tokens=self.engine.config.max_batched_tokens,
            step_fixed_s=stats.step_fixed_s,
            step_token_s=stats.step_token_s,
        )


async def watch_load(
    request: engine_pb2.WatchLoadRequest,
    context: grpc.aio.ServicerContext,
    watchers: set[asyncio.Event],
    draining: Callable[[], bool],
    load: Callable[[], engine_pb2.EngineLoad],
) -> AsyncIterator[engine_pb2.WatchLoadResponse]:
    """WatchLoad of any engine: ``load()`` every interval and at once on a drain (its wake-up joins
    ``watchers``), the stream ending after the report that says the engine drains."""
    interval_ms = request.interval_ms or DEFAULT_WATCH_INTERVAL_MS
    if interval_ms < MIN_WATCH_INTERVAL_MS:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, f"interval_ms must be 0 or >= {MIN_WATCH_INTERVAL_MS}"
        )
    wake = asyncio.Event()
    watchers.add(wake)
    try:
        while True:
            # Read the flag before the report: a drain that lands while the report is in flight must
            # still be followed by one more report saying serving: false.
            drained = draining()
            yield engine_pb2.WatchLoadResponse(load=load())
            if drained:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), interval_ms / 1000)
    finally:
        watchers.discard(wake)


class _ManyRequests(ServedRequests):
    """The requests of one ``GenerateMany`` call on this engine: each message carries every request's
    tokens sampled since the last one, merged as its ``RequestStream`` merges them, with its finish."""

    def __init__(self, service: EngineService) -> None:
        super().__init__(ENGINE_MESSAGES, lambda: service.draining)
        self._service = service
        self._with_news: dict[str, RequestStream] = {}  # in the order news came
        # Requests whose constraint is compiling, and those of them the client cancelled meanwhile.
        self._compiling: dict[str, asyncio.Task] = {}
        self._cancelled_compiling: set[str] = set()

    def start(self, request_id: str, frame: engine_pb2.RequestFrame) -> None:
        request = self._service.validated(frame.start)
        ready = self._service.with_cached_grammar(request)
        if ready is not None:
            self._add(request_id, ready)
        else:
            self._compiling[request_id] = asyncio.ensure_future(self._compile_then_add(request_id, request))

    async def _compile_then_add(self, request_id: str, request: EngineRequest) -> None:
        try:
            self._add(request_id, await self._service.with_compiled_grammar(request))
        except ServiceError as exc:
            self.end(request_id, error=exc)
        finally:
            self._compiling.pop(request_id, None)
        if request_id in self._cancelled_compiling:  # it ends as cancelled, as any other would
            self._cancelled_compiling.discard(request_id)
            self._service.engine.cancel(request_id)

    def _add(self, request_id: str, request: EngineRequest) -> None:
        self._service.add(request)
        # Before any await: no output can be delivered earlier.
        self._service.dispatcher.open(request_id, self._stream_has_news)
        self.send(engine_pb2.ResponseFrame(request_id=request_id, accepted=self._service.accepted(request)))

    def cancel(self, request_id: str) -> None:
        if request_id in self._compiling:
            self._cancelled_compiling.add(request_id)
        else:
            self._service.engine.cancel(request_id)

    def stop(self, request_id: str) -> None:
        if (compiling := self._compiling.pop(request_id, None)) is not None:
            compiling.cancel()
            self._cancelled_compiling.discard(request_id)
            return
        self._with_news.pop(request_id, None)
        self._service.dispatcher.close(request_id)
        self._service.engine.cancel(request_id)

    def _stream_has_news(self, stream: RequestStream) -> None:
        self._with_news[stream.request_id] = stream
        self.news.set()

    def gather(self) -> None:
        for request_id, stream in self._with_news.items():
            tokens, finish = stream.take()
            if tokens is not None:
                self.send(engine_pb2.ResponseFrame(request_id=request_id, tokens=tokens))
            if finish is None:
                continue
            self._service.dispatcher.close(request_id)
            if (failure := _failure(finish)) is not None:
                self.end(request_id, error=failure)
            else:
                finished = engine_pb2.ResponseFrame(request_id=request_id, finished=_finished_proto(finish))
                self.end(request_id, finished)
        self._with_news = {}


def _failure(finish: Finish) -> ServiceError | None:
    """How a request that did not complete ends: refused (it waited past its queue limit), or failed
    with the engine; None for a request that completed."""
    if finish.refusal is not None:
        return finish.refusal
    return unavailable(finish.error) if finish.error else None


def _finished_proto(finish: Finish) -> engine_pb2.GenerateFinished:
    return engine_pb2.GenerateFinished(
        finish_reason=_FINISH_REASONS[finish.reason],
        text=finish.text,
        usage=engine_pb2.Usage(
            prompt_tokens=finish.usage.prompt_tokens,
            cached_prompt_tokens=finish.usage.cached_prompt_tokens,
            completion_tokens=finish.usage.completion_tokens,
        ),
        matched_stop=finish.matched_stop,
    )


def _batch_proto(batch: KvEventBatch) -> engine_pb2.KvEventBatch:
    events = []
    for event in batch.events:
        if isinstance(event, BlocksStored):
            stored = engine_pb2.BlocksStored(block_hashes=event.block_hashes)
            if event.parent_block_hash is not None:
                stored.parent_block_hash = event.parent_block_hash
            events.append(engine_pb2.KvEvent(stored=stored))
        else:
            events.append(
                engine_pb2.KvEvent(removed=engine_pb2.BlocksRemoved(block_hashes=event.block_hashes))
            )
    return engine_pb2.KvEventBatch(sequence_number=batch.sequence_number, events=events)
