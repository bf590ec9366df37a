"""The orchestrator's side of ``chatmesh.router.v1.RouterService``.

A generation is one request on a router: a ``start`` with the prompt's token ids (tokenized once,
here, with ``chatmesh.tokenizer``), then at most one ``cancel``. It stays open while the run lives:
a dropped browser does not stop engine work; only ``cancel()`` (CancelRun, output moderation) or
``abort()`` does. Every request to one router travels on one ``GenerateMany`` stream to it
(``meshkit.links``): the tokens of all of them cross in a message per router loop turn, not one per
token.

Several router replicas (``--router 10.0.0.1:50051,10.0.0.2:50051``, or a ``dns:///`` name with one
address per replica): each gets its own channel and stream; a chat's requests go to one router while it
is up, others round-robin, and a router that is down is passed over. Every start frame carries a
sampling seed, so a generation whose router dies goes on through another one exactly (``continued``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
from collections.abc import AsyncIterator, Callable, Sequence

import grpc
from opentelemetry import trace

from chatmesh.engine.v1 import engine_pb2
from chatmesh.errors import ServiceError, parse, unavailable
from chatmesh.limits import Generation
from chatmesh.router.v1 import router_pb2, router_pb2_grpc
from chatmesh.tiers import tier_named
from chatmesh.token_text import coalesced
from meshkit.links import Link, LinkMessages, RequestFeed
from meshkit.replicas import DNS_REFRESH_S, Replica, Replicas
from meshkit.telemetry import request_span, trace_context
from orchestrator.errors import from_downstream, from_rpc_error

log = logging.getLogger(__name__)

# How many routers one placement tries when they answer UNAVAILABLE (draining, or unreachable).
PLACEMENT_ATTEMPTS = 3
ROUTER_LINK = LinkMessages.of(router_pb2)


def start_frame(
    request_id: str,
    prompt: list[int],
    generation: Generation,
    tier: str,
    session_id: str,
    fingerprint: str,
    new_session: bool = False,
) -> router_pb2.GenerateStart:
    sampling = engine_pb2.SamplingParams(
        temperature=generation.temperature,
        top_p=generation.top_p,
        max_tokens=generation.max_tokens,
        stop=list(generation.stop),
        structured=generation.structured,
        presence_penalty=generation.presence_penalty,
        frequency_penalty=generation.frequency_penalty,
        logit_bias=dict(generation.logit_bias),
        min_p=generation.min_p,
        logprobs=generation.logprobs,
        top_logprobs=generation.top_logprobs,
    )
    # A seed of its own when the caller gave none: sampling is a function of (seed, position), so the
    # answer can be continued on another router or by another replica, token for token.
    sampling.seed = generation.seed if generation.seed is not None else request_seed(request_id)
    return router_pb2.GenerateStart(
        request_id=request_id,
        model=generation.model,
        prompt_token_ids=prompt,
        sampling=sampling,
        tier=tier_named(tier).proto,
        session_id=session_id,
        tokenizer_fingerprint=fingerprint,
        new_session=new_session,
    )


def request_seed(request_id: str) -> int:
    """The sampling seed of a request whose caller chose none: a function of its id (a run's id), so two
    attempts that ever start the same run (a start lease taken over while its holder still wrote the
    run) generate the same answer and store the same checkpoints, while another run (a regenerated
    answer) samples anew."""
    return int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "big") >> 1


def continued(start: router_pb2.GenerateStart, output_token_ids: Sequence[int]) -> router_pb2.GenerateStart:
    """``start`` again, resuming after ``output_token_ids`` (what the run has streamed so far), under a
    request id of its own (an earlier attempt may still be winding down on a router or engine)."""
    frame = router_pb2.GenerateStart()
    frame.CopyFrom(start)
    frame.request_id = f"{start.request_id.partition('~')[0]}~{secrets.token_hex(4)}"
    frame.resumed_output_token_ids[:] = output_token_ids
    return frame


class RouterError(Exception):
    """What a router (or the stream to it) said of one request: its status as the router sent it. The
    orchestrator tells its own callers ``from_downstream(error, "the router")``."""

    def __init__(self, error: ServiceError) -> None:
        super().__init__(str(error))
        self.error = error


class GenerateStream:
    """One request on a router's shared stream (``meshkit.links.Link``), with a client span of its own
    whose context goes to the router with the start. ``open`` sends the start and waits for the router
    to place it."""

    def __init__(self, router: RouterReplica, start: router_pb2.GenerateStart) -> None:
        self.router = router
        self.start = start
        self.routed: router_pb2.GenerateRouted | None = None
        self._span = request_span(ROUTER_LINK.span_name, trace.SpanKind.CLIENT)
        self._span.set_attribute("chatmesh.router", router.address)
        self._feed: RequestFeed | None = None
        self._pending: list[router_pb2.ResponseFrame] = []  # arrived with `routed`, not yet taken
        self._released = False

    async def open(self, deadline_s: float, placement_timeout_s: float) -> None:
        """Sends the start (``deadline_s`` for the whole request) and returns once the router placed it;
        a refusal (shed under load, no engine for the model) raises RouterError."""
        feed = self._feed = self.router.link.open(
            self.start, trace_context(self._span), timeout_ms=max(1, round(deadline_s * 1000))
        )
        try:
            async with asyncio.timeout(placement_timeout_s):
                frames = await feed.take()
        except TimeoutError:
            self.abort()
            raise RouterError(
                unavailable("the router did not place the request in time; retry", 1.0)
            ) from None
        except ServiceError as exc:
            self.abort(exc)
            raise RouterError(exc) from None
        if frames[0].WhichOneof("kind") != "routed":
            self.abort()
            raise RouterError(unavailable("the router answered before placing the request; retry", 1.0))
        self.routed = frames[0].routed
        self._pending = frames[1:]

    async def frames(
        self, on_tokens: Callable[[engine_pb2.GenerateTokens], None]
    ) -> AsyncIterator[router_pb2.ResponseFrame]:
        """The frames after the first placement, through ``finished``; a failure raises RouterError.
        Token frames go to ``on_tokens``, as they arrive, on the router link's reading task
        (``RequestFeed.on_tokens``): the caller's task wakes for the other frames only. ``on_tokens``
        must not await, nor may the caller between two frames. Token frames that arrived before the
        caller came for them go to it merged into one."""
        assert self._feed is not None
        batch, self._pending = self._pending, []
        self._feed.on_tokens = on_tokens
        try:
            while True:
                for frame in coalesced(batch):
                    kind = frame.WhichOneof("kind")
                    if kind == "tokens":
                        on_tokens(frame.tokens)
                        continue
                    if kind == "routed":
                        self.routed = frame.routed
                    yield frame
                    if kind == "finished":
                        self.close()
                        return
                batch = await self._feed.take()
        except ServiceError as exc:
            self.abort(exc)
            raise RouterError(exc) from None

    def cancel(self) -> None:
        """Asks the router to stop and free the engine work; it answers with a final `finished`."""
        self.router.link.cancel(self.start.request_id)

    def close(self) -> None:
        """The request is over for this side (finished, or left to end on its own): let go of it. One
        that has not ended is cancelled, as a call's end cancelled it."""
        self.abort()

    def abort(self, error: ServiceError | None = None) -> None:
        """Lets go of the request now, cancelling it on the router if it has not ended."""
        if self._released:
            return
        self._released = True
        self.router.link.release(self.start.request_id)
        if error is not None:
            self._span.set_status(trace.StatusCode.ERROR, error.message)
        self._span.end()


class RouterReplica(Replica):
    """One router replica: its channel, and the one stream every request placed through it shares."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.stub = router_pb2_grpc.RouterServiceStub(self.channel)
        self.link = Link(self.stub.GenerateMany, ROUTER_LINK, f"router {address}")

    def busy(self) -> bool:
        return bool(self.link.requests)


class RouterClient:
    """The routers, each reached through one stream shared by every request placed there. A chat's
    requests go to the same router while it is up (rendezvous hashing on the session id, so its session
    hints apply: router/sessions.py), others round-robin; a router that is down is passed over. Names are
    re-resolved every ``refresh_s``: routers that appear are used, those that leave DNS get no new
    requests and are closed once theirs have ended."""

    def __init__(self, address: str, timeout_s: float, refresh_s: float = DNS_REFRESH_S) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._routers = Replicas(address, RouterReplica, refresh_s)

    async def close(self) -> None:
        await self._routers.close()

    async def place(
        self, start: router_pb2.GenerateStart, deadline_s: float, placement_timeout_s: float
    ) -> GenerateStream:
        """A request (``deadline_s`` in all) that a router placed within ``placement_timeout_s``. A router
        that answers UNAVAILABLE (it is draining, or cannot be reached) is passed over for the next, so a
        rolling restart of the routers refuses nothing; any other refusal is raised at once
        (ServiceError, in the orchestrator's words)."""
        tried: set[str] = set()
        refused: ServiceError | None = None  # the last router's UNAVAILABLE
        while len(tried) < PLACEMENT_ATTEMPTS and (router := await self._pick(start.session_id, tried)):
            tried.add(router.address)
            stream = GenerateStream(router, start)
            try:
                await stream.open(deadline_s, placement_timeout_s)
                return stream
            except RouterError as exc:
                if exc.error.code != grpc.StatusCode.UNAVAILABLE:
                    raise from_downstream(exc.error, "the router") from None
                refused = exc.error
                log.info(
                    "request %s: a router is unavailable (%s); trying another", start.request_id, refused
                )
            except BaseException:
                stream.abort()
                raise
        raise from_downstream(refused or unavailable("no router is known; retry", 1.0), "the router")

    async def list_engines(self) -> list[router_pb2.EngineStatus]:
        router = await self._pick("", set())
        if router is None:
            raise from_downstream(unavailable("no router is known; retry", 1.0), "the router")
        try:
            reply = await router.stub.ListEngines(router_pb2.ListEnginesRequest(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, "the router") from exc
        return list(reply.engines)

    async def embed(self, request: router_pb2.EmbedRequest, timeout_s: float) -> router_pb2.EmbedResponse:
        """An embedding call on a router (a unary call: one message each way, nothing streamed), tried
        on the next router when one answers UNAVAILABLE, as ``place`` does."""
        tried: set[str] = set()
        refused: ServiceError = unavailable("no router is known; retry", 1.0)
        while len(tried) < PLACEMENT_ATTEMPTS and (router := await self._pick("", tried)):
            tried.add(router.address)
            try:
                return await router.stub.Embed(request, timeout=timeout_s)
            except grpc.aio.AioRpcError as exc:
                refused = parse(exc)
                if refused.code != grpc.StatusCode.UNAVAILABLE:
                    break
        raise from_downstream(refused, "the router")

    async def _pick(self, session_id: str, tried: set[str]) -> RouterReplica | None:
        """The router for a request of ``session_id`` ("": any), not among ``tried`` (None if none is
        left): the session's by rendezvous hashing among those up, else the next round-robin; a router
        that is down only when none is up (its own call then says why)."""
        await self._routers.ready()
        return self._routers.pick(session_id, tried)
