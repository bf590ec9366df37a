"""This router's requests to one engine, on one ``GenerateMany`` stream (engine.v1).

    relays ─ open / cancel / release ─► link ─ one message a loop turn ─► engine
    relays ◄── each request's feed ◄─── link ◄── one message per engine step, every request's frames

Why one stream: gRPC costs the same per message whatever it carries (~30 µs of CPU a message in
Python, both sides), and with a stream per request every token was a message. On a shared stream an
engine step's tokens for all of this router's requests there cross as one message, and the starts and
cancels of one loop turn go out as one (README, "relay cost").

Each request keeps Generate's contract, per request id: ``open`` sends its `start` (with the trace
context of its span), ``cancel`` its one `cancel`, and ``release`` is the relay letting go of it (a
request released before it ended is cancelled: a dropped client frees the engine's work, as cancelling
a Generate call does). Its frames arrive on a ``RequestFeed``, which a relay reads as it would read a
call (``chatmesh.streams.Arrivals``: every frame that came since the last take). The stream is opened on first use and
again after it ends; when it fails (the engine died, the connection dropped), every request on it
fails with UNAVAILABLE, and their relays fail over as they would for a failed call. Frames for a
request released meanwhile are dropped here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping

import grpc

from chatmesh.engine.v1 import engine_pb2, engine_pb2_grpc
from chatmesh.errors import from_status, parse, unavailable
from chatmesh.streams import Arrivals

log = logging.getLogger(__name__)

# One request message carries frames up to about this many bytes (starts carry prompts); the rest go
# in the next message. Far below gRPC's message limit (meshkit.serving.MAX_MESSAGE_BYTES).
MAX_REQUEST_MESSAGE_BYTES = 1 << 20


class RequestFeed(Arrivals[engine_pb2.ResponseFrame]):
    """One request's frames as they arrive on a link; ``take`` raises the request's error (ServiceError:
    its `failed` status, or UNAVAILABLE when the stream it was on ended) after the frames before it."""

    def add(self, frame: engine_pb2.ResponseFrame) -> None:
        super().add(frame)
        if frame.WhichOneof("kind") == "finished":
            self.end()


class _Stream:
    """One GenerateMany call, the requests started on it, and the frames for its next message."""

    def __init__(self, stub: engine_pb2_grpc.EngineServiceStub) -> None:
        self.feeds: dict[str, RequestFeed] = {}
        self._outbox: asyncio.Queue[engine_pb2.GenerateManyRequest | None] = asyncio.Queue()
        self._pending: list[engine_pb2.RequestFrame] = []
        self.call = stub.GenerateMany(self._requests())
        self.ended = False

    async def _requests(self) -> AsyncIterator[engine_pb2.GenerateManyRequest]:
        while (message := await self._outbox.get()) is not None:
            yield message

    def send(self, frame: engine_pb2.RequestFrame) -> None:
        """Queues ``frame``: the frames of one loop turn go out in one message."""
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append(frame)

    def _flush(self) -> None:
        frames, self._pending = self._pending, []
        if self.ended:  # its requests ended with it
            return
        message, size = engine_pb2.GenerateManyRequest(), 0
        for frame in frames:
            grows = frame.ByteSize() if frame.HasField("start") else 0  # starts carry prompts
            if size and size + grows > MAX_REQUEST_MESSAGE_BYTES:
                self._outbox.put_nowait(message)
                message, size = engine_pb2.GenerateManyRequest(), 0
            message.frames.append(frame)
            size += grows
        self._outbox.put_nowait(message)

    def end(self) -> None:
        """The call is over: its request side ends too."""
        self.ended = True
        self._outbox.put_nowait(None)


class EngineLink:
    """Every request of this router on one engine, over one GenerateMany stream at a time."""

    def __init__(self, stub: engine_pb2_grpc.EngineServiceStub, engine_id: str) -> None:
        self._stub = stub
        self._engine_id = engine_id
        self._stream: _Stream | None = None
        self._requests: dict[str, _Stream] = {}  # request id -> the stream it was started on
        self._readers: set[asyncio.Task[None]] = set()

    def open(self, start: engine_pb2.GenerateStart, trace_context: Mapping[str, str]) -> RequestFeed:
        """Sends ``start``; the request's frames arrive on the returned feed."""
        stream = self._stream
        if stream is None or stream.ended:
            stream = self._stream = _Stream(self._stub)
            reader = asyncio.create_task(self._read(stream))
            self._readers.add(reader)  # held: the loop keeps only weak references to tasks
            reader.add_done_callback(self._readers.discard)
        feed = stream.feeds[start.request_id] = RequestFeed()
        self._requests[start.request_id] = stream
        stream.send(
            engine_pb2.RequestFrame(request_id=start.request_id, start=start, trace_context=trace_context)
        )
        return feed

    def cancel(self, request_id: str) -> None:
        """Sends the request's `cancel`: the engine ends it with `finished` (CANCELLED) within a step."""
        stream = self._requests.get(request_id)
        if stream is not None and not stream.feeds[request_id].ended:
            stream.send(engine_pb2.RequestFrame(request_id=request_id, cancel=engine_pb2.GenerateCancel()))

    def release(self, request_id: str) -> None:
        """The relay is done with the request: cancelled if it has not ended, forgotten either way."""
        self.cancel(request_id)
        stream = self._requests.pop(request_id, None)
        if stream is not None:
            del stream.feeds[request_id]

    async def _read(self, stream: _Stream) -> None:
        error = unavailable(f"the stream to engine {self._engine_id} ended")
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
            error = unavailable(f"the stream to engine {self._engine_id} failed: {parse(exc)}")
        finally:
            stream.end()
            with contextlib.suppress(Exception):
                stream.call.cancel()
            for feed in stream.feeds.values():
                feed.end(error)
