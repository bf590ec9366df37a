"""Many requests to one peer on one ``GenerateMany`` stream, as the client holds it: the router's link
to each engine (engine.v1), the orchestrator's to each router (router.v1).

    callers ─ open / cancel / release ─► link ─ one message a loop turn ─► peer
    callers ◄── each request's feed ◄─── link ◄── one message per peer turn, every request's frames

Why one stream: gRPC costs the same per message whatever it carries (~30 µs of CPU a message in
Python, both sides), and with a stream per request every token was a message. On a shared stream one
engine step's tokens for all of a router's requests there cross as one message, and the starts and
cancels of one loop turn go out as one (README, "relay cost").

Each request keeps ``Generate``'s contract, per request id: ``open`` sends its `start` (with the trace
context of its span), ``cancel`` its one `cancel`, and ``release`` is the caller letting go of it (a
request released before it ended is cancelled: a caller that went away frees the peer's work, as
cancelling a Generate call does). Its frames arrive on a ``RequestFeed``, which the caller reads as it
would read a call (``chatmesh.streams.Arrivals``: every frame that came since the last take). The
stream is opened on first use and again after it ends; when it fails (the peer died, the connection
dropped), every request on it fails with UNAVAILABLE, as a failed call would. Frames for a request
released meanwhile are dropped here.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from chatmesh.errors import from_status, parse, unavailable
from chatmesh.streams import Arrivals

# One request message carries frames up to about this many bytes (starts carry prompts); the rest go
# in the next message. Far below gRPC's message limit (meshkit.serving.MAX_MESSAGE_BYTES).
MAX_REQUEST_MESSAGE_BYTES = 1 << 20


@dataclass(frozen=True)
class LinkMessages:
    """The message types of one service's GenerateMany (engine.v1's or router.v1's)."""

    request: type  # GenerateManyRequest
    frame: type  # RequestFrame
    cancel: type  # GenerateCancel


class RequestFeed(Arrivals[Any]):
    """One request's frames (a ResponseFrame each) as they arrive on a link; ``take`` raises the
    request's error (ServiceError: its `failed` status, or UNAVAILABLE when its stream ended) after the
    frames before it."""

    cancelled = False  # its `cancel` went out

    def add(self, frame: Any) -> None:
        super().add(frame)
        if frame.WhichOneof("kind") == "finished":
            self.end()


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
        self._messages = messages
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
            stream = self._stream = _Stream(self._open_call, self._messages)
            reader = asyncio.create_task(self._read(stream))
            self._readers.add(reader)  # held: the loop keeps only weak references to tasks
            reader.add_done_callback(self._readers.discard)
        feed = stream.feeds[start.request_id] = RequestFeed()
        self._requests[start.request_id] = stream
        stream.send(
            self._messages.frame(
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
            stream.send(self._messages.frame(request_id=request_id, cancel=self._messages.cancel()))

    def release(self, request_id: str) -> None:
        """The caller is done with the request: cancelled if it has not ended, forgotten either way."""
        self.cancel(request_id)
        stream = self._requests.pop(request_id, None)
        if stream is not None:
            del stream.feeds[request_id]

    def close(self) -> None:
        """Ends the stream now (the peer is gone): its requests fail with UNAVAILABLE."""
        if self._stream is not None:
            self._stream.call.cancel()

    async def _read(self, stream: _Stream) -> None:
        error = unavailable(f"the stream to {self.peer} ended")
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
            error = unavailable(f"the stream to {self.peer} failed: {parse(exc)}")
        finally:
            stream.end()
            with contextlib.suppress(Exception):
                stream.call.cancel()
            for feed in stream.feeds.values():
                feed.end(error)
