"""The bidirectional ``Generate`` stream protocol of engine.v1 and router.v1, for servers and clients:
the request side is one ``start`` frame, then at most one ``cancel`` frame. A half-close is not a cancel.

Server side (engine and router services)::

    requests = StartThenCancel(request_iterator)
    start = await requests.start(context)          # INVALID_ARGUMENT unless the first frame is `start`
    requests.watch(on_cancel=...)                  # the one `cancel`; anything else is misuse
    ...
    await requests.check(context)                  # misuse -> INVALID_ARGUMENT
    requests.stop()

Client side (the orchestrator's router calls): an ``Outbox`` is the call's request iterator; ``start``
once, ``cancel`` at most once, ``close`` ends the request side. Sending never waits. A ``ReadAhead`` reads
the response side as it arrives, so a reader that falls behind takes what came meanwhile in one go; the
router's requests to an engine share one stream, and each request's frames wait in ``Arrivals`` of
their own (``meshkit.links``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any, Generic, TypeVar

import grpc

# How long a peer may take to end a call after its last meaningful frame.
END_OF_CALL_TIMEOUT_S = 5.0

Frame = TypeVar("Frame")
MISUSE = "only one `start` frame per stream; send `cancel` to stop"


class StartThenCancel:
    """The request side of a ``Generate`` call, as its server reads it."""

    def __init__(self, request_iterator: AsyncIterator[Any]) -> None:
        self._frames = aiter(request_iterator)
        self._reader: asyncio.Task[None] | None = None
        # Set when the client sent something other than one `cancel` after `start`.
        self.misuse: str | None = None

    async def start(self, context: grpc.aio.ServicerContext) -> Any:
        """The `start` frame's payload; ends the call with INVALID_ARGUMENT if the first frame is not one."""
        first = await anext(self._frames, None)
        if first is None or first.WhichOneof("kind") != "start":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first frame must be `start`")
        return first.start

    def watch(self, on_cancel: Callable[[], None]) -> None:
        """Reads the frames after `start` in the background: the first one calls ``on_cancel`` (a frame
        other than `cancel` is misuse, and cancels too). A half-close just ends the reading."""
        self._reader = asyncio.create_task(self._read(on_cancel))

    async def _read(self, on_cancel: Callable[[], None]) -> None:
        with contextlib.suppress(grpc.RpcError, asyncio.CancelledError):
            async for frame in self._frames:
                if frame.WhichOneof("kind") != "cancel":
                    self.misuse = MISUSE
                on_cancel()
                return

    async def check(self, context: grpc.aio.ServicerContext) -> None:
        """Ends the call with INVALID_ARGUMENT if the client misused the stream."""
        if self.misuse:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, self.misuse)

    def stop(self) -> None:
        if self._reader is not None:
            self._reader.cancel()


class Outbox(Generic[Frame]):
    """The request side of a ``Generate`` call, as its client writes it: pass ``frames()`` as the call's
    request iterator. A queue, so a cancel goes out the moment it is asked for; ``close`` ends the
    iterator (a request iterator left open would outlive the call inside gRPC)."""

    def __init__(self, cancel_frame: Frame) -> None:
        self._queue: asyncio.Queue[Frame | None] = asyncio.Queue()
        self._cancel_frame = cancel_frame
        self._cancelled = False
        self._closed = False

    async def frames(self) -> AsyncIterator[Frame]:
        while (frame := await self._queue.get()) is not None:
            yield frame

    def start(self, frame: Frame) -> None:
        self._queue.put_nowait(frame)

    def cancel(self) -> None:
        """Sends the `cancel` frame, once, unless the request side is closed."""
        if not (self._cancelled or self._closed):
            self._cancelled = True
            self._queue.put_nowait(self._cancel_frame)

    def close(self) -> None:
        """Half-closes the request side (once)."""
        if not self._closed:
            self._closed = True
            self._queue.put_nowait(None)


