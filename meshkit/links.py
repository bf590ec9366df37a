"""Many requests on one ``…Many`` stream: the router's to each engine (engine.v1's GenerateMany), the
orchestrator's to each router (router.v1's), the edge's Complete calls to the orchestrators (chat.v1's
CompleteMany). The client holds a ``Link``; the server serves each call with a ``ServedRequests``.

    callers ─ open / cancel / release ─► Link ─ one message a loop turn ─► ServedRequests ─► work
    callers ◄── each request's feed ◄─── Link ◄── one message a server turn, every request's frames

Why one stream: gRPC costs the same per message whatever it carries (~30 µs of CPU a message in
Python, both sides), and with a stream per request every token was a message. On a shared stream one
engine step's tokens for all of a router's requests there cross as one message, and the starts and
cancels of one loop turn go out as one (docs/benchmarks/front_door.md, "Relay cost per hop").

Each request has a contract of its own, per request id: ``open`` sends its `start` (with the trace
context of its span), ``cancel`` its one `cancel`, and ``release`` is the caller letting go of it (a
request released before it ended is cancelled: a caller that went away frees the peer's work). Its
frames arrive on a ``RequestFeed``, which the caller reads with ``take`` (``meshkit.arrivals.Arrivals``:
every frame that came since the last take), or whose
token frames it takes where they arrive, without a task of its own waking (``RequestFeed.on_tokens``).
The stream is opened on first use and again after it ends; when it fails (the peer died, the connection
dropped), every request on it fails with UNAVAILABLE, as a failed call would. Frames for a request
released meanwhile are dropped here. On the server, a request that is refused or fails ends with
`failed` (its status, serialized), a second `start` for a running request ends that request
INVALID_ARGUMENT, and each request gets a server span of its own from the trace context its start
carried.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import grpc
from google.protobuf.message_factory import GetMessageClass
from opentelemetry import trace

from chatmesh.errors import ServiceError, from_status, parse
from chatmesh.token_text import coalesced
from meshkit.arrivals import Arrivals
from meshkit.telemetry import request_span

# One request message carries frames up to about this many bytes (starts carry prompts); the rest go
# in the next message. Far below gRPC's message limit (meshkit.serving.MAX_MESSAGE_BYTES).
MAX_REQUEST_MESSAGE_BYTES = 1 << 20


@dataclass(frozen=True)
class LinkMessages:
    """The message types of one service's GenerateMany (engine.v1's or router.v1's)."""

    request: type  # GenerateManyRequest
    frame: type  # RequestFrame
    cancel: type  # GenerateCancel
    response: type  # GenerateManyResponse
    response_frame: type  # ResponseFrame
    failed: type  # GenerateFailed
    finished: type  # GenerateFinished
    # The name of each request's spans, client and server: ``<service>/Generate``, one request's work.
    span_name: str

    @classmethod
    def of(cls, pb2: ModuleType) -> LinkMessages:
        """Those of a generated module's service, read from its ``…Many`` method (engine.v1's and
        router.v1's GenerateMany, chat.v1's CompleteMany): its request and response, their `frames`, a
        frame's `cancel` and `failed`. The spans are named for the method less its ``Many``: a request."""
        [service] = pb2.DESCRIPTOR.services_by_name.values()
        [method] = [m for m in service.methods if m.name.endswith("Many") and m.client_streaming]
        frame = method.input_type.fields_by_name["frames"].message_type
        response_frame = method.output_type.fields_by_name["frames"].message_type
        return cls(
            GetMessageClass(method.input_type),
            GetMessageClass(frame),
            GetMessageClass(frame.fields_by_name["cancel"].message_type),
            GetMessageClass(method.output_type),
            GetMessageClass(response_frame),
            GetMessageClass(response_frame.fields_by_name["failed"].message_type),
            GetMessageClass(response_frame.fields_by_name["finished"].message_type),
            f"{service.full_name}/{method.name.removesuffix('Many')}",
        )


