"""The edge's only dependency: ChatService over gRPC, called with the caller's own token as metadata
(and CompletionLinkService, which carries its run-event streams, and with ``chat_links`` its unary calls,
many to a stream: ``OrchestratorReplica``, ``LinkedRun``, ``linked_unary``).
The edge reaches the orchestrator replicas itself (``Orchestrator``: a chat's calls on one replica, by
its id) or through Envoy's internal listener, which does the same.

Unary calls carry a deadline. Streams carry a (long) deadline too, and are read event by event; the edge
never buffers a run. Cancelling a stream call here only detaches this client: the orchestrator keeps the
run going until it ends or someone calls CancelRun.

A stored chat's run outlives the orchestrator replica streaming it (another replica adopts it, or it
is handed over at a drain): when that stream fails with UNAVAILABLE, the edge attaches again with
StreamRun after the last event it relayed, for a while, with backoff, so the client sees one unbroken
stream. A Complete cannot be resumed (nothing stored it), so its failure is the client's to see.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Container
from dataclasses import dataclass, replace
from typing import Any, Protocol

import grpc
from google.protobuf.message import Message
from opentelemetry import trace

from chatmesh.chat.v1 import chat_pb2, chat_pb2_grpc, completion_link_pb2, completion_link_pb2_grpc
from chatmesh.errors import DRAINING, ServiceError
from chatmesh.identity import AUTHORIZATION_HEADER, CHAT_ID_HEADER, Identity
from chatmesh.linked_calls import linked_call, linked_start, method_of, reply_response
from chatmesh.run_events import MAX_MERGED_DELTAS, merged_delta
from edge.drain import Drain
from edge.errors import ApiError, from_rpc_error, from_run_error
from meshkit.envoy import IDEMPOTENT_METHODS
from meshkit.links import Link, LinkBroken, LinkMessages
from meshkit.replicas import Replica, Replicas
from meshkit.telemetry import request_span, trace_context

log = logging.getLogger(__name__)

# How long a broken run stream is attached again before its failure reaches the client: longer than
# an orchestrator replica takes to be found lost and its runs adopted (orphan_after_s and a reap pass).
REATTACH_FOR_S = 30.0
_REATTACH_FIRST_DELAY_S = 0.1
_REATTACH_MAX_DELAY_S = 2.0

COMPLETION_LINK = LinkMessages.of(completion_link_pb2)
# A call that reads (or repeats harmlessly) is tried on this many replicas when they answer UNAVAILABLE,
# as Envoy retries it; another call goes to one (a send refused there is the client's to retry, with its
# idempotency key).
UNARY_ATTEMPTS = 3
_UNARY_RETRY_DELAY_S = 0.05
# A Complete on a link refused UNAVAILABLE before its first event (nothing of it started: a draining
# replica refused it, or its stream ended or broke, which cancels it there) is sent this many times in
# all: behind Envoy's internal listener the edge cannot tell which links reach a draining replica, and
# two of them can end in the same moment.
START_ATTEMPTS = 3
# How the idempotency key the edge gives a send or regenerate that came without one begins (``LinkedRun``;
# keys are the user's own, and 128 random bits follow, so no key a client chose meets one).
EDGE_KEY_PREFIX = "edge:"

# StreamRun(run_id, after_seq): a call that attaches to a run after the events already relayed (asking
# for merged deltas as the call it replaces did).
Reattach = Callable[[str, int], "EventCall"]


@dataclass(frozen=True, kw_only=True)
class Caller:
    """Who a call is for, proven by their token, and which chat it concerns (Envoy hashes on the chat id)."""

    identity: Identity
    # The caller's `Authorization` value, verified here and passed on: the orchestrator verifies it again.
    authorization: str
    chat_id: str = ""

    def for_chat(self, chat_id: str) -> Caller:
        """The same caller, for a call about ``chat_id``."""
        return replace(self, chat_id=chat_id)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        pairs = [(AUTHORIZATION_HEADER, self.authorization)]
        if self.chat_id:
            pairs.append((CHAT_ID_HEADER, self.chat_id))
        # traceparent is added by the OpenTelemetry gRPC instrumentation from the request's span.
        return tuple(pairs)


class EventCall(Protocol):
    """What ``RunStream`` reads: a ``grpc.aio.UnaryStreamCall``, or a ``LinkedRun``."""

    async def read(self) -> Any: ...

    def cancel(self) -> Any: ...


class RunStream:
    """An open server stream of RunEvents (SendMessage, RegenerateMessage, StreamRun, Complete)."""

    def __init__(
        self,
        call: EventCall,
        drain: Drain,
        reattach: Reattach | None = None,
        run_id: str = "",
        after_seq: int = 0,
    ) -> None:
        self._drain = drain
        self._call = call
        self._reattach = reattach
        # The run (known from the request, or from its `started` event) and the last event relayed.
        self._run_id = run_id
        self._last_seq = after_seq
        self._read_ahead: chat_pb2.RunEvent | None = None  # read by ``opening_answer``, relayed next

    async def first(self) -> chat_pb2.RunEvent | None:
        """The first event, or None for a stream that ended without one (StreamRun after a finished run's
        last event); a call that fails before it raises ApiError (so the HTTP status can say why). When
        the edge drains before the first event comes, it is a 503 to retry (the same Idempotency-Key
        joins the answer if it started), never a request cut off without a status."""
        try:
            with self._drain.watch() as drain:
                response: Any = await drain.wait(self._call.read())
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from exc
        except TimeoutError:
            self.detach()
            raise ApiError(
                503,
                "the server is restarting; retry the request",
                type="server_error",
                code="draining",
                retry_after_s=1.0,
            ) from None
        if response is grpc.aio.EOF:
            return None
        self._saw(response.event)
        return response.event

    def _saw(self, event: chat_pb2.RunEvent) -> None:
        if event.WhichOneof("kind") == "started":
            self._run_id = event.started.run_id
        self._last_seq = event.seq

    async def opening(self) -> chat_pb2.RunEvent:
        """The first event of a stream that always has one (SendMessage, Complete, StreamRun from its
        start): a stream that ends without any is the chat service's fault, 502."""
        first = await self.first()
        if first is None:
            raise ApiError(502, "the chat service ended the stream without any event", type="server_error")
        return first

    async def opening_answer(self, raising: Container[str] | None = None) -> chat_pb2.RunEvent:
        """The opening event, held until the event after `started`: a run refused before its first
        token (an engine dropped it from its queue when its TTFT objective ran out: RESOURCE_EXHAUSTED
        with a retry delay) raises ApiError, so the client gets a status it can act on (429 with
        Retry-After, which OpenAI's SDKs retry) rather than an error after a 200. ``raising``: the
        RunError codes that raise (default: every one). The event read ahead is the first that
        ``rest`` yields."""
        first = await self.opening()
        if first.WhichOneof("kind") != "started":
            return first
        following = await self.first()
        if following is not None and following.WhichOneof("kind") == "error":
            error = following.error
            if raising is None or error.code in raising:
                raise from_run_error(error.code, error.message, error.retry_after_ms)
        self._read_ahead = following
        return first

    async def rest(self) -> AsyncIterator[chat_pb2.RunEvent]:
        """The events after the first; a failure mid-stream raises grpc.RpcError (after attaching again
        for ``REATTACH_FOR_S`` where the run can be resumed)."""
        if self._read_ahead is not None:
            event, self._read_ahead = self._read_ahead, None
            yield event
        given_up_at: float | None = None
        delay = _REATTACH_FIRST_DELAY_S
        while True:
            try:
                response: Any = await self._call.read()
            except grpc.RpcError as exc:
                if not self._resumable(exc):
                    raise
                now = time.monotonic()
                given_up_at = given_up_at or now + REATTACH_FOR_S
                if now + delay > given_up_at:
                    raise
                log.info(
                    "run %s: stream broke (%s); attaching again after event %d",
                    self._run_id,
                    exc.code().name,
                    self._last_seq,
                )
                await asyncio.sleep(delay)
                delay = min(2 * delay, _REATTACH_MAX_DELAY_S)
                assert self._reattach is not None
                self._call = self._reattach(self._run_id, self._last_seq)
                continue
            if response is grpc.aio.EOF:
                return
            given_up_at, delay = None, _REATTACH_FIRST_DELAY_S
            self._saw(response.event)
            yield response.event

    def _resumable(self, exc: grpc.RpcError) -> bool:
        code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else None
        return self._reattach is not None and bool(self._run_id) and code == grpc.StatusCode.UNAVAILABLE

    async def events(self, first: chat_pb2.RunEvent) -> AsyncGenerator[chat_pb2.RunEvent, None]:
        """``first`` and the events after it; a failure mid-stream raises ApiError. Detaches when closed
        (read it inside ``contextlib.aclosing`` to stop early)."""
        try:
            yield first
            async for event in self.rest():
                yield event
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from exc
        finally:
            self.detach()

    def detach(self) -> None:
        """Stops reading. A chat's run goes on (only CancelRun stops it); a Complete is cancelled."""
        self._call.cancel()


