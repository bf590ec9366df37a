"""RouterService: the router's gRPC face (see protos/chatmesh/router/v1/router.proto for the contract).

Contract with the caller (the orchestrator), per request on its GenerateMany stream:
- the first frame is `start`; at most one `cancel` may follow. A `cancel` is forwarded to the engine at
  once and the request ends with `finished` (reason CANCELLED) carrying the usage so far;
- half-closing the request side is not a cancel: the requests on the stream go on and every frame is
  still sent;
- cancelling the RPC (or the connection dropping) cancels every request on it, which frees their KV
  blocks. So a caller that wants a request to continue keeps the stream open: the orchestrator owns
  that choice (it keeps relaying into its run buffer when a browser drops, and cancels only when the
  user says so).
"""

from __future__ import annotations

import asyncio
import logging
from array import array
from collections.abc import AsyncIterator

import grpc
from opentelemetry import trace

from chatmesh.errors import ServiceError, abort, unavailable
from chatmesh.router.v1 import router_pb2, router_pb2_grpc
from chatmesh.tiers import is_tier_proto
from meshkit.links import LinkMessages, ServedRequests
from router.config import RouterConfig
from router.embeds import EmbedCalls
from router.metrics import RouterMetrics
from router.placement import Placer, RequestPlan
from router.registry import EngineRegistry
from router.routed_request import RoutedRequest

log = logging.getLogger(__name__)

ROUTER_MESSAGES = LinkMessages.of(router_pb2)
# An engine appends "#<attempt>" to request ids on failover and accepts at most 256 characters.
MAX_REQUEST_ID_CHARS = 200


class RouterService(router_pb2_grpc.RouterServiceServicer):
    def __init__(self, registry: EngineRegistry, config: RouterConfig, metrics: RouterMetrics) -> None:
        self.registry = registry
        self.config = config
        self.metrics = metrics
        self.placer = Placer(registry, config, metrics)
        self.embeds = EmbedCalls(registry.engines)
        self._live: set[str] = set()
        self.draining = False
        self._streams: set[asyncio.Event] = set()  # wake-ups of the open GenerateMany calls

    async def drain(self) -> None:
        self.draining = True
        for wake in self._streams:
            wake.set()

    async def GenerateMany(
        self,
        request_iterator: AsyncIterator[router_pb2.GenerateManyRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[router_pb2.GenerateManyResponse]:
        # A drain ends the call once no request is left on it.
        async for message in _ManyRelays(self).serve(request_iterator, self._streams):
            yield message

    def admit(self, start: router_pb2.GenerateStart, deadline_s: float | None) -> RoutedRequest:
        """The relay of a request this router takes; raises ServiceError if it does not."""
        if self.draining:
            raise unavailable("the router is draining; use another replica")
        if problem := _invalid(start):
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, problem)
        if start.request_id in self._live:
            raise ServiceError(
                grpc.StatusCode.ALREADY_EXISTS, f"request id {start.request_id!r} is already in use"
            )
        plan = RequestPlan(
            request_id=start.request_id,
            prompt=array("I", start.prompt_token_ids),
            model=start.model,
            tokenizer_fingerprint=start.tokenizer_fingerprint,
            tier=start.tier or router_pb2.TIER_FREE,
            session_id=start.session_id,
            opens_session=start.new_session,
        )
        self._live.add(start.request_id)
        return RoutedRequest(start, plan, self.placer, self.config, self.metrics, deadline_s)

    def end(self, relay: RoutedRequest) -> None:
        relay.close()
        self._live.discard(relay.start.request_id)

    async def Embed(
        self, request: router_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.EmbedResponse:
        if self.draining:
            await abort(context, unavailable("the router is draining; use another replica"))
        try:
            return await self.embeds.embed(request, context.time_remaining())
        except ServiceError as exc:
            await abort(context, exc)
            raise  # abort raises; this line only tells the type checker

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


class _ManyRelays(ServedRequests):
    """The requests of one ``GenerateMany`` call on this router: each runs its ``RoutedRequest`` in a task
    of its own, with its deadline from its start frame, under its server span."""

    def __init__(self, service: RouterService) -> None:
        super().__init__(ROUTER_MESSAGES, lambda: service.draining)
        self._service = service
        self._relays: dict[str, tuple[RoutedRequest, asyncio.Task[None]]] = {}

    def start(self, request_id: str, frame: router_pb2.RequestFrame) -> None:
        relay = self._service.admit(frame.start, frame.timeout_ms / 1000 if frame.timeout_ms else None)
        self._relays[request_id] = (relay, asyncio.create_task(self._run(request_id, relay)))

    def cancel(self, request_id: str) -> None:
        self._relays[request_id][0].cancel()

    def stop(self, request_id: str) -> None:
        relay, task = self._relays.pop(request_id)
        relay.close()  # the engine's work is released now: no token of it is relayed after this
        task.cancel()

    async def _run(self, request_id: str, relay: RoutedRequest) -> None:
        error: ServiceError | None = None
        last = None

        def emit(frame: router_pb2.ResponseFrame) -> None:
            nonlocal last
            frame.request_id = request_id
            if frame.WhichOneof("kind") == "finished":
                last = frame  # sent as the request ends
            else:
                self.send(frame)

        try:
            with trace.use_span(self.span(request_id), end_on_exit=False):
                await relay.run(emit)
        except ServiceError as exc:
            error = exc
            if exc.private:
                log.warning("%s (private detail: %s)", exc, exc.private)
        except Exception:
            log.exception("request %s failed in the router", request_id)
            error = ServiceError(grpc.StatusCode.INTERNAL, "the router failed the request")
        finally:
            self._service.end(relay)
            if self._relays.get(request_id, (None,))[0] is relay:
                del self._relays[request_id]
        self.end(request_id, last, error)


def _invalid(start: router_pb2.GenerateStart) -> str:
    """What is wrong with a `start` frame, or "" (the engine checks the rest: vocabulary, context, sampling)."""
    if not start.request_id or len(start.request_id) > MAX_REQUEST_ID_CHARS:
        return f"request_id must have 1 to {MAX_REQUEST_ID_CHARS} characters"
    if not start.prompt_token_ids:
        return "prompt_token_ids must not be empty"
    if start.sampling.max_tokens <= 0:
        return "sampling.max_tokens must be > 0"
    # As many as max_tokens is a request whose stream broke between its last token and its end: the
    # engine ends it at once, with the text it held back (part of a stop string, of a character).
    if len(start.resumed_output_token_ids) > start.sampling.max_tokens:
        return "resumed_output_token_ids must not outnumber sampling.max_tokens"
    if not is_tier_proto(start.tier):
        return f"unknown tier {start.tier}"
    return ""