class RequestFeed(Arrivals[Any]):
    """One request's frames (a ResponseFrame each) as they arrive on a link; ``take`` raises the
    request's error (ServiceError: its `failed` status, or UNAVAILABLE when its stream ended) after the
    frames before it. Nothing is added after the end.

    A caller that can take a token frame where it arrives sets ``on_tokens``: then each `tokens`
    payload that finds nothing queued before it is handed to it at once, on the link's reading task,
    and its own task is not woken for it (py-spy, holding 8,000 streams: the router's per-request
    tasks, woken once per token, took about half of its main thread). It must not await. What it
    raises ends the feed with that error, for ``take`` to raise: the link's other requests go on. The
    other frames (and tokens queued behind one) wait for ``take`` as before, so the order holds as
    long as the caller handles what it took without awaiting in between.

    A frame read off the stream is a view into the message that brought it, every request's frames of
    one peer message (an engine step's tokens for all of a router's requests), and keeping any view
    keeps all of that message in memory: ~1 MiB for 5,000 requests' tokens. So a frame that waits for
    ``take`` is copied out of it, and what a caller takes is its own to keep (a request's `routed`
    for its whole life, the first batch held by a relay while it waits for the end: until then the
    router held 37-40 KiB per open stream in the 10,000-stream ramps, 22.6 since). ``on_tokens`` gets
    the view and must not keep it."""

    cancelled = False  # its `cancel` went out
    on_tokens: Callable[[Any], None] | None = None

    def add(self, frame: Any) -> None:
        if self.ended:
            return
        kind = frame.WhichOneof("kind")
        if kind == "tokens" and self.on_tokens is not None and not self.queued:
            try:
                self.on_tokens(frame.tokens)
            except Exception as exc:
                self.end(exc)
            return
        super().add(_own(frame))
        if kind == "finished":
            self.end()


class LinkBroken(ServiceError):
    """How a request ends when its stream ends under it (the peer died, the connection dropped, a proxy
    reset it): UNAVAILABLE from the transport, not a status the peer chose."""


def _own(frame: Any) -> Any:
    """``frame`` copied out of the message that brought it, to be kept (``RequestFeed`` says why)."""
    own = type(frame)()
    own.CopyFrom(frame)
    return own


class _Stream:
    """One GenerateMany call, the requests started on it, and the frames for its next message."""

    def __init__(self, open_call: Callable[[AsyncIterator[Any]], Any], messages: LinkMessages) -> None:
        self.feeds: dict[str, RequestFeed] = {}
        self._messages = messages
        self._outbox: asyncio.Queue[Any] = asyncio.Queue()
        self._pending: list[Any] = []
        self.call = open_call(self._requests())
        self.ended = False

    async def _requests(self) -> AsyncIterator[Any]:
        while (message := await self._outbox.get()) is not None:
            yield message

    def send(self, frame: Any) -> None:
        """Queues ``frame``: the frames of one loop turn go out in one message."""
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append(frame)

    def _flush(self) -> None:
        frames, self._pending = self._pending, []
        if self.ended:  # its requests ended with it
            return
        message, size = self._messages.request(), 0
        for frame in frames:
            grows = frame.ByteSize() if frame.HasField("start") else 0  # starts carry prompts
            if size and size + grows > MAX_REQUEST_MESSAGE_BYTES:
                self._outbox.put_nowait(message)
                message, size = self._messages.request(), 0
            message.frames.append(frame)
            size += grows
        self._outbox.put_nowait(message)

    def half_close(self) -> None:
        """Ends the request side once the frames queued so far have gone out: the peer ends the call
        when it has ended every request on it."""
        asyncio.get_running_loop().call_soon(self._outbox.put_nowait, None)

    def end(self) -> None:
        """The call is over: its request side ends too."""
        self.ended = True
        self._outbox.put_nowait(None)