class OrchestratorReplica(Replica):
    """One orchestrator replica (or Envoy's internal listener in front of them all): its ChatService stub
    and ``count`` CompleteMany streams (``meshkit.links.Link``) carrying the edge's Complete calls (and
    with ``chat_links`` its other calls): the events of every answer on one stream cross in one message a
    loop turn, where a Complete call costs a message per event each way."""

    def __init__(self, address: str, links: int) -> None:
        super().__init__(address)
        self.stub = chat_pb2_grpc.ChatServiceStub(self.channel)
        link_stub = completion_link_pb2_grpc.CompletionLinkServiceStub(self.channel)
        self.links = [
            Link(
                link_stub.CompleteMany,
                COMPLETION_LINK,
                f"the chat service at {address} (completion link {n})",
            )
            for n in range(links)
        ]

    def busy(self) -> bool:
        return any(link.requests for link in self.links)

    async def close(self, grace_s: float | None = None) -> None:
        for link in self.links:
            link.close()
        await super().close(grace_s)


class LinkedRun:
    """One run-event stream on a completion link, read as its call is (``read`` and ``cancel``, the part
    of ``grpc.aio.UnaryStreamCall`` that ``RunStream`` uses): a Complete, or a stored chat's SendMessage,
    RegenerateMessage or StreamRun (``start.stored``). Its events, then EOF; a failure raises the
    AioRpcError the call would have raised (with its status details when the orchestrator sent them,
    without when the stream broke), so the edge answers it the same way.

    A Complete goes on the least busy link of the replicas up; a stored chat's stream on a link of its
    chat's replica (where its run is live, as its call would go). Deltas that arrived together are read
    as one (``chatmesh.run_events``) when the request asked for merged deltas, as the orchestrator merges
    them for a call whose reader fell behind. A request refused UNAVAILABLE before its first event (its
    replica drains, or its stream broke, which cancels it there) is sent again (``START_ATTEMPTS`` in
    all; ``_resendable`` says which), to another replica than those where it failed (when there is one),
    on a new stream (its start, conversation and all, is kept until the first event only)."""

    def __init__(
        self, orchestrator: Orchestrator, start: completion_link_pb2.CompleteStart, caller: Caller
    ) -> None:
        self._orchestrator = orchestrator
        name, request = linked_call(start)
        self._merge_deltas = request.merge_deltas
        self._chat_id = caller.chat_id if start.WhichOneof("stored") else ""
        # A send or regenerate (the requests with an idempotency key) is sent again only when nothing of
        # it can start twice (``_resendable``). One that came without a key gets one of the edge's making,
        # the same on every attempt: sent again after its stream broke, it joins the run it may have
        # started instead of starting another (the orchestrator would make it a key of its own anyway).
        self._starts_stored_run = "idempotency_key" in request.DESCRIPTOR.fields_by_name
        if self._starts_stored_run and not request.idempotency_key:
            request.idempotency_key = f"{EDGE_KEY_PREFIX}{secrets.token_hex(16)}"
        self._start: completion_link_pb2.CompleteStart | None = start
        self._span = request_span(name, trace.SpanKind.CLIENT)
        self._frames: deque[completion_link_pb2.CompleteResponseFrame] = deque()
        self._failed_on: set[str] = set()  # replicas where it failed UNAVAILABLE
        self._attempts = 1
        self._ended = False
        self._open(start)

    def _open(self, start: completion_link_pb2.CompleteStart) -> None:
        # A new run's first event (`started`) comes once the replica took it: one that does not come in
        # time is refused, as gRPC sheds a call not taken. StreamRun's first event may be the run's
        # next token, however far off.
        self._start_by = (
            None
            if start.HasField("stream_run")
            else asyncio.get_running_loop().time() + self._orchestrator.completion_start_timeout_s
        )
        self._replica, self._link = self._orchestrator.least_busy_link(self._chat_id, self._failed_on)
        self._request_id = start.request_id = secrets.token_hex(8)
        self._feed = self._link.open(
            start, trace_context(self._span), timeout_ms=round(self._orchestrator.stream_timeout_s * 1000)
        )

    async def read(self) -> Any:
        """The next response (a frame with the ``event``), or ``grpc.aio.EOF`` after the last."""
        while not self._frames:
            if self._ended:
                return grpc.aio.EOF
            try:
                if self._start is None:
                    self._frames.extend(await self._feed.take())
                else:
                    async with asyncio.timeout_at(self._start_by):
                        self._frames.extend(await self._feed.take())
            except TimeoutError:
                # Its `cancel` goes out: should the run start after all, a Complete stops (a send's run
                # goes on, which a retry with its idempotency key joins).
                self._end()
                raise _not_started(self._orchestrator.completion_start_timeout_s) from None
            except ServiceError as error:
                start = self._start
                if start is None or self._attempts >= START_ATTEMPTS or not self._resendable(error):
                    self._end(error)
                    raise _call_error(error) from None
                # It goes to another replica than the one that refused it (draining) or whose stream
                # broke (dead, most likely); behind Envoy's internal listener, on a new stream, which
                # may reach another.
                self._failed_on.add(self._replica.address)
                if not isinstance(error, LinkBroken):
                    self._link.renew()
                self._link.release(self._request_id)
                self._attempts += 1
                self._open(start)
        frame = self._frames.popleft()
        if frame.WhichOneof("kind") == "finished":
            self._end()
            return grpc.aio.EOF
        self._start = None
        if self._merge_deltas and frame.event.HasField("delta") and self._frames:
            return self._merged(frame)
        return frame

    def _resendable(self, error: ServiceError) -> bool:
        """Whether a request that failed with ``error`` before its first event goes again: UNAVAILABLE
        (its replica refused it draining, or its stream broke) for a Complete or StreamRun, which repeat
        harmlessly; a send or regenerate when its replica refused it draining (``DRAINING``: nothing of it
        was stored), or when its stream broke (the replica is gone, most likely: its idempotency key joins
        the run should it have started). Another refusal (busy) is the client's to read, with its retry
        delay (the chat page counts it down)."""
        if error.code != grpc.StatusCode.UNAVAILABLE:
            return False
        return not self._starts_stored_run or error.reason == DRAINING or isinstance(error, LinkBroken)

    def _merged(self, first: completion_link_pb2.CompleteResponseFrame) -> Any:
        deltas, last = [first.event.delta], first.event.seq
        while (
            self._frames
            and self._frames[0].WhichOneof("kind") == "event"
            and self._frames[0].event.HasField("delta")
            and len(deltas) < MAX_MERGED_DELTAS
        ):
            event = self._frames.popleft().event
            deltas.append(event.delta)
            last = event.seq
        merged = merged_delta(
            last,
            [(delta.text, delta.token_count) for delta in deltas],
            [logprob for delta in deltas for logprob in delta.logprobs],
        )
        return completion_link_pb2.CompleteResponseFrame(event=merged)

    def cancel(self) -> None:
        """The caller left: a Complete's answer is cancelled (it cannot be resumed), a stored chat's run
        goes on."""
        self._end()

    def _end(self, error: ServiceError | None = None) -> None:
        if self._ended:
            return
        self._ended = True
        self._link.release(self._request_id)
        if error is not None:
            self._span.set_status(trace.StatusCode.ERROR, error.message)
        self._span.end()