class Wakeup:
    """Wakes the tasks waiting on it: ``asyncio.Event``'s job on a path taken for every token, without
    its cost there. ``Event.wait`` asks for the running loop on every call, and on Python 3.11 that asks
    the kernel for the process id: a system call per token per hop (with asyncio's timeouts, which ask
    too, 13 % of the orchestrator's main thread at 3,000 open streams: py-spy). This one keeps the loop
    it first waited on. It has no flag to set or clear: ``wait`` returns at the next ``notify``, so a
    waiter checks its condition first, with no ``await`` between the check and ``wait``."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters: list[asyncio.Future[None]] = []

    def notify(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()

    async def wait(self) -> None:
        waiter = self._waiter()
        try:
            await waiter
        finally:
            if waiter.cancelled() and waiter in self._waiters:
                self._waiters.remove(waiter)

    async def wait_or(self, other: Wakeup) -> None:
        """Returns at the next notify of this one or of ``other``. The waiter leaves ``other``'s list as
        it returns and this one's at its next notify (taking it off a list is a walk of the list), so
        ``other`` is the one with few waiters: a run's end beside a tick every stream waits on."""
        waiter = self._waiter()
        other._waiters.append(waiter)
        try:
            await waiter
        finally:
            if waiter in other._waiters:
                other._waiters.remove(waiter)
            if waiter.cancelled() and waiter in self._waiters:
                self._waiters.remove(waiter)

    def _waiter(self) -> asyncio.Future[None]:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        waiter = self._loop.create_future()
        self._waiters.append(waiter)
        return waiter


class Arrivals(Generic[Frame]):
    """Frames that arrived and were not taken yet, then how the stream of them ended. ``take`` returns
    every frame that arrived since the last ``take``: a consumer that keeps up gets them one by one, as
    soon as each arrives; one that fell behind (its own writes waiting on a slow client) gets them all
    at once, and can merge them into one message instead of paying gRPC's per-message cost for each.
    What waits here is bounded by the stream's own output; nothing is dropped."""

    def __init__(self) -> None:
        self._frames: deque[Frame] = deque()
        self._error: BaseException | None = None
        self.ended = False
        self._arrived = Wakeup()

    def add(self, frame: Frame) -> None:
        self._frames.append(frame)
        self._arrived.notify()

    @property
    def queued(self) -> int:
        """Frames that arrived and were not taken yet."""
        return len(self._frames)

    def end(self, error: BaseException | None = None) -> None:
        """No frame comes after this; ``take`` raises ``error``, if any, once the frames before it are
        taken. Only the first end counts."""
        if not self.ended:
            self.ended, self._error = True, error
            self._arrived.notify()

    async def take(self) -> list[Frame]:
        """Waits for at least one frame; returns all that have arrived, oldest first. Returns [] once the
        stream has ended well and everything was taken; raises its error after the frames before it."""
        while not self._frames:
            if self.ended:
                if self._error is not None:
                    raise self._error
                return []
            await self._arrived.wait()
        frames = list(self._frames)
        self._frames.clear()
        return frames


class ReadAhead(Arrivals[Any]):
    """A call's responses as ``Arrivals``, read as they arrive by a task of its own; ``take`` raises the
    call's error (grpc.aio.AioRpcError)."""

    def __init__(self, call: grpc.aio.StreamStreamCall) -> None:
        super().__init__()
        self._call = call
        self._task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        error = None
        try:
            while (frame := await self._call.read()) is not grpc.aio.EOF:
                self.add(frame)
        except grpc.aio.AioRpcError as exc:
            error = exc
        finally:
            self.end(error)

    async def finish(self, timeout_s: float = END_OF_CALL_TIMEOUT_S) -> None:
        """Reads the call up to its status, or cancels it after ``timeout_s``. Call it once the last frame
        that matters has arrived (and the request side is closed): a call left unread completes only
        when it is garbage-collected, and so does its client trace span, which then never joins the
        trace in time."""
        # wait(), not await: the reading task's own end (a call cancelled meanwhile) is not ours to raise.
        done, _ = await asyncio.wait({self._task}, timeout=timeout_s)
        if not done:
            self.cancel()

    def stop(self) -> None:
        """Stops reading (the call itself goes on; a consumer that leaves early ends it its own way)."""
        self._task.cancel()

    def cancel(self) -> None:
        """Cancels the call and stops reading."""
        self._call.cancel()
        self.stop()