class Link:
    """Every request of this process to one peer, over one GenerateMany stream at a time.
    ``open_call`` starts the RPC with a request iterator (the stub's ``GenerateMany``)."""

    def __init__(
        self, open_call: Callable[[AsyncIterator[Any]], Any], messages: LinkMessages, peer: str
    ) -> None:
        self._open_call = open_call
        self.messages = messages
        self.peer = peer
        self._stream: _Stream | None = None
        self._requests: dict[str, _Stream] = {}  # request id -> the stream it was started on
        self._readers: set[asyncio.Task[None]] = set()

    @property
    def requests(self) -> int:
        """Requests on the link that the callers have not released."""
        return len(self._requests)

    def open(self, start: Any, trace_context: Mapping[str, str], **fields: Any) -> RequestFeed:
        """Sends ``start`` (``fields``: the start frame's others, e.g. router.v1's ``timeout_ms``); the
        request's frames arrive on the returned feed."""
        stream = self._stream
        if stream is None or stream.ended:
            stream = self._stream = _Stream(self._open_call, self.messages)
            reader = asyncio.create_task(self._read(stream))
            self._readers.add(reader)  # held: the loop keeps only weak references to tasks
            reader.add_done_callback(self._readers.discard)
        feed = stream.feeds[start.request_id] = RequestFeed()
        self._requests[start.request_id] = stream
        stream.send(
            self.messages.frame(
                request_id=start.request_id, start=start, trace_context=trace_context, **fields
            )
        )
        return feed

    def cancel(self, request_id: str) -> None:
        """Sends the request's `cancel` (once): the peer ends it with `finished` (CANCELLED)."""
        stream = self._requests.get(request_id)
        if stream is None:
            return
        feed = stream.feeds[request_id]
        if not (feed.ended or feed.cancelled):
            feed.cancelled = True
            stream.send(self.messages.frame(request_id=request_id, cancel=self.messages.cancel()))

    def release(self, request_id: str) -> None:
        """The caller is done with the request: cancelled if it has not ended, forgotten either way."""
        self.cancel(request_id)
        stream = self._requests.pop(request_id, None)
        if stream is not None:
            del stream.feeds[request_id]
            if stream is not self._stream and not stream.feeds:
                stream.half_close()

    def renew(self) -> None:
        """New requests go on a new stream (the peer refused one as it drains, and the next stream may
        reach another replica); the current one carries its requests to their end, then ends."""
        stream, self._stream = self._stream, None
        if stream is not None and not stream.feeds:
            stream.half_close()

    def close(self) -> None:
        """Ends the stream now (the peer is gone): its requests fail with UNAVAILABLE."""
        if self._stream is not None:
            self._stream.call.cancel()

    async def _read(self, stream: _Stream) -> None:
        error: ServiceError = LinkBroken(grpc.StatusCode.UNAVAILABLE, f"the stream to {self.peer} ended")
        try:
            async for message in stream.call:
                for frame in message.frames:
                    feed = stream.feeds.get(frame.request_id)
                    if feed is None:  # released already
                        continue
                    if frame.WhichOneof("kind") == "failed":
                        feed.end(from_status(frame.failed.status))
                    else:
                        feed.add(frame)
        except grpc.aio.AioRpcError as exc:
            error = LinkBroken(grpc.StatusCode.UNAVAILABLE, f"the stream to {self.peer} failed: {parse(exc)}")
        finally:
            stream.end()
            with contextlib.suppress(Exception):
                stream.call.cancel()
            for feed in stream.feeds.values():
                feed.end(error)