async def linked_unary(link: Link, start: completion_link_pb2.CompleteStart, timeout_s: float) -> Any:
    """The response of the unary call ``start`` stands for, made on ``link`` within ``timeout_s``;
    a failure raises the AioRpcError the call would have raised (DEADLINE_EXCEEDED past its time, when
    its `cancel` goes out). Why not a call: the orchestrator's gRPC server takes one new call a loop turn,
    and a replica whose loop runs late under load (800 stored streams) took a few a second, so a cancel
    waited there for longer than its time; the requests of one link message start in one turn."""
    name, request = linked_call(start)
    method = method_of(request)
    span = request_span(name, trace.SpanKind.CLIENT)
    start.request_id = secrets.token_hex(8)
    feed = link.open(start, trace_context(span), timeout_ms=round(timeout_s * 1000))
    try:
        async with asyncio.timeout(timeout_s):
            while frames := await feed.take():
                for frame in frames:
                    if frame.WhichOneof("kind") == "reply":
                        return reply_response(method, frame.reply)
        raise ValueError(f"the {method} call ended without its response")
    except TimeoutError:
        span.set_status(trace.StatusCode.ERROR, "the call's deadline passed")
        raise _transport_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
    except ServiceError as error:
        span.set_status(trace.StatusCode.ERROR, error.message)
        raise _call_error(error) from None
    except ValueError as exc:  # the orchestrator answered out of contract
        span.set_status(trace.StatusCode.ERROR, str(exc))
        raise _transport_error(grpc.StatusCode.INTERNAL, str(exc)) from None
    finally:
        link.release(start.request_id)
        span.end()


