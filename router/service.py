"""RouterService: the router's gRPC face (see protos/chatmesh/router/v1/router.proto for the contract).

Stream contract with the caller (the orchestrator):
- the first frame is `start`; at most one `cancel` may follow. A `cancel` is forwarded to the engine at
  once and the stream ends with `finished` (reason CANCELLED) carrying the usage so far;
- half-closing the request side is not a cancel: generation goes on and every frame is still sent;
- cancelling the RPC (or the connection dropping) cancels the engine call, which frees its KV blocks.
  So a client that goes away without a `cancel` frame must keep its end of the stream open if it wants
  the run to continue: the orchestrator owns that choice (it keeps relaying into its run buffer when
  a browser drops, and cancels only when the user says so).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc
from opentelemetry import trace

from chatmesh.engine.v1 import engine_pb2
from chatmesh.errors import ServiceError, abort, unavailable
from chatmesh.router.v1 import router_pb2, router_pb2_grpc
from chatmesh.streams import MISUSE, StartThenCancel
from chatmesh.tiers import is_tier_proto
from chatmesh.token_text import coalesced
from meshkit.telemetry import request_span
from router.config import RouterConfig
from router.metrics import RouterMetrics
from router.placement import Placer, RequestPlan
from router.registry import EngineRegistry
from router.relay import Relay

log = logging.getLogger(__name__)

# Each request on a GenerateMany stream is traced as the Generate it stands for.
ROUTER_GENERATE_SPAN = "chatmesh.router.v1.RouterService/Generate"
# An engine appends "#<attempt>" to request ids on failover and accepts at most 256 characters.
MAX_REQUEST_ID_CHARS = 200


class RouterService(router_pb2_grpc.RouterServiceServicer):
    def __init__(self, registry: EngineRegistry, config: RouterConfig, metrics: RouterMetrics) -> None:
        self.registry = registry
        self.config = config
        self.metrics = metrics
        self.placer = Placer(registry, config, metrics)
        self._live: set[str] = set()
        self._draining = False
        self._streams: set[asyncio.Event] = set()  # wake-ups of the open GenerateMany calls

    async def drain(self) -> None:
        self._draining = True
        for wake in self._streams:
            wake.set()

    async def Generate(
        self, request_iterator: AsyncIterator[router_pb2.GenerateRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        requests = StartThenCancel(request_iterator)
        start = await requests.start(context)
        try:
            relay = self._admit(start, context.time_remaining())
        except ServiceError as exc:
            await abort(context, exc)
        requests.watch(on_cancel=relay.cancel)
        try:
            async for frame in relay.run():
                kind = frame.WhichOneof("kind")
                yield router_pb2.GenerateResponse(**{kind: getattr(frame, kind)})
        except ServiceError as exc:
            await abort(context, exc)
        finally:
            requests.stop()
            self._end(relay)
        await requests.check(context)

    async def GenerateMany(
        self,
        request_iterator: AsyncIterator[router_pb2.GenerateManyRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[router_pb2.GenerateManyResponse]:
        many = _ManyRelays(self)
        reader = asyncio.create_task(many.read(request_iterator))
        self._streams.add(many.news)  # a drain ends the call once no request is left on it
        try:
            while frames := await many.next_frames():
                yield router_pb2.GenerateManyResponse(frames=frames)
        finally:
            self._streams.discard(many.news)
            reader.cancel()
            many.close()  # the client went away, or cancelled the call: every request left is cancelled

    def _admit(self, start: router_pb2.GenerateStart, deadline_s: float | None) -> Relay:
        """The relay of a request this router takes; raises ServiceError if it does not."""
        if self._draining:
            raise unavailable("the router is draining; use another replica")
        if problem := _invalid(start):
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, problem)
        if start.request_id in self._live:
            raise ServiceError(
                grpc.StatusCode.ALREADY_EXISTS, f"request id {start.request_id!r} is already in use"
            )
        plan = RequestPlan(
            request_id=start.request_id,
            prompt=list(start.prompt_token_ids),
            model=start.model,
            tokenizer_fingerprint=start.tokenizer_fingerprint,
            tier=start.tier or router_pb2.TIER_FREE,
            session_id=start.session_id,
            opens_session=start.new_session,
        )
        self._live.add(start.request_id)
        return Relay(start, plan, self.placer, self.config, self.metrics, deadline_s)

    def _end(self, relay: Relay) -> None:
        relay.close()
        self._live.discard(relay.start.request_id)

    async def ListEngines(
        self, request: router_pb2.ListEnginesRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ListEnginesResponse:
        statuses = []
        for engine in self.registry.engines():
            info = engine.info
            if request.model and (info is None or info.model != request.model):
                continue
            status = router_pb2.EngineStatus(
                engine_id=engine.engine_id,
                address=engine.address,
                model=info.model if info else "",
                healthy=engine.healthy,
                indexed_blocks=self.registry.index.size(engine.engine_id),
                backend=info.backend if info else "",
                inflight_requests=len(engine.inflight),
                sessions_held=engine.sessions,
            )
            if engine.load is not None:
                status.load.CopyFrom(engine.load)
            statuses.append(status)
        return router_pb2.ListEnginesResponse(engines=statuses)


class _ManyRelays:
    """The requests of one ``GenerateMany`` call: each runs its ``Relay`` in a task of its own, and what
    they have to say goes out together, every frame since the last message in one (a request's token
    frames that piled up while the call was slow to write merged into one). Each request gets a server
    span of its own, continuing the trace context its start carried, and its deadline from its start."""

    def __init__(self, service: RouterService) -> None:
        self._service = service
        self._relays: dict[str, asyncio.Task[None]] = {}
        self._relay_of: dict[str, Relay] = {}
        self._pending: dict[str, list[router_pb2.ResponseFrame]] = {}  # by request, in the order news came
        self.news = asyncio.Event()
        self._half_closed = False

    async def read(self, request_iterator: AsyncIterator[router_pb2.GenerateManyRequest]) -> None:
        """Applies the client's frames until it half-closes (or the call ends)."""
        with contextlib.suppress(grpc.RpcError):
            async for message in request_iterator:
                for frame in message.frames:
                    kind = frame.WhichOneof("kind")
                    if kind == "start":
                        self._start(frame)
                    elif kind == "cancel" and (relay := self._relay_of.get(frame.request_id)) is not None:
                        relay.cancel()
        self._half_closed = True
        self.news.set()

    def _start(self, frame: router_pb2.RequestFrame) -> None:
        request_id = frame.request_id or frame.start.request_id
        if (running := self._relays.get(request_id)) is not None:  # misuse, as on a Generate call
            running.cancel()  # its task ends the request; the refusal below is its last frame
            self._relays.pop(request_id)
            self._fail(request_id, ServiceError(grpc.StatusCode.INVALID_ARGUMENT, MISUSE))
            return
        span = request_span(ROUTER_GENERATE_SPAN, trace.SpanKind.SERVER, frame.trace_context)
        try:
            if frame.start.request_id != request_id:
                raise ServiceError(
                    grpc.StatusCode.INVALID_ARGUMENT, "the frame's request_id is not its start's"
                )
            relay = self._service._admit(frame.start, frame.timeout_ms / 1000 if frame.timeout_ms else None)
        except ServiceError as exc:
            _end_span(span, exc)
            self._fail(request_id, exc)
            return
        self._relay_of[request_id] = relay
        self._relays[request_id] = asyncio.create_task(self._run(request_id, relay, span))

    async def _run(self, request_id: str, relay: Relay, span: trace.Span) -> None:
        error: ServiceError | None = None
        try:
            with trace.use_span(span, end_on_exit=False):
                async for frame in relay.run():
                    frame.request_id = request_id
                    self._send(frame)
        except ServiceError as exc:
            error = exc
        except Exception:
            log.exception("request %s failed in the router", request_id)
            error = ServiceError(grpc.StatusCode.INTERNAL, "the router failed the request")
        finally:
            self._service._end(relay)
            self._relay_of.pop(request_id, None)
            if self._relays.get(request_id) is asyncio.current_task():
                del self._relays[request_id]
            _end_span(span, error)
        if error is not None:
            self._fail(request_id, error)

    def _fail(self, request_id: str, error: ServiceError) -> None:
        if error.private:
            log.warning("%s (private detail: %s)", error, error.private)
        self._send(
            router_pb2.ResponseFrame(
                request_id=request_id, failed=engine_pb2.GenerateFailed(status=error.status())
            )
        )

    def _send(self, frame: router_pb2.ResponseFrame) -> None:
        self._pending.setdefault(frame.request_id, []).append(frame)
        self.news.set()

    async def next_frames(self) -> list[router_pb2.ResponseFrame]:
        """Waits for news and returns it as frames; [] once the call should end: the client half-closed
        and every request ended, or the router drains and none is left."""
        while True:
            if self._pending:
                pending, self._pending = self._pending, {}
                frames = []
                for request_id, request_frames in pending.items():
                    for frame in coalesced(request_frames) if len(request_frames) > 1 else request_frames:
                        frame.request_id = request_id
                        frames.append(frame)
                return frames
            if not self._relays and (self._half_closed or self._service._draining):
                return []
            self.news.clear()
            await self.news.wait()

    def close(self) -> None:
        for task in self._relays.values():
            task.cancel()
        self._relays = {}


def _end_span(span: trace.Span, error: ServiceError | None) -> None:
    if error is not None:
        span.set_status(trace.StatusCode.ERROR, error.message)
    span.end()


def _invalid(start: router_pb2.GenerateStart) -> str:
    """What is wrong with a `start` frame, or "" (the engine checks the rest: vocabulary, context, sampling)."""
    if not start.request_id or len(start.request_id) > MAX_REQUEST_ID_CHARS:
        return f"request_id must have 1 to {MAX_REQUEST_ID_CHARS} characters"
    if not start.prompt_token_ids:
        return "prompt_token_ids must not be empty"
    if start.sampling.max_tokens <= 0:
        return "sampling.max_tokens must be > 0"
    if len(start.resumed_output_token_ids) >= start.sampling.max_tokens:
        return "resumed_output_token_ids must be fewer than sampling.max_tokens (nothing left to generate)"
    if not is_tier_proto(start.tier):
        return f"unknown tier {start.tier}"
    return ""