class ServedRequests:
    """The server side of one GenerateMany call: applies the client's frames (``start`` and ``cancel``
    hooks), and sends what its requests have to say, every frame since the last message in one (a
    request's token frames that piled up meanwhile merged). A service subclasses it with its hooks;
    ``serve`` is the whole handler. The call ends once the client half-closed and no request is left,
    or the service drains and none is left; cancelling it stops every request still on it."""

    def __init__(self, messages: LinkMessages, draining: Callable[[], bool]) -> None:
        self._messages = messages
        self._draining = draining
        self._spans: dict[str, trace.Span] = {}  # the requests running, by id
        self._pending: dict[str, list[Any]] = {}  # frames to send, by request, in the order news came
        self.news = asyncio.Event()
        self._half_closed = False

    # -- the hooks -------------------------------------------------------------------------------

    def start(self, request_id: str, frame: Any) -> None:
        """Starts the request of ``frame`` (a RequestFrame with `start`); raises ServiceError to refuse
        it. Its frames go out through ``send``, its end through ``end``."""
        raise NotImplementedError

    def cancel(self, request_id: str) -> None:
        """The client's `cancel` for a running request: it ends (``end``) as its work stops."""
        raise NotImplementedError

    def stop(self, request_id: str) -> None:
        """Stops a running request's work at once; it sends nothing more (the call is ending, or the
        request was misused)."""
        raise NotImplementedError

    def gather(self) -> None:
        """Called before each message: a chance to ``send`` news kept elsewhere (the engine's merged
        per-request outputs)."""

    # -- for the hooks ---------------------------------------------------------------------------

    def send(self, frame: Any) -> None:
        self._pending.setdefault(frame.request_id, []).append(frame)
        self.news.set()

    def end(self, request_id: str, last: Any = None, error: ServiceError | None = None) -> None:
        """A running request ended: ``last`` is its last frame (`finished`), or ``error`` its failure."""
        span = self._spans.pop(request_id, None)
        if span is None:
            return
        if error is not None:
            span.set_status(trace.StatusCode.ERROR, error.message)
            last = self._failed(request_id, error)
        if last is not None:
            self.send(last)
        span.end()

    def finish(self, request_id: str, error: ServiceError | None = None) -> None:
        """A running request ended with nothing more to say: an empty `finished` (CompleteMany's), or
        ``error``."""
        last = (
            None
            if error
            else self._messages.response_frame(request_id=request_id, finished=self._messages.finished())
        )
        self.end(request_id, last, error)

    def span(self, request_id: str) -> trace.Span:
        """The running request's server span (its work's spans are its children)."""
        return self._spans[request_id]

    # -- the call --------------------------------------------------------------------------------

    async def serve(
        self, request_iterator: AsyncIterator[Any], wakeups: set[asyncio.Event]
    ) -> AsyncIterator[Any]:
        """The handler's responses. ``wakeups``: the service's, which a drain sets."""
        reader = asyncio.create_task(self._read(request_iterator))
        wakeups.add(self.news)
        try:
            while frames := await self._next_frames():
                yield self._messages.response(frames=frames)
        finally:
            wakeups.discard(self.news)
            reader.cancel()
            for request_id, span in self._spans.items():  # the client went away, or cancelled the call
                self.stop(request_id)
                span.end()
            self._spans = {}

    async def _read(self, request_iterator: AsyncIterator[Any]) -> None:
        with contextlib.suppress(grpc.RpcError):
            async for message in request_iterator:
                for frame in message.frames:
                    kind = frame.WhichOneof("kind")
                    if kind == "start":
                        # The service keeps its start for the request's life: not a view into the
                        # message of every request the client began in that loop turn.
                        self._start(_own(frame))
                    elif kind == "cancel" and frame.request_id in self._spans:
                        self.cancel(frame.request_id)
        self._half_closed = True
        self.news.set()

    def _start(self, frame: Any) -> None:
        request_id = frame.request_id or frame.start.request_id
        if request_id in self._spans:
            # A refusal naming that id would be ambiguous: the running request ends, misused.
            self.stop(request_id)
            self._pending.pop(request_id, None)
            misuse = ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT, "only one `start` frame per request; send `cancel` to stop"
            )
            self.end(request_id, error=misuse)
            return
        self._spans[request_id] = request_span(
            self._messages.span_name, trace.SpanKind.SERVER, frame.trace_context
        )
        try:
            if frame.start.request_id != request_id:
                raise ServiceError(
                    grpc.StatusCode.INVALID_ARGUMENT, "the frame's request_id is not its start's"
                )
            self.start(request_id, frame)
        except ServiceError as exc:
            self.end(request_id, error=exc)

    async def _next_frames(self) -> list[Any]:
        """Waits for news and returns it as frames; [] once the call should end."""
        while True:
            self.gather()
            if self._pending:
                pending, self._pending = self._pending, {}
                frames = []
                for request_id, request_frames in pending.items():
                    for frame in coalesced(request_frames) if len(request_frames) > 1 else request_frames:
                        frame.request_id = request_id
                        frames.append(frame)
                return frames
            if not self._spans and (self._half_closed or self._draining()):
                return []
            self.news.clear()
            await self.news.wait()

    def _failed(self, request_id: str, error: ServiceError) -> Any:
        return self._messages.response_frame(
            request_id=request_id, failed=self._messages.failed(status=error.status())
        )