def _not_started(timeout_s: float) -> grpc.aio.AioRpcError:
    """A request whose run did not start in time, as gRPC reports a call it shed: CANCELLED without
    details (the edge answers 503, too busy, retry)."""
    return _transport_error(grpc.StatusCode.CANCELLED, f"the answer did not start within {timeout_s:g} s")


def _transport_error(code: grpc.StatusCode, message: str) -> grpc.aio.AioRpcError:
    """A failure as the transport reports one: without status details (its text is not for users)."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), message)


def _call_error(error: ServiceError) -> grpc.aio.AioRpcError:
    """``error`` as a failed call reports it: the orchestrator's status details in the trailer, or none
    when the stream broke (the transport's failure, whose text is not for users)."""
    trailer = () if isinstance(error, LinkBroken) else error.trailer()
    return grpc.aio.AioRpcError(error.code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailer), error.message)


def _unreachable() -> grpc.aio.AioRpcError:
    """No replica of the chat service is known: the error of a call that cannot connect."""
    return _call_error(LinkBroken(grpc.StatusCode.UNAVAILABLE, "no chat service replica is known"))


class Orchestrator:
    """A ChatService client over the replicas ``target`` names (``meshkit.replicas``): Envoy's internal
    listener (one address, which balances by itself), or the orchestrator replicas (a list, or a
    ``dns:///`` name with one address per replica: a headless Service), one channel each (HTTP/2
    multiplexes every call and stream). A chat's calls go to one replica while it is up (rendezvous
    hashing on the chat id, as Envoy's ring hash keeps a chat on one), others round-robin; a replica down
    or draining (its health says so first) is passed over, and a call that reads or repeats harmlessly
    (``IDEMPOTENT_METHODS``) is tried again on another replica when one refuses it UNAVAILABLE. Complete
    goes on the replicas' completion links when ``completion_links`` > 0, the least busy link of those
    up, and with ``chat_links`` so do a stored chat's streams, on a link of its chat's replica (behind a
    proxy that balances, Envoy's internal listener, a link's replica is not the chat's: leave it off), and
    its unary calls too.
    ``start`` before use (it resolves the names once)."""

    def __init__(
        self,
        target: str,
        unary_timeout_s: float,
        stream_timeout_s: float,
        drain: Drain,
        completion_links: int = 0,
        completion_start_timeout_s: float = 30.0,
        chat_links: bool = False,
    ) -> None:
        self.target = target
        self.drain = drain
        self.unary_timeout_s = unary_timeout_s
        self.stream_timeout_s = stream_timeout_s
        self.completion_links = completion_links
        self.completion_start_timeout_s = completion_start_timeout_s
        self.chat_links = chat_links
        self._replicas = Replicas(
            target,
            lambda address: OrchestratorReplica(address, completion_links),
            leaving_grace_s=stream_timeout_s,
        )

    async def start(self) -> None:
        await self._replicas.ready()

    async def close(self) -> None:
        await self._replicas.close()

    def least_busy_link(
        self, chat_id: str = "", failed_on: Container[str] = ()
    ) -> tuple[OrchestratorReplica, Link]:
        """The completion link with the fewest requests of the chat's replica (``chat_id``), or of the
        replicas up (no chat), but those a request ``failed_on`` (unless only they are left); raises the
        error of a call that cannot connect when no replica is known."""
        if not self._replicas.candidates(failed_on):
            failed_on = ()
        if chat_id:
            chosen = self._replicas.pick(chat_id, failed_on)
            replicas = [] if chosen is None else [chosen]
        else:
            replicas = self._replicas.candidates(failed_on)
        links = [(replica, link) for replica in replicas for link in replica.links]
        if not links:
            raise _unreachable()
        return min(links, key=lambda pair: pair[1].requests)

    async def unary(self, method: str, request: Message, caller: Caller) -> Any:
        """Calls ``method`` with a deadline and returns its response message; a failure raises the
        matching ApiError. (The stub's method is looked up by name, so the response type is the caller's
        to know.) With ``chat_links`` it goes on the least busy completion link of the replica its call
        would go to (``linked_unary``)."""
        tried: set[str] = set()
        attempts = UNARY_ATTEMPTS if method in IDEMPOTENT_METHODS else 1
        while True:
            replica = self._replicas.pick(caller.chat_id, tried)
            try:
                if replica is None:
                    raise _unreachable()
                if self.completion_links and self.chat_links:
                    link = min(replica.links, key=lambda link: link.requests)
                    start = linked_start(method, caller.authorization, request)
                    return await linked_unary(link, start, self.unary_timeout_s)
                return await getattr(replica.stub, method)(
                    request, metadata=caller.metadata(), timeout=self.unary_timeout_s
                )
            except grpc.RpcError as exc:
                if replica is None or not self._tried_again(exc, tried, replica.address, attempts):
                    raise from_rpc_error(exc) from exc
                await asyncio.sleep(_UNARY_RETRY_DELAY_S)

    def _tried_again(self, exc: grpc.RpcError, tried: set[str], address: str, attempts: int) -> bool:
        """Whether a call that failed with ``exc`` on ``address`` goes to another replica: UNAVAILABLE (the
        replica drains, or cannot be reached), fewer than ``attempts`` made, and another replica left
        (else the client reads this one's answer)."""
        tried.add(address)
        code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else None
        return (
            code == grpc.StatusCode.UNAVAILABLE
            and len(tried) < attempts
            and bool(self._replicas.candidates(tried))
        )

    def stream(self, method: str, request: Message, caller: Caller) -> RunStream:
        try:
            call = self._run_call(method, request, caller)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from exc
        if method == "Complete":
            return RunStream(call, self.drain)

        def reattach(run_id: str, after_seq: int) -> EventCall:
            attach = chat_pb2.StreamRunRequest(
                run_id=run_id, after_seq=after_seq, merge_deltas=getattr(request, "merge_deltas", False)
            )
            return self._run_call("StreamRun", attach, caller)

        if isinstance(request, chat_pb2.StreamRunRequest):
            return RunStream(call, self.drain, reattach, request.run_id, request.after_seq)
        return RunStream(call, self.drain, reattach)

    def _run_call(self, method: str, request: Message, caller: Caller) -> EventCall:
        """A run-event stream: on a completion link (Complete, and a stored chat's streams with
        ``chat_links``), else a call."""
        if self.completion_links and (method == "Complete" or self.chat_links):
            return LinkedRun(self, linked_start(method, caller.authorization, request), caller)
        return self._call(method, request, caller)

    def _call(self, method: str, request: Message, caller: Caller) -> grpc.aio.UnaryStreamCall:
        """A stream call on the caller's replica; raises the error of a call that cannot connect when no
        replica is known."""
        replica = self._replicas.pick(caller.chat_id)
        if replica is None:
            raise _unreachable()
        call: grpc.aio.UnaryStreamCall = getattr(replica.stub, method)(
            request, metadata=caller.metadata(), timeout=self.stream_timeout_s
        )
        return call
